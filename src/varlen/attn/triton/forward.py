"""Attention forward: online softmax over key tiles, storing the logsumexp for the backward.

Scores live in log2 units (``exp2``), the lse is stored in natural log for the user. Tiles outside a
block's visible band are skipped; tiles inside it run without mask arithmetic (``masks.py``). Dropout
drops probabilities after the row sums, so the lse and the normalization are those of the undropped
softmax, as in the definition. float32 at full accuracy (``SPLIT``, ``configs.splits_bf16``): each product
is six bf16 dots of three bf16 parts per operand (``parts.py``), Q, K and V split once per call, P per
tile. On Hopper, the warp-specialized Gluon kernel (``attn/gluon/forward.py``) takes the calls it applies
to (it leads this kernel at every measured shape: bench/results/forward_kernels_h100.md); this kernel
takes the rest.
"""

import torch

from ..._kernel_math import LN2
from ..._launch import fast_launch
from ..._triton import tl, triton
from ...tiling import cdiv
from ..gluon import forward as gluon_forward
from .launch import DATA_DEPENDENT, features, tiles, use_tma
from .masks import Mask, SeqMask, key_stages, mask_args
from .parts import bf16_parts, dot6, load_parts, part_args, part_descs, runs_split, split_bf16, trans3
from .program import Rows, Seq, Seqs, base, batch, lse_row, prologue, rows, seqs
from .scores import (
    Dropout,
    HeadDropout,
    HeadScores,
    Scores,
    dropout_args,
    head_dropout,
    head_scores,
    keep_tile,
    score_args,
    score_tile,
)
from .tiles import store_rows


@triton.jit
def _fwd_tiles(acc, m_i, l_i, q, k_descs, v_descs, K: Rows, V: Rows, start, end, m0, seq: Seq, m: SeqMask,
               hs: HeadScores, hd: HeadDropout, F: tl.constexpr, T: tl.constexpr, SPLIT: tl.constexpr,
               MASKED: tl.constexpr):
    """The online softmax over key tiles ``[start, end)`` of one query block (masked or not). ``q``, K's and V's
    tiles come as parts (``parts.load_parts``): one, or under ``SPLIT`` three bf16 parts each."""
    rows = m0 + tl.arange(0, T.BLOCK_M)[:, None]
    for n0 in range(start, end, T.BLOCK_N):
        n0 = tl.multiple_of(n0, T.BLOCK_N)
        k = load_parts(k_descs, n0, seq.Lk, K.stride_s, T.D, T.BLOCK_N, T.BLOCK_D, MASKED, T.TMA, SPLIT)
        if SPLIT:
            qk = dot6(q, trans3(k))
        else:
            qk = tl.dot(q[0], tl.trans(k[0]), input_precision=T.DOT_PRECISION)
        s = score_tile(qk, rows, n0 + tl.arange(0, T.BLOCK_N)[None, :], seq.Lq, seq.Lk, m, hs, F, MASKED,
                       F.RAW_SCORES, T.DOT_PRECISION == "tf32x3")[0]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; subtracting 0 instead keeps exp2 at 0, not NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        if F.RAW_SCORES:  # s and m in q.k units: the scale goes into the exp2 (one FMA per score)
            alpha = tl.exp2((m_i - m_sub) * hs.qk_scale)
            p = tl.exp2(s * hs.qk_scale - (m_sub * hs.qk_scale)[:, None])
        else:
            alpha = tl.exp2(m_i - m_sub)
            p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if F.DROPOUT:
            p = tl.where(keep_tile(hd, m0, n0, T.BLOCK_M, T.BLOCK_N, F.POSITIONS), p, 0.0)
        v = load_parts(v_descs, n0, seq.Lk, V.stride_s, T.DV, T.BLOCK_N, T.BLOCK_DV, MASKED, T.TMA, SPLIT)
        if SPLIT:
            acc = acc * alpha[:, None] + dot6(bf16_parts(p), v)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v[0].dtype), v[0], input_precision=T.DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@fast_launch
