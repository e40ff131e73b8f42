"""Attention backward, as in ``kernel_backward.h``, with FA3's five-matmul schedule.

1. ``_bwd_preprocess``: ``delta = rowsum(dO * O) - dlse`` and the lse in log2 units (a row that saw
   no key gets +inf there, so its recomputed probabilities are exactly 0); zeros the fp32 dQ accumulator
   (unless dQ is computed in its own kernel).
2. ``_bwd_kv_kernel``: one program per (key block, kv head, sequence) keeps dK and dV in registers,
   walks the query tiles that can see its keys (for each q head of its GQA group), recomputes
   P = exp2(S - lse), and computes dV += (P∘M)ᵀ dO, dP = (dO Vᵀ)∘M (M: the dropout keep mask scaled by
   1/(1-p)), dS = P (dP - delta), dK += dSᵀ Q, and, unless the dQ kernel runs, dQ += dS K added into an
   fp32 buffer: a TMA bulk reduce of the whole tile on Hopper (``DQ_MODE`` 2), element atomics elsewhere
   and under the interpreter (1). dS is also the bias gradient (``scores.bias_grad``). float32 at full
   accuracy (``SPLIT``): each product is six bf16 dots of three bf16 parts per operand (``parts.py``), split
   once per call for the loaded ones (Q, K, V, dO) and per tile for P and dS.
3. ``_bwd_q_kernel`` (``DQ_MODE`` 0, also the deterministic mode): one program per query block walking
   its key tiles computes dQ without atomics (recomputing S and dP: seven matmuls of work for five
   counted); a broadcast bias then gets its gradient from ``_bwd_dbias_kernel``, one program per
   bias-gradient tile looping over the broadcast batches, heads, queries and keys in a fixed order.

Jagged batches: the kv and dQ kernels take the sequences longest first (``program.longest_first``).
"""

import collections

import torch

from ..._kernel_math import LOG2E
from ..._launch import fast_launch
from ..._triton import tl, triton
from ...tiling import cdiv
from ..gluon import backward as gluon_backward
from ..gluon import backward_dq as gluon_backward_dq
from ..gluon import backward_wide as gluon_backward_wide
from .configs import DQ_SEPARATE, DQ_TMA
from .launch import (
    DATA_DEPENDENT,
    constexprs,
    ensure_allocator,
    features,
    head_block,
    tiles,
    use_tma,
)
from .masks import Mask, SeqMask, key_stages, mask_args, query_stages, seq_mask
from .parts import bf16_parts, dot6, load_parts, part_args, part_descs, runs_split, split_bf16, trans3
from .program import (
    Rows,
    Seq,
    Seqs,
    base,
    batch,
    key_block_grid,
    longest_first,
    lse_row,
    prologue,
    rows,
    seqs,
    sequence,
)
from .scores import (
    Dropout,
    HeadDropout,
    HeadScores,
    Scores,
    bias_grad,
    broadcast_strides,
    dropout_args,
    head_dropout,
    head_scores,
    keep_tile,
    score_args,
    score_tile,
    softcap_grad,
)
from .tiles import load_rows, rows_desc, store_rows

# The bias gradient (runtime bundle: pointer and broadcast strides) and how the kernels write it
# (constexpr): MODE 0 none, 1 a full-shape bias (each element stored once), 2 a broadcast bias (tile sums
# added atomically); BQ / BK: the bias is broadcast over queries / keys.
DBias = collections.namedtuple("DBias", "ptr sb sh sq sk")
DBiasMode = collections.namedtuple("DBiasMode", "MODE BQ BK")
DBIAS_NONE, DBIAS_STORE, DBIAS_ATOMIC = 0, 1, 2
GLUON_FIRST_STORES = 3  # the Gluon kernel's float32 gradient stored by the first sequence (gluon_backward.stores_first)

# Dense causal calls with fewer kv programs per SM start every first key block first (program.blocks_last):
# H100, kernel level, every measured shape gained, up to 2048 programs (15.5 per SM; +4-29% bf16, dropout, fp32;
# bench/NOTES.md); larger counts were not measured.
KV_PROGRAMS_PER_SM = 16