@triton.jit(do_not_specialize=DATA_DEPENDENT)
def _attn_fwd_kernel(Q: Rows, K: Rows, V: Rows, O: Rows, LSE, seqs: Seqs, total_q, total_k, max_q, max_k,
                     mask: Mask, scores: Scores, dropout: Dropout, seed, offset_lo, Q_FIRST: Rows, K_FIRST: Rows,
                     V_FIRST: Rows, Q_LAST: Rows, K_LAST: Rows, V_LAST: Rows, F: tl.constexpr, T: tl.constexpr,
                     SPLIT: tl.constexpr):
    """Attention forward. Grid ``(cdiv(max_q, BLOCK_M), H, B)``: program ``(i, h, b)`` computes query rows
    ``[i * BLOCK_M, +BLOCK_M)`` of head h of sequence b.

    Q ``(B, Sq, H, D)`` | ``(Tq, H, D)``; K ``(B, Sk, Hkv, D)`` | ``(Tk, Hkv, D)``; V as K with DV; O as Q with
    DV (written); LSE ``(B, H, Sq)`` | ``(H, Tq)`` fp32, natural log, -inf where a query sees no key (written).
    ``SPLIT``: the three bf16 parts of Q, K, V (``parts.split_bf16``), the first two in each row of Q_FIRST,
    K_FIRST, V_FIRST and the third in Q_LAST, K_LAST, V_LAST (Q, K, V themselves unread); otherwise these are None.
    Sequences run in batch order: longest first cost it 1-7% on jagged batches (bench/NOTES.md).
    """
    bt = batch(seqs, total_q, total_k, max_q, max_k)
    block, h, seq, m = prologue(bt, mask, 0, F, F.HAS_R, False)
    m0 = block * T.BLOCK_M
    if m0 >= seq.Lq:
        return
    hk = h // T.GROUP
    q = load_parts(part_descs(Q, Q_FIRST, Q_LAST, seq.b, seq.q_start, h, seq.Lq, T.D, T.BLOCK_M, T.BLOCK_D, T.TMA,
                              SPLIT), m0, seq.Lq, Q.stride_s, T.D, T.BLOCK_M, T.BLOCK_D, True, T.TMA, SPLIT)
    k_descs = part_descs(K, K_FIRST, K_LAST, seq.b, seq.k_start, hk, seq.Lk, T.D, T.BLOCK_N, T.BLOCK_D, T.TMA, SPLIT)
    v_descs = part_descs(V, V_FIRST, V_LAST, seq.b, seq.k_start, hk, seq.Lk, T.DV, T.BLOCK_N, T.BLOCK_DV, T.TMA,
                         SPLIT)
    hs = head_scores(scores, seq.b, h, F)
    hd = head_dropout(dropout, seed, offset_lo, seq.b, h, bt.heads, m, F)

    acc = tl.zeros([T.BLOCK_M, T.BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([T.BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([T.BLOCK_M], dtype=tl.float32)
    # Three stages over the visible key tiles: masked lower edge, unmasked middle, masked upper edge.
    bounds = key_stages(m0, seq.Lq, seq.Lk, m, F, T.BLOCK_M, T.BLOCK_N)
    for stage in tl.static_range(3):
        acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, k_descs, v_descs, K, V, bounds[stage], bounds[stage + 1], m0,
                                   seq, m, hs, hd, F, T, SPLIT, stage != 1)

    # Rows that saw no key: output 0 and lse -inf.
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    if F.DROPOUT:
        out = out * hd.keep_scale
    store_rows(base(O, seq.b, seq.q_start, h), m0, seq.Lq, O.stride_s, out, T.DV, T.BLOCK_M, T.BLOCK_DV)
    log_l = tl.log2(tl.where(seen, l_i, 1.0)) * LN2
    if F.RAW_SCORES:
        lse = tl.where(seen, m_i * hs.scale + log_l, float("-inf"))
    else:
        lse = tl.where(seen, m_i * LN2 + log_l, float("-inf"))
    rows_m = m0 + tl.arange(0, T.BLOCK_M)
    tl.store(lse_row(LSE, bt, seq, h, F) + rows_m, lse, mask=rows_m < seq.Lq)


def launch_forward(q, k, v, bias, alibi, problem, opts, seed, config, tma=None, gluon=True):
    """Allocate out and lse and run the forward kernel. No autograd, no syncs.

    ``tma``: load tiles through TMA descriptors; None decides from the device and alignment. ``gluon``: run
    the warp-specialized Hopper kernel (``attn/gluon/forward.py``) instead where it applies; False: never (the
    tests and sweeps of this kernel).
    """
    B, H, DV, dense = problem.batch, problem.heads, problem.head_dim_v, problem.dense
    out = q.new_empty((*q.shape[:-1], DV))
    lse = torch.empty((B, H, problem.max_q) if dense else (H, q.shape[0]), device=q.device, dtype=torch.float32)
    grid = (cdiv(problem.max_q, config.block_m), H, B)
    if 0 in grid:  # no query: nothing to write
        return out, lse
    if gluon and gluon_forward.applies(problem, opts, q, k, v, bias, alibi, seed):
        gluon_forward.launch(q, k, v, out, lse, problem, seqs(problem, q, k, lse), mask_args(problem, opts, lse),
                             features(problem, opts, bias, alibi, seed), score_args(bias, alibi, opts, q),
                             dropout_args(seed, opts, problem, lse))
        return out, lse
    tma = (config.tma and use_tma(q, k, v)) if tma is None else tma
    split = runs_split(q.dtype, problem, tma, config.num_stages)  # (float32 at full accuracy: bf16 parts)
    parts = part_args(("Q", "K", "V"), split_bf16(q, k, v) if split else None, dense)
    _attn_fwd_kernel[grid](
        **parts, SPLIT=split,
        Q=rows(q, dense), K=rows(k, dense), V=rows(v, dense), O=rows(out, dense), LSE=lse,
        **seqs(problem, q, k, lse), mask=mask_args(problem, opts, lse), scores=score_args(bias, alibi, opts, q),
        **dropout_args(seed, opts, problem, lse), F=features(problem, opts, bias, alibi, seed),
        T=tiles(problem, config, q.dtype, tma), num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out, lse