@fast_launch
@triton.jit(do_not_specialize=DATA_DEPENDENT)
def _bwd_preprocess(O: Rows, dO: Rows, dQ: Rows, dLSE, LSE, DELTA, LSE2, seqs: Seqs, total_q, total_k, max_q,
                    max_k, F: tl.constexpr, HAS_DLSE: tl.constexpr, ZERO_DQ: tl.constexpr, DV: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid ``(cdiv(max_q, BLOCK_M), H, B)``. Writes DELTA = rowsum(dO * O) - dLSE and LSE2 = LSE * log2(e)
    (+inf for a query that sees no key), lse-shaped fp32 like LSE and dLSE; O and dO are shaped like Q
    with head dim DV. ZERO_DQ: also zeros the rows of the fp32 dQ accumulator (head dim BLOCK_D), which the kv
    kernels (this module's and the Gluon one) then add into, as FlashAttention-2's preprocess does: one launch
    and one allocation fewer than a separate ``torch.zeros``, the same bytes written."""
    block = tl.program_id(0)
    h = tl.program_id(1)
    bt = batch(seqs, total_q, total_k, max_q, max_k)
    seq = sequence(bt, tl.program_id(2), F)
    m0 = block * BLOCK_M
    if m0 >= seq.Lq:
        return
    rows_m = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows_m < seq.Lq
    o = load_rows(base(O, seq.b, seq.q_start, h), m0, seq.Lq, O.stride_s, DV, BLOCK_M, BLOCK_DV, True, False)
    do = load_rows(base(dO, seq.b, seq.q_start, h), m0, seq.Lq, dO.stride_s, DV, BLOCK_M, BLOCK_DV, True, False)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(lse_row(dLSE, bt, seq, h, F) + rows_m, mask=row_ok, other=0.0)
    lse = tl.load(lse_row(LSE, bt, seq, h, F) + rows_m, mask=row_ok, other=0.0)
    tl.store(lse_row(DELTA, bt, seq, h, F) + rows_m, delta, mask=row_ok)
    tl.store(lse_row(LSE2, bt, seq, h, F) + rows_m, tl.where(lse == float("-inf"), float("inf"), lse * LOG2E),
             mask=row_ok)
    if ZERO_DQ:
        store_rows(base(dQ, seq.b, seq.q_start, h), m0, seq.Lq, dQ.stride_s,
                   tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32), BLOCK_D, BLOCK_M, BLOCK_D)


@triton.jit
def _ds_tile(q, do, lse2, delta, k, v, m0, n0, seq: Seq, m: SeqMask, hs: HeadScores, hd: HeadDropout,
             F: tl.constexpr, T: tl.constexpr, MASKED: tl.constexpr):
    """(dS in natural units, dS through the softcap) of queries ``m0..`` x keys ``n0..`` (query-major)."""
    qk = tl.dot(q, tl.trans(k), input_precision=T.DOT_PRECISION)
    s, t = score_tile(qk, m0 + tl.arange(0, T.BLOCK_M)[:, None], n0 + tl.arange(0, T.BLOCK_N)[None, :], seq.Lq,
                      seq.Lk, m, hs, F, MASKED, False, T.DOT_PRECISION == "tf32x3")
    p = tl.exp2(s - lse2[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=T.DOT_PRECISION)
    if F.DROPOUT:
        dp = tl.where(keep_tile(hd, m0, n0, T.BLOCK_M, T.BLOCK_N, F.POSITIONS), dp * hd.keep_scale, 0.0)
    ds = p * (dp - delta[:, None])
    return ds, softcap_grad(ds, t, F)


@triton.jit
def _bwd_q_tiles(dq, q, do, lse2, delta, k_desc, v_desc, K: Rows, V: Rows, start, end, m0, seq: Seq, m: SeqMask,
                 hs: HeadScores, hd: HeadDropout, F: tl.constexpr, T: tl.constexpr, MASKED: tl.constexpr):
    """dQ of one query block over key tiles ``[start, end)``."""
    for n0 in range(start, end, T.BLOCK_N):
        n0 = tl.multiple_of(n0, T.BLOCK_N)
        k = load_rows(k_desc, n0, seq.Lk, K.stride_s, T.D, T.BLOCK_N, T.BLOCK_D, MASKED, T.TMA)
        v = load_rows(v_desc, n0, seq.Lk, V.stride_s, T.DV, T.BLOCK_N, T.BLOCK_DV, MASKED, T.TMA)
        ds_qk = _ds_tile(q, do, lse2, delta, k, v, m0, n0, seq, m, hs, hd, F, T, MASKED)[1]
        dq += tl.dot(ds_qk.to(k.dtype), k, input_precision=T.DOT_PRECISION)
    return dq


@triton.jit
def _bwd_kv_tiles(dk, dv, k_parts, v_parts, q_descs, do_descs, dq_tile, lse2_row, delta_row, dbias_bh, start, end,
                  n0, Q: Rows, dO: Rows, dQ: Rows, dBias: DBias, seq: Seq, m: SeqMask, hs: HeadScores,
                  hd: HeadDropout, F: tl.constexpr, T: tl.constexpr, DB: tl.constexpr, DQ_MODE: tl.constexpr,
                  SPLIT: tl.constexpr, MASKED: tl.constexpr):
    """dK and dV of one key block over query tiles ``[start, end)``, adding each tile's dQ into ``dq_tile``
    (``DQ_MODE`` 2: its TMA descriptor; 1: its fp32 buffer's first row; 0: none). The key block's k and v and
    the q and dO rows come as parts (``k_parts``, ``v_parts``, ``q_descs``, ``do_descs``: :func:`parts.part_descs`):
    one, or under ``SPLIT`` three bf16 parts of each float32 operand, split once per call (:func:`split_bf16`)
    so that every loaded operand stays in shared memory; P's and dS's are split in registers per tile."""
    cols = n0 + tl.arange(0, T.BLOCK_N)[:, None]
    for m0 in range(start, end, T.BLOCK_M):
        m0 = tl.multiple_of(m0, T.BLOCK_M)
        rows_m = m0 + tl.arange(0, T.BLOCK_M)
        q_parts = load_parts(q_descs, m0, seq.Lq, Q.stride_s, T.D, T.BLOCK_M, T.BLOCK_D, MASKED, T.TMA, SPLIT)
        do_parts = load_parts(do_descs, m0, seq.Lq, dO.stride_s, T.DV, T.BLOCK_M, T.BLOCK_DV, MASKED, T.TMA,
                              SPLIT)
        if MASKED:
            lse2 = tl.load(lse2_row + rows_m, mask=rows_m < seq.Lq, other=float("inf"))
            delta = tl.load(delta_row + rows_m, mask=rows_m < seq.Lq, other=0.0)
        else:
            lse2 = tl.load(lse2_row + rows_m)
            delta = tl.load(delta_row + rows_m)
        # Transposed tiles (keys x queries): dK and dV accumulate without transposing P or dS.
        if SPLIT:
            qkt = dot6(k_parts, trans3(q_parts))
        else:
            qkt = tl.dot(k_parts[0], tl.trans(q_parts[0]), input_precision=T.DOT_PRECISION)
        st, tt = score_tile(qkt, rows_m[None, :], cols, seq.Lq, seq.Lk, m, hs, F, MASKED, False,
                            T.DOT_PRECISION == "tf32x3")
        pt = tl.exp2(st - lse2[None, :])
        if SPLIT:
            dpt = dot6(v_parts, trans3(do_parts))
        else:
            dpt = tl.dot(v_parts[0], tl.trans(do_parts[0]), input_precision=T.DOT_PRECISION)
        if F.DROPOUT:
            keept = tl.trans(keep_tile(hd, m0, n0, T.BLOCK_M, T.BLOCK_N, F.POSITIONS))
            pt_kept = tl.where(keept, pt * hd.keep_scale, 0.0)
            dpt = tl.where(keept, dpt * hd.keep_scale, 0.0)
        else:
            pt_kept = pt
        if SPLIT:
            dv += dot6(bf16_parts(pt_kept), do_parts)
        else:
            dv += tl.dot(pt_kept.to(do_parts[0].dtype), do_parts[0], input_precision=T.DOT_PRECISION)
        dst = pt * (dpt - delta[None, :])
        if DB.MODE != 0:
            bias_grad(dst, dbias_bh, rows_m, n0 + tl.arange(0, T.BLOCK_N), seq.Lq, seq.Lk, dBias.sq, dBias.sk, DB,
                      MASKED)
        dst = softcap_grad(dst, tt, F)
        if SPLIT:
            dst_parts = bf16_parts(dst)
            dk += dot6(dst_parts, q_parts)
        else:
            dk += tl.dot(dst.to(q_parts[0].dtype), q_parts[0], input_precision=T.DOT_PRECISION)
        if DQ_MODE != 0:
            if SPLIT:
                # As dQᵀ = Kᵀ dSᵀ: BLOCK_D rows fill the tensor cores' 64-row tiles where BLOCK_M rows would
                # not (Triton then falls back to mma.sync with K's parts in registers: 1272 bytes of stack at
                # D128 32x64 tiles against 752).
                dqt = dot6(trans3(k_parts), dst_parts)
                dq = tl.trans(dqt) * hs.scale
            else:
                dq = tl.dot(tl.trans(dst.to(k_parts[0].dtype)), k_parts[0],
                            input_precision=T.DOT_PRECISION) * hs.scale
            if DQ_MODE == 2:
                # One bulk reduce of the tile (TMA), clipped at the sequence's last row by the descriptor.
                dq_tile.atomic_add([m0, 0], dq)
            else:
                offs_d = tl.arange(0, T.BLOCK_D)
                ptrs = dq_tile + rows_m[:, None].to(tl.int64) * dQ.stride_s + offs_d[None, :]
                tl.atomic_add(ptrs, dq, mask=(rows_m[:, None] < seq.Lq) & (offs_d[None, :] < T.D), sem="relaxed")
    return dk, dv


@fast_launch
@triton.jit(do_not_specialize=DATA_DEPENDENT)
def _bwd_kv_kernel(Q: Rows, K: Rows, V: Rows, dO: Rows, dQ: Rows, dK: Rows, dV: Rows, LSE2, DELTA, seqs: Seqs,
                   total_q, total_k, max_q, max_k, ORDER, mask: Mask, scores: Scores, dropout: Dropout, seed, offset_lo,
                   dBias: DBias, Q_FIRST: Rows, K_FIRST: Rows, V_FIRST: Rows, dO_FIRST: Rows, Q_LAST: Rows,
                   K_LAST: Rows, V_LAST: Rows, dO_LAST: Rows, F: tl.constexpr,
                   T: tl.constexpr, DB: tl.constexpr, DQ_MODE: tl.constexpr, SPLIT: tl.constexpr, GRID: tl.constexpr):
    """dK and dV (and dQ, and the bias gradient). Grid ``(cdiv(max_k, BLOCK_N), Hkv, B)``, or another order of
    its axes (``GRID``: ``program.key_block_grid``): the program of key block j, kv head hk and
    sequence b owns key rows ``[j * BLOCK_N, +BLOCK_N)`` of kv head hk of sequence b and walks the query
    tiles that see them, for each of the GROUP query heads of hk.

    Q, dO ``(B, Sq, H, D|DV)`` | ``(Tq, H, D|DV)``; K, V and dK, dV (written) ``(B, Sk, Hkv, D|DV)`` |
    ``(Tk, Hkv, D|DV)``; dQ: the fp32 accumulator ``(B, Sq, H, BLOCK_D)`` | ``(Tq, H, BLOCK_D)`` (added to
    unless DQ_MODE is 0); LSE2, DELTA from the preprocess; dBias: the bias gradient of the bias's shape.
    ``SPLIT`` (float32 at full accuracy, ``configs.splits_bf16``): the three bf16 parts of Q, K, V, dO
    (:func:`split_bf16`), the first two in each row of Q_FIRST, K_FIRST, V_FIRST, dO_FIRST (K's and V's in dK's
    and dV's buffers where they fit, each program reading its own rows there before it writes them) and the third
    in Q_LAST, K_LAST, V_LAST, dO_LAST; Q, K, V, dO themselves are not read. Otherwise all of these are None.
    """
    bt = batch(seqs, total_q, total_k, max_q, max_k)
    block, hk, seq, m = prologue(bt, mask, ORDER, F, False, F.VARLEN, GRID)
    n0 = block * T.BLOCK_N
    if n0 >= seq.Lk:
        return
    # (Under SPLIT, K's and V's first two parts lie in dK's and dV's buffers: read here, before any write below.)
    k_parts = load_parts(part_descs(K, K_FIRST, K_LAST, seq.b, seq.k_start, hk, seq.Lk, T.D, T.BLOCK_N,
                                    T.BLOCK_D, T.TMA, SPLIT), n0, seq.Lk, K.stride_s, T.D, T.BLOCK_N, T.BLOCK_D,
                         True, T.TMA, SPLIT)
    v_parts = load_parts(part_descs(V, V_FIRST, V_LAST, seq.b, seq.k_start, hk, seq.Lk, T.DV, T.BLOCK_N,
                                    T.BLOCK_DV, T.TMA, SPLIT), n0, seq.Lk, V.stride_s, T.DV, T.BLOCK_N, T.BLOCK_DV,
                         True, T.TMA, SPLIT)
    dk = tl.zeros([T.BLOCK_N, T.BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([T.BLOCK_N, T.BLOCK_DV], dtype=tl.float32)
    # Three stages over the query tiles that see this key block: masked, unmasked, masked (masks.py).
    bounds = query_stages(n0, seq.Lq, seq.Lk, m, F, T.BLOCK_M, T.BLOCK_N)
    for g in range(T.GROUP):
        h = hk * T.GROUP + g
        q_descs = part_descs(Q, Q_FIRST, Q_LAST, seq.b, seq.q_start, h, seq.Lq, T.D, T.BLOCK_M, T.BLOCK_D, T.TMA,
                             SPLIT)
        do_descs = part_descs(dO, dO_FIRST, dO_LAST, seq.b, seq.q_start, h, seq.Lq, T.DV, T.BLOCK_M, T.BLOCK_DV,
                              T.TMA, SPLIT)
        # The fp32 dQ rows of this sequence and head: a descriptor for the TMA bulk reduce.
        dq_tile = rows_desc(base(dQ, seq.b, seq.q_start, h), seq.Lq, dQ.stride_s, T.BLOCK_D, T.BLOCK_M, T.BLOCK_D,
                            DQ_MODE == 2)
        dbias_bh = dBias.ptr + seq.b.to(tl.int64) * dBias.sb + h * dBias.sh
        hs = head_scores(scores, seq.b, h, F)
        hd = head_dropout(dropout, seed, offset_lo, seq.b, h, bt.heads, m, F)
        lse2_row = lse_row(LSE2, bt, seq, h, F)
        delta_row = lse_row(DELTA, bt, seq, h, F)
        for stage in tl.static_range(3):
            dk, dv = _bwd_kv_tiles(dk, dv, k_parts, v_parts, q_descs, do_descs, dq_tile, lse2_row, delta_row,
                                   dbias_bh, bounds[stage], bounds[stage + 1], n0, Q, dO, dQ, dBias, seq, m, hs, hd, F,
                                   T, DB, DQ_MODE, SPLIT, stage != 1)
    store_rows(base(dK, seq.b, seq.k_start, hk), n0, seq.Lk, dK.stride_s, dk * scores.scale, T.D, T.BLOCK_N,
               T.BLOCK_D)
    store_rows(base(dV, seq.b, seq.k_start, hk), n0, seq.Lk, dV.stride_s, dv, T.DV, T.BLOCK_N, T.BLOCK_DV)


@fast_launch
@triton.jit(do_not_specialize=DATA_DEPENDENT)
def _bwd_q_kernel(Q: Rows, K: Rows, V: Rows, dO: Rows, dQ: Rows, LSE2, DELTA, seqs: Seqs, total_q, total_k, max_q,
                  max_k, ORDER, mask: Mask, scores: Scores, dropout: Dropout, seed, offset_lo, F: tl.constexpr,
                  T: tl.constexpr):
    """dQ without atomics (deterministic). Grid ``(cdiv(max_q, BLOCK_M), H, B)``: program ``(i, h, b)`` owns
    query rows ``[i * BLOCK_M, +BLOCK_M)`` of head h of sequence b and walks the key tiles they see.

    Q, K, V, dO, LSE2, DELTA as ``_bwd_kv_kernel``'s; dQ ``(B, Sq, H, D)`` | ``(Tq, H, D)`` (written).
    """
    bt = batch(seqs, total_q, total_k, max_q, max_k)
    block, h, seq, m = prologue(bt, mask, ORDER, F, F.HAS_R, F.VARLEN)
    m0 = block * T.BLOCK_M
    if m0 >= seq.Lq:
        return
    hk = h // T.GROUP
    rows_m = m0 + tl.arange(0, T.BLOCK_M)
    q = load_rows(rows_desc(base(Q, seq.b, seq.q_start, h), seq.Lq, Q.stride_s, T.D, T.BLOCK_M, T.BLOCK_D, T.TMA),
                  m0, seq.Lq, Q.stride_s, T.D, T.BLOCK_M, T.BLOCK_D, True, T.TMA)
    do = load_rows(rows_desc(base(dO, seq.b, seq.q_start, h), seq.Lq, dO.stride_s, T.DV, T.BLOCK_M, T.BLOCK_DV,
                             T.TMA), m0, seq.Lq, dO.stride_s, T.DV, T.BLOCK_M, T.BLOCK_DV, True, T.TMA)
    lse2 = tl.load(lse_row(LSE2, bt, seq, h, F) + rows_m, mask=rows_m < seq.Lq, other=float("inf"))
    delta = tl.load(lse_row(DELTA, bt, seq, h, F) + rows_m, mask=rows_m < seq.Lq, other=0.0)
    k_desc = rows_desc(base(K, seq.b, seq.k_start, hk), seq.Lk, K.stride_s, T.D, T.BLOCK_N, T.BLOCK_D, T.TMA)
    v_desc = rows_desc(base(V, seq.b, seq.k_start, hk), seq.Lk, V.stride_s, T.DV, T.BLOCK_N, T.BLOCK_DV, T.TMA)
    hs = head_scores(scores, seq.b, h, F)
    hd = head_dropout(dropout, seed, offset_lo, seq.b, h, bt.heads, m, F)
    dq = tl.zeros([T.BLOCK_M, T.BLOCK_D], dtype=tl.float32)
    bounds = key_stages(m0, seq.Lq, seq.Lk, m, F, T.BLOCK_M, T.BLOCK_N)
    for stage in tl.static_range(3):
        dq = _bwd_q_tiles(dq, q, do, lse2, delta, k_desc, v_desc, K, V, bounds[stage], bounds[stage + 1], m0, seq, m,
                          hs, hd, F, T, stage != 1)
    store_rows(base(dQ, seq.b, seq.q_start, h), m0, seq.Lq, dQ.stride_s, dq * scores.scale, T.D, T.BLOCK_M,
               T.BLOCK_D)


@fast_launch
@triton.jit(do_not_specialize=[*DATA_DEPENDENT, "n_seqs"])
def _bwd_dbias_kernel(Q: Rows, K: Rows, V: Rows, dO: Rows, LSE2, DELTA, seqs: Seqs, total_q, total_k, max_q, max_k,
                      mask: Mask, scores: Scores, dropout: Dropout, seed, offset_lo, dBias: DBias, n_seqs, bias_heads,
                      F: tl.constexpr, T: tl.constexpr, BCAST: tl.constexpr):
    """A broadcast bias's gradient, deterministically. Grid ``(n_q, n_k, bias batch x bias heads)``: program
    ``(i, j, bh)`` owns one tile of dBias and sums dS over the broadcast batches, heads, queries and keys
    (``BCAST``: which of (B, H, Sq, Sk) the bias broadcasts) in a fixed order, recomputing S and dP."""
    pid_q = tl.program_id(0)
    pid_k = tl.program_id(1)
    b_out = tl.program_id(2) // bias_heads
    h_out = tl.program_id(2) % bias_heads
    bt = batch(seqs, total_q, total_k, max_q, max_k)
    acc = tl.zeros([T.BLOCK_M, T.BLOCK_N], dtype=tl.float32)
    for bi in range(n_seqs if BCAST[0] else 1):
        b = bi if BCAST[0] else b_out
        seq = sequence(bt, b, F)
        m = seq_mask(mask, b, seq.Lq, seq.Lk, bt.max_q, F)
        q_lo = 0 if BCAST[2] else pid_q * T.BLOCK_M
        q_hi = seq.Lq if BCAST[2] else tl.minimum(pid_q * T.BLOCK_M + 1, seq.Lq)
        for hi in range(bt.heads if BCAST[1] else 1):
            h = hi if BCAST[1] else h_out
            hk = h // T.GROUP
            hs = head_scores(scores, b, h, F)
            hd = head_dropout(dropout, seed, offset_lo, b, h, bt.heads, m, F)
            for m0 in range(q_lo, q_hi, T.BLOCK_M):
                rows_m = m0 + tl.arange(0, T.BLOCK_M)
                q = load_rows(base(Q, b, seq.q_start, h), m0, seq.Lq, Q.stride_s, T.D, T.BLOCK_M, T.BLOCK_D, True,
                              False)
                do = load_rows(base(dO, b, seq.q_start, h), m0, seq.Lq, dO.stride_s, T.DV, T.BLOCK_M, T.BLOCK_DV,
                               True, False)
                lse2 = tl.load(lse_row(LSE2, bt, seq, h, F) + rows_m, mask=rows_m < seq.Lq, other=float("inf"))
                delta = tl.load(lse_row(DELTA, bt, seq, h, F) + rows_m, mask=rows_m < seq.Lq, other=0.0)
                # The key tiles of the band (all of it, or this program's one tile when it lies in the band),
                # each in its stage: unmasked tiles read the bias without a key mask (scores.add_bias).
                band = key_stages(m0, seq.Lq, seq.Lk, m, F, T.BLOCK_M, T.BLOCK_N)
                k_lo = band[0] if BCAST[3] else pid_k * T.BLOCK_N
                k_hi = band[3] if BCAST[3] else tl.minimum(pid_k * T.BLOCK_N + 1, seq.Lk)
                for stage in tl.static_range(3):
                    for n0 in range(tl.maximum(k_lo, band[stage]), tl.minimum(k_hi, band[stage + 1]), T.BLOCK_N):
                        k = load_rows(base(K, b, seq.k_start, hk), n0, seq.Lk, K.stride_s, T.D, T.BLOCK_N,
                                      T.BLOCK_D, True, False)
                        v = load_rows(base(V, b, seq.k_start, hk), n0, seq.Lk, V.stride_s, T.DV, T.BLOCK_N,
                                      T.BLOCK_DV, True, False)
                        acc += _ds_tile(q, do, lse2, delta, k, v, m0, n0, seq, m, hs, hd, F, T, stage != 1)[0]
    db_base = dBias.ptr + b_out.to(tl.int64) * dBias.sb + h_out * dBias.sh
    offs_m = pid_q * T.BLOCK_M + tl.arange(0, T.BLOCK_M)
    offs_n = pid_k * T.BLOCK_N + tl.arange(0, T.BLOCK_N)
    if BCAST[2] and BCAST[3]:
        tl.store(db_base, tl.sum(tl.sum(acc, 1), 0).to(dBias.ptr.dtype.element_ty))
    elif BCAST[2]:
        tl.store(db_base + offs_n.to(tl.int64) * dBias.sk, tl.sum(acc, 0).to(dBias.ptr.dtype.element_ty),
                 mask=offs_n < bt.max_k)
    elif BCAST[3]:
        tl.store(db_base + offs_m.to(tl.int64) * dBias.sq, tl.sum(acc, 1).to(dBias.ptr.dtype.element_ty),
                 mask=offs_m < bt.max_q)
    else:
        ptrs = db_base + offs_m[:, None].to(tl.int64) * dBias.sq + offs_n[None, :].to(tl.int64) * dBias.sk
        tl.store(ptrs, acc.to(dBias.ptr.dtype.element_ty), mask=(offs_m[:, None] < bt.max_q) &
                 (offs_n[None, :] < bt.max_k))


def _bias_broadcast(bias, problem) -> tuple[bool, bool, bool, bool]:
    """Which of the bias's (B, H, Sq, Sk) dims are broadcast (size 1 against a larger problem dim)."""
    full = (problem.batch, problem.heads, problem.max_q, problem.max_k)
    return tuple(n == 1 and f > 1 for n, f in zip(bias.shape, full, strict=True))


def launch_backward(dout, dlse, q, k, v, out, lse, bias, alibi, problem, opts, seed, config, need_dbias,
                    tma=None, gluon=True):
    """(dq, dk, dv, dbias) for the normalized layouts of options.py. No autograd, no syncs.

    ``config`` is a ``configs.BackwardConfig``: tiles of the kv kernel, of the dQ kernel when dQ is
    computed separately (deterministic), and how dQ is reduced otherwise. ``dbias`` has the bias's
    shape and dtype (None unless ``need_dbias``). ``tma``: load tiles through TMA descriptors; None
    decides from the device and alignment. ``gluon``: run the warp-specialized Hopper kernels instead of these where
    they apply (``attn/gluon/backward.py``; past a head dim of 128 ``attn/gluon/backward_wide.py`` for dK and dV and
    ``attn/gluon/backward_dq.py`` for dQ, or with dropout the dQ kernel here); False: never (the tests and sweeps of
    these kernels).
    """
    B, H, dense = problem.batch, problem.heads, problem.dense
    if 0 in (B, H, problem.max_q, problem.max_k):
        # No query or no key: every gradient is zero (an empty tensor, or zeros for the other side).
        dbias = torch.zeros_like(bias) if need_dbias else None
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dbias
    delta = torch.empty_like(lse)
    lse2 = torch.empty_like(lse)
    seq_args = seqs(problem, q, k, lse)
    feats = features(problem, opts, bias, alibi, seed)
    tma = (config.kv.tma and use_tma(q, k, v, dout)) if tma is None else tma
    # float32 at full accuracy: the loaded operands split once per call (parts.py), loaded through TMA. K's and V's
    # first two parts live in dK's and dV's buffers where they fit, which must then be contiguous.
    split = runs_split(q.dtype, problem, tma, config.kv.num_stages)
    dk, dv = (torch.empty(t.shape, device=t.device, dtype=t.dtype) if split else torch.empty_like(t) for t in (k, v))
    parts = part_args(("Q", "K", "V", "dO"), split_bf16(q, k, v, dout, dk, dv) if split else None, dense)
    dropout_kwargs = dropout_args(seed, opts, problem, lse)  # (the bundle and the key)
    common = dict(**seq_args, mask=mask_args(problem, opts, lse), scores=score_args(bias, alibi, opts, q),
                  **dropout_kwargs, F=feats)
    order = longest_first(problem, lse)
    # The Gluon kernels: dK, dV and dQ (reduced into the accumulator, in a fixed order in deterministic mode) up to a
    # tile head dim of 128; past it, and for deterministic causal calls with a left window at 128, dK and dV stored
    # (``wide``), with dQ from its own Gluon kernel (``dq_gluon``), or with dropout from the dQ kernel below in the
    # config's dQ tiles (every bf16/fp16 entry of the tables at 256 has them).
    gluon_kv = gluon and gluon_backward.applies(problem, opts, q, k, v, dout, bias, alibi, seed)
    wide = gluon and not gluon_kv and gluon_backward_wide.applies(problem, opts, q, k, v, dout, bias, alibi, seed)
    dq_gluon = wide and gluon_backward_dq.applies(problem, opts, q, k, v, dout, bias, alibi, seed)
    wide = wide and (dq_gluon or config.q is not None)
    gluon = gluon_kv
    dq_mode = DQ_TMA if gluon else DQ_SEPARATE if wide else config.dq_mode

    # The bias gradient: zeros first, since tiles outside the visible band are never visited (except where the Gluon
    # kernel's first sequence stores every tile: gluon_backward.stores_first).
    dbias, db_mode, bcast, dbias_buf, first_stores = None, DBIAS_NONE, (False,) * 4, q, False
    if need_dbias:
        bcast = _bias_broadcast(bias, problem)
        if not any(bcast):
            db_mode = DBIAS_STORE
            dbias = dbias_buf = torch.zeros(bias.shape, device=q.device, dtype=bias.dtype)
        elif opts.deterministic:
            # Summed in a fixed order by _bwd_dbias_kernel, which recomputes S and dP per tile of dBias. Elsewhere
            # the kv kernel's fp32 atomic adds ran faster on every broadcast measured (H100, B4 S2048 H16 D128,
            # backward TFLOP/s, atomic vs recompute: (1,H,S,S) 180 vs 156 in the heads-last grid, causal 122 vs
            # 98, (B,1,S,S) 203 vs 160, (1,1,S,S) 210 vs 136, (B,H,1,S) 236 vs 168; bench/NOTES.md).
            dbias = torch.zeros(bias.shape, device=q.device, dtype=bias.dtype)
        else:
            db_mode = DBIAS_ATOMIC
            # (The Gluon kernel's first sequence stores every tile where sequences visit the same ones: no zeros.)
            first_stores = gluon and gluon_backward.stores_first(problem, feats, bcast)
            dbias_buf = (torch.empty if first_stores else torch.zeros)(bias.shape, device=q.device,
                                                                       dtype=torch.float32)
    db_args = DBias(dbias_buf, *(broadcast_strides(dbias_buf) if db_mode != DBIAS_NONE else (0,) * 4))
    # Sequences add into one gradient (either kv kernel: heads last, program.heads_last).
    adds_across_batch = db_mode == DBIAS_ATOMIC and bcast[0]

    kv = config.kv
    kv_tiles = tiles(problem, kv, q.dtype, tma)
    if dq_mode == DQ_SEPARATE:
        dq = torch.empty_like(q)
        dq_acc = dq  # not touched by the kv kernel
    else:
        # fp32 accumulator, head dim padded to BLOCK_D so TMA's 16-byte alignment always holds; zeroed by the
        # preprocess.
        dq_acc = torch.empty((*q.shape[:-1], head_block(problem.head_dim)), device=q.device, dtype=torch.float32)
        if dq_mode == DQ_TMA:
            ensure_allocator()  # the kernel builds the dQ descriptors on the device
    pre_block = 64
    _bwd_preprocess[(cdiv(problem.max_q, pre_block), H, B)](
        O=rows(out, dense), dO=rows(dout, dense), dQ=rows(dq_acc, dense), dLSE=lse if dlse is None else dlse,
        LSE=lse, DELTA=delta, LSE2=lse2, **seq_args, F=feats, HAS_DLSE=dlse is not None,
        ZERO_DQ=dq_mode != DQ_SEPARATE, DV=problem.head_dim_v, BLOCK_M=pre_block,
        BLOCK_DV=head_block(problem.head_dim_v), BLOCK_D=head_block(problem.head_dim),
    )
    if gluon:
        gluon_backward.launch_kv(q, k, v, dout, dq_acc, dk, dv, lse2, delta, problem, seq_args, order, common["mask"],
                                 feats, common["scores"], dropout_kwargs, bias=bias,
                                 dbias=dbias_buf if db_mode != DBIAS_NONE else None,
                                 dbias_mode=GLUON_FIRST_STORES if first_stores else db_mode,
                                 adds_across_batch=adds_across_batch, deterministic=opts.deterministic)
    elif wide:
        gluon_backward_wide.launch_kv(q, k, v, dout, dk, dv, lse2, delta, problem, seq_args, order, common["mask"],
                                      feats, common["scores"], dropout_kwargs)
    else:
        grid, grid_order = key_block_grid(problem, feats, cdiv(problem.max_k, kv.block_n), q.device,
                                          KV_PROGRAMS_PER_SM, adds_across_batch=adds_across_batch)
        _bwd_kv_kernel[grid](
            Q=rows(q, dense), K=rows(k, dense), V=rows(v, dense), dO=rows(dout, dense), dQ=rows(dq_acc, dense),
            dK=rows(dk, dense), dV=rows(dv, dense), LSE2=lse2, DELTA=delta, dBias=db_args,
            **parts, T=kv_tiles,
            DB=constexprs(DBiasMode(db_mode, bcast[2], bcast[3])), DQ_MODE=dq_mode, SPLIT=split, GRID=grid_order,
            ORDER=order,
            num_warps=kv.num_warps, num_stages=kv.num_stages, **common,
        )
    if db_mode == DBIAS_ATOMIC:
        dbias = dbias_buf.to(bias.dtype)
    if dq_gluon:  # (only where wide: DQ_SEPARATE)
        gluon_backward_dq.launch(q, k, v, dout, dq, lse2, delta, problem, seq_args, common["mask"], feats,
                                 common["scores"])
    elif dq_mode == DQ_SEPARATE:
        qc = config.q
        _bwd_q_kernel[(cdiv(problem.max_q, qc.block_m), H, B)](
            Q=rows(q, dense), K=rows(k, dense), V=rows(v, dense), dO=rows(dout, dense), dQ=rows(dq, dense),
            LSE2=lse2, DELTA=delta, ORDER=order, T=tiles(problem, qc, q.dtype, tma),
            num_warps=qc.num_warps, num_stages=qc.num_stages, **common,
        )
    else:
        dq = dq_acc[..., :problem.head_dim].to(q.dtype)
    if need_dbias and db_mode == DBIAS_NONE:
        tiles_db = config.q or kv
        n_q = 1 if bcast[2] else cdiv(problem.max_q, tiles_db.block_m)
        n_k = 1 if bcast[3] else cdiv(problem.max_k, tiles_db.block_n)
        _bwd_dbias_kernel[(n_q, n_k, dbias.shape[0] * dbias.shape[1])](
            Q=rows(q, dense), K=rows(k, dense), V=rows(v, dense), dO=rows(dout, dense), LSE2=lse2, DELTA=delta,
            dBias=DBias(dbias, *broadcast_strides(dbias)), n_seqs=B, bias_heads=dbias.shape[1],
            T=tiles(problem, tiles_db, q.dtype, False), BCAST=constexprs(bcast),
            num_warps=tiles_db.num_warps, num_stages=1, **common,
        )
    return dq, dk, dv, dbias
