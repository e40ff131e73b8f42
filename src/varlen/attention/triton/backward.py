"""Attention backward, as in ``kernel_backward.h``, with FA3's five-matmul schedule.

1. ``_bwd_preprocess``: ``delta = rowsum(dO * O) - dlse`` and the lse in log2 units (a row that saw
   no key gets +inf there, so its recomputed probabilities are exactly 0).
2. ``_bwd_kv_kernel``: one program per (key block, kv head, sequence) keeps dK and dV in registers,
   walks the query tiles that can see its keys (for each q head of its GQA group), recomputes
   P = exp2(S - lse), and computes dV += (P∘M)ᵀ dO, dP = (dO Vᵀ)∘M (M: the dropout keep mask scaled by
   1/(1-p)), dS = P (dP - delta), dK += dSᵀ Q, and, unless deterministic, dQ += dS K added into an fp32
   buffer: a TMA bulk reduce of the whole tile on Hopper (``DQ_MODE`` 2), element atomics elsewhere
   and under the interpreter (1). dS is also the bias gradient: stored as is for a full-shape bias,
   summed over the broadcast axes of the tile and added atomically for a broadcast one.
3. Deterministic mode: ``_bwd_q_kernel``, one program per query block walking its key tiles, computes
   dQ without atomics (recomputing S and dP: seven matmuls of work for five counted); a broadcast bias
   gets its gradient from ``_bwd_dbias_kernel``, one program per bias-gradient tile looping over the
   broadcast batches, heads, queries and keys in a fixed order.
"""

import torch
import triton
import triton.language as tl

from ..._amp import dot_precision
from .configs import DQ_SEPARATE, DQ_TMA
from .launch import (
    DATA_DEPENDENT,
    broadcast_strides,
    cdiv,
    ensure_allocator,
    feature_args,
    head_block,
    lse_strides,
    row_strides,
    use_tma,
)
from .masks import key_stages, query_stages, seq_bounds
from .scores import LOG2E, keep_tile, score_tile
from .tiles import load_rows, rows_desc

# How the kv kernel handles the bias gradient.
DBIAS_NONE = 0
DBIAS_STORE = 1  # a full-shape bias: each element is written once
DBIAS_ATOMIC = 2  # a broadcast bias: tile sums over the broadcast axes, added atomically in fp32


@triton.jit(do_not_specialize=DATA_DEPENDENT)
def _bwd_preprocess(
    Out, dOut, dLse, Lse, Delta, Lse2, cu_q,
    stride_ob, stride_os, stride_oh,
    stride_gb, stride_gs, stride_gh,
    stride_lb, stride_lh,
    seq_q, DV: tl.constexpr,
    VARLEN: tl.constexpr, HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, Lq = seq_bounds(cu_q, b, seq_q, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= Lq:
        return
    b64 = b.to(tl.int64)
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = rows < Lq
    tile_ok = row_ok[:, None] & (offs_dv[None, :] < DV)
    grows = (q_start + rows).to(tl.int64)
    o = tl.load(Out + b64 * stride_ob + grows[:, None] * stride_os + h * stride_oh + offs_dv[None, :],
                mask=tile_ok, other=0.0)
    do = tl.load(dOut + b64 * stride_gb + grows[:, None] * stride_gs + h * stride_gh + offs_dv[None, :],
                 mask=tile_ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    lse_off = b64 * stride_lb + h * stride_lh + grows
    if HAS_DLSE:
        delta -= tl.load(dLse + lse_off, mask=row_ok, other=0.0)
    lse = tl.load(Lse + lse_off, mask=row_ok, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    tl.store(Delta + lse_off, delta, mask=row_ok)
    tl.store(Lse2 + lse_off, lse2, mask=row_ok)


@triton.jit
def _dbias_tile(dst, dbias_bh, q_idx, k_idx, Lq, Lk, stride_dbq, stride_dbk,
                DBIAS_MODE: tl.constexpr, BIAS_BQ: tl.constexpr, BIAS_BK: tl.constexpr):
    """Write a keys x queries tile of dS (natural units) into the bias gradient. ``q_idx``/``k_idx`` are
    the tile's in-sequence query and key positions (1-D)."""
    rows = q_idx[None, :]
    cols = k_idx[:, None]
    if DBIAS_MODE == 1:
        ptrs = dbias_bh + rows.to(tl.int64) * stride_dbq + cols.to(tl.int64) * stride_dbk
        tl.store(ptrs, dst.to(dbias_bh.dtype.element_ty), mask=(rows < Lq) & (cols < Lk))
    else:
        # Masked and out-of-sequence entries of dS are exact zeros, so tile sums need no mask.
        if BIAS_BQ and BIAS_BK:
            tl.atomic_add(dbias_bh, tl.sum(tl.sum(dst, 1), 0), sem="relaxed")
        elif BIAS_BQ:
            tl.atomic_add(dbias_bh + k_idx.to(tl.int64) * stride_dbk, tl.sum(dst, 1), mask=k_idx < Lk,
                          sem="relaxed")
        elif BIAS_BK:
            tl.atomic_add(dbias_bh + q_idx.to(tl.int64) * stride_dbq, tl.sum(dst, 0), mask=q_idx < Lq,
                          sem="relaxed")
        else:
            ptrs = dbias_bh + rows.to(tl.int64) * stride_dbq + cols.to(tl.int64) * stride_dbk
            tl.atomic_add(ptrs, dst, mask=(rows < Lq) & (cols < Lk), sem="relaxed")


@triton.jit
def _bwd_kv_tiles(dk, dv, k, v, q_desc, do_desc, dQ_head, dq_desc, Lse2_head, Delta_head,
                  stride_qs, stride_gs, stride_dqs, start, end, n0, Lq, Lk, shift, WL, R, qk_scale, dq_scale,
                  bias_bh, stride_bq, stride_bk, slope2, softcap_scale, softcap2,
                  seed, offset_lo, threshold, keep_scale, bh, dbias_bh, stride_dbq, stride_dbk,
                  offs_m, offs_n, offs_d, offs_dv, D: tl.constexpr, DV: tl.constexpr,
                  HAS_WL: tl.constexpr, HAS_R: tl.constexpr, MASKED: tl.constexpr,
                  HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
                  DBIAS_MODE: tl.constexpr, BIAS_BQ: tl.constexpr, BIAS_BK: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  DQ_MODE: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr):
    cols = n0 + offs_n[:, None]
    for m0 in range(start, end, BLOCK_M):
        m0 = tl.multiple_of(m0, BLOCK_M)
        rows = m0 + offs_m
        rows64 = rows.to(tl.int64)
        q = load_rows(q_desc, m0, Lq, stride_qs, offs_m, offs_d, D, BLOCK_D, MASKED, TMA)
        do = load_rows(do_desc, m0, Lq, stride_gs, offs_m, offs_dv, DV, BLOCK_DV, MASKED, TMA)
        if MASKED:
            row_ok = rows < Lq
            lse2 = tl.load(Lse2_head + rows64, mask=row_ok, other=float("inf"))
            delta = tl.load(Delta_head + rows64, mask=row_ok, other=0.0)
        else:
            lse2 = tl.load(Lse2_head + rows64)
            delta = tl.load(Delta_head + rows64)
        # Transposed tiles (keys x queries): dK and dV accumulate without transposing P or dS.
        qkt = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
        st, tt = score_tile(qkt, rows[None, :], cols, Lq, Lk, shift, WL, R, qk_scale, softcap_scale, softcap2,
                            bias_bh, stride_bq, stride_bk, slope2, HAS_WL, HAS_R, MASKED, HAS_BIAS, HAS_ALIBI,
                            SOFTCAP)
        pt = tl.exp2(st - lse2[None, :])
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        if DROPOUT:
            keept = tl.trans(keep_tile(seed, offset_lo, threshold, bh, m0, n0, BLOCK_M, BLOCK_N))
            dv += tl.dot(tl.where(keept, pt * keep_scale, 0.0).to(do.dtype), do, input_precision=DOT_PRECISION)
            dpt = tl.where(keept, dpt * keep_scale, 0.0)
        else:
            dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PRECISION)
        dst = pt * (dpt - delta[None, :])
        if DBIAS_MODE != 0:
            _dbias_tile(dst, dbias_bh, rows, n0 + offs_n, Lq, Lk, stride_dbq, stride_dbk,
                        DBIAS_MODE, BIAS_BQ, BIAS_BK)
        if SOFTCAP:
            dst = dst * (1.0 - tt * tt)
        dk += tl.dot(dst.to(q.dtype), q, input_precision=DOT_PRECISION)
        if DQ_MODE == 2:
            # One bulk reduce of the tile (TMA), clipped at the sequence's last row by the descriptor.
            dq = tl.dot(tl.trans(dst.to(k.dtype)), k, input_precision=DOT_PRECISION) * dq_scale
            dq_desc.atomic_add([m0, 0], dq)
        elif DQ_MODE == 1:
            dq = tl.dot(tl.trans(dst.to(k.dtype)), k, input_precision=DOT_PRECISION) * dq_scale
            dq_ptrs = dQ_head + rows64[:, None] * stride_dqs + offs_d[None, :]
            if MASKED:
                tl.atomic_add(dq_ptrs, dq, mask=(rows[:, None] < Lq) & (offs_d[None, :] < D), sem="relaxed")
            elif BLOCK_D != D:
                tl.atomic_add(dq_ptrs, dq, mask=offs_d[None, :] < D, sem="relaxed")
            else:
                tl.atomic_add(dq_ptrs, dq, sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=DATA_DEPENDENT)
def _bwd_kv_kernel(
    Q, K, V, dOut, dQacc, dK, dV, Lse2, Delta, cu_q, cu_k,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_gb, stride_gs, stride_gh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_lb, stride_lh,
    Bias, stride_bb, stride_bh, stride_bq, stride_bk,
    Alibi, stride_ab, stride_ah,
    softcap_scale, softcap2, seed, offset_lo, threshold, keep_scale,
    dBias, stride_dbb, stride_dbh, stride_dbq, stride_dbk,
    seq_q, seq_k, H, qk_scale, dq_scale, dk_scale, WL, R, D: tl.constexpr, DV: tl.constexpr,
    GROUP: tl.constexpr, VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    HAS_WL: tl.constexpr, HAS_R: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
    DBIAS_MODE: tl.constexpr, BIAS_BQ: tl.constexpr, BIAS_BK: tl.constexpr, DQ_MODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    pid_n = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2)
    k_start, Lk = seq_bounds(cu_k, b, seq_k, VARLEN)
    n0 = pid_n * BLOCK_N
    if n0 >= Lk:
        return
    q_start, Lq = seq_bounds(cu_q, b, seq_q, VARLEN)
    shift = Lk - Lq if BOTTOM_RIGHT else 0
    b64 = b.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    K_seq = K + b64 * stride_kb + k_start.to(tl.int64) * stride_ks + hk * stride_kh
    V_seq = V + b64 * stride_vb + k_start.to(tl.int64) * stride_vs + hk * stride_vh
    k = load_rows(rows_desc(K_seq, Lk, stride_ks, D, BLOCK_N, BLOCK_D, TMA), n0, Lk, stride_ks, offs_n, offs_d,
                  D, BLOCK_D, True, TMA)
    v = load_rows(rows_desc(V_seq, Lk, stride_vs, DV, BLOCK_N, BLOCK_DV, TMA), n0, Lk, stride_vs, offs_n,
                  offs_dv, DV, BLOCK_DV, True, TMA)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    # Three stages over the query tiles that see this key block: masked, unmasked, masked (masks.py).
    bounds = query_stages(n0, Lq, Lk, shift, WL, R, HAS_WL, HAS_R, BLOCK_M, BLOCK_N)
    q_base = b64 * stride_qb + q_start.to(tl.int64) * stride_qs
    g_base = b64 * stride_gb + q_start.to(tl.int64) * stride_gs
    dq_base = b64 * stride_dqb + q_start.to(tl.int64) * stride_dqs
    l_base = b64 * stride_lb + q_start.to(tl.int64)
    for g in range(GROUP):
        h = hk * GROUP + g
        q_desc = rows_desc(Q + q_base + h * stride_qh, Lq, stride_qs, D, BLOCK_M, BLOCK_D, TMA)
        do_desc = rows_desc(dOut + g_base + h * stride_gh, Lq, stride_gs, DV, BLOCK_M, BLOCK_DV, TMA)
        dQ_head = dQacc + dq_base + h * stride_dqh
        # The fp32 dQ rows of this sequence and head, for the TMA bulk reduce (rows padded to BLOCK_D).
        dq_desc = rows_desc(dQ_head, Lq, stride_dqs, BLOCK_D, BLOCK_M, BLOCK_D, DQ_MODE == 2)
        Lse2_head = Lse2 + l_base + h * stride_lh
        Delta_head = Delta + l_base + h * stride_lh
        bias_bh = Bias + b64 * stride_bb + h * stride_bh
        dbias_bh = dBias + b64 * stride_dbb + h * stride_dbh
        slope2 = 0.0
        if HAS_ALIBI:
            slope2 = tl.load(Alibi + b * stride_ab + h * stride_ah) * LOG2E
        bh = b * H + h
        for stage in tl.static_range(3):
            dk, dv = _bwd_kv_tiles(dk, dv, k, v, q_desc, do_desc, dQ_head, dq_desc, Lse2_head, Delta_head,
                                   stride_qs, stride_gs, stride_dqs, bounds[stage], bounds[stage + 1], n0, Lq, Lk,
                                   shift, WL, R, qk_scale, dq_scale, bias_bh,
                                   stride_bq, stride_bk, slope2, softcap_scale, softcap2, seed, offset_lo,
                                   threshold, keep_scale, bh, dbias_bh, stride_dbq, stride_dbk, offs_m, offs_n,
                                   offs_d, offs_dv, D, DV, HAS_WL, HAS_R, stage != 1, HAS_BIAS, HAS_ALIBI,
                                   SOFTCAP, DROPOUT, DBIAS_MODE, BIAS_BQ, BIAS_BK, BLOCK_M, BLOCK_N, BLOCK_D,
                                   BLOCK_DV, DQ_MODE, DOT_PRECISION, TMA)
    cols = n0 + offs_n
    col_ok = cols < Lk
    kcols = (k_start + cols).to(tl.int64)
    tl.store(dK + b64 * stride_dkb + kcols[:, None] * stride_dks + hk * stride_dkh + offs_d[None, :],
             (dk * dk_scale).to(dK.dtype.element_ty), mask=col_ok[:, None] & (offs_d[None, :] < D))
    tl.store(dV + b64 * stride_dvb + kcols[:, None] * stride_dvs + hk * stride_dvh + offs_dv[None, :],
             dv.to(dV.dtype.element_ty), mask=col_ok[:, None] & (offs_dv[None, :] < DV))


@triton.jit
def _ds_tile(q, do, lse2, delta, k_desc, v_desc, stride_ks, stride_vs, m0, n0, Lq, Lk, shift, WL, R, qk_scale,
             bias_bh, stride_bq, stride_bk, slope2, softcap_scale, softcap2, seed, offset_lo, threshold,
             keep_scale, bh, offs_m, offs_n, offs_d, offs_dv, D: tl.constexpr, DV: tl.constexpr,
             HAS_WL: tl.constexpr, HAS_R: tl.constexpr, MASKED: tl.constexpr,
             HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
             DOT_PRECISION: tl.constexpr, TMA: tl.constexpr):
    """(dS in natural units, dS through the softcap, k tile) of queries m0.. x keys n0.. (query-major)."""
    k = load_rows(k_desc, n0, Lk, stride_ks, offs_n, offs_d, D, BLOCK_D, MASKED, TMA)
    v = load_rows(v_desc, n0, Lk, stride_vs, offs_n, offs_dv, DV, BLOCK_DV, MASKED, TMA)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    s, t = score_tile(qk, m0 + offs_m[:, None], n0 + offs_n[None, :], Lq, Lk, shift, WL, R, qk_scale,
                      softcap_scale, softcap2, bias_bh, stride_bq, stride_bk, slope2,
                      HAS_WL, HAS_R, MASKED, HAS_BIAS, HAS_ALIBI, SOFTCAP)
    p = tl.exp2(s - lse2[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    if DROPOUT:
        keep = keep_tile(seed, offset_lo, threshold, bh, m0, n0, BLOCK_M, BLOCK_N)
        dp = tl.where(keep, dp * keep_scale, 0.0)
    ds = p * (dp - delta[:, None])
    ds_qk = ds
    if SOFTCAP:
        ds_qk = ds * (1.0 - t * t)
    return ds, ds_qk, k


@triton.jit
def _bwd_q_tiles(dq, q, do, lse2, delta, k_desc, v_desc, stride_ks, stride_vs,
                 start, end, m0, Lq, Lk, shift, WL, R, qk_scale,
                 bias_bh, stride_bq, stride_bk, slope2, softcap_scale, softcap2,
                 seed, offset_lo, threshold, keep_scale, bh,
                 offs_m, offs_n, offs_d, offs_dv, D: tl.constexpr, DV: tl.constexpr,
                 HAS_WL: tl.constexpr, HAS_R: tl.constexpr, MASKED: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, TMA: tl.constexpr):
    for n0 in range(start, end, BLOCK_N):
        n0 = tl.multiple_of(n0, BLOCK_N)
        ds_qk, k = _ds_tile(q, do, lse2, delta, k_desc, v_desc, stride_ks, stride_vs, m0, n0, Lq, Lk, shift,
                               WL, R, qk_scale, bias_bh, stride_bq, stride_bk, slope2, softcap_scale, softcap2,
                               seed, offset_lo, threshold, keep_scale, bh, offs_m, offs_n, offs_d, offs_dv,
                               D, DV, HAS_WL, HAS_R, MASKED, HAS_BIAS, HAS_ALIBI, SOFTCAP, DROPOUT,
                               BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, DOT_PRECISION, TMA)[1:]
        dq += tl.dot(ds_qk.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit(do_not_specialize=DATA_DEPENDENT)
def _bwd_q_kernel(
    Q, K, V, dOut, dQ, Lse2, Delta, cu_q, cu_k,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_gb, stride_gs, stride_gh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lb, stride_lh,
    Bias, stride_bb, stride_bh, stride_bq, stride_bk,
    Alibi, stride_ab, stride_ah,
    softcap_scale, softcap2, seed, offset_lo, threshold, keep_scale,
    seq_q, seq_k, H, qk_scale, dq_scale, WL, R, D: tl.constexpr, DV: tl.constexpr,
    GROUP: tl.constexpr, VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    HAS_WL: tl.constexpr, HAS_R: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if HAS_R:
        # Under a causal-like mask later query blocks see more keys: start them first.
        pid_m = tl.num_programs(0) - 1 - pid_m
    h = tl.program_id(1)
    b = tl.program_id(2)
    q_start, Lq = seq_bounds(cu_q, b, seq_q, VARLEN)
    m0 = pid_m * BLOCK_M
    if m0 >= Lq:
        return
    k_start, Lk = seq_bounds(cu_k, b, seq_k, VARLEN)
    shift = Lk - Lq if BOTTOM_RIGHT else 0
    hk = h // GROUP
    b64 = b.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    rows = m0 + offs_m
    row_ok = rows < Lq
    grows = (q_start + rows).to(tl.int64)
    Q_seq = Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qs + h * stride_qh
    dO_seq = dOut + b64 * stride_gb + q_start.to(tl.int64) * stride_gs + h * stride_gh
    q = load_rows(rows_desc(Q_seq, Lq, stride_qs, D, BLOCK_M, BLOCK_D, TMA), m0, Lq, stride_qs, offs_m, offs_d,
                  D, BLOCK_D, True, TMA)
    do = load_rows(rows_desc(dO_seq, Lq, stride_gs, DV, BLOCK_M, BLOCK_DV, TMA), m0, Lq, stride_gs, offs_m,
                   offs_dv, DV, BLOCK_DV, True, TMA)
    l_off = b64 * stride_lb + h * stride_lh + grows
    lse2 = tl.load(Lse2 + l_off, mask=row_ok, other=float("inf"))
    delta = tl.load(Delta + l_off, mask=row_ok, other=0.0)
    K_seq = K + b64 * stride_kb + k_start.to(tl.int64) * stride_ks + hk * stride_kh
    V_seq = V + b64 * stride_vb + k_start.to(tl.int64) * stride_vs + hk * stride_vh
    k_desc = rows_desc(K_seq, Lk, stride_ks, D, BLOCK_N, BLOCK_D, TMA)
    v_desc = rows_desc(V_seq, Lk, stride_vs, DV, BLOCK_N, BLOCK_DV, TMA)
    bias_bh = Bias + b64 * stride_bb + h * stride_bh
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(Alibi + b * stride_ab + h * stride_ah) * LOG2E
    bh = b * H + h
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bounds = key_stages(m0, Lq, Lk, shift, WL, R, HAS_WL, HAS_R, BLOCK_M, BLOCK_N)
    for stage in tl.static_range(3):
        dq = _bwd_q_tiles(dq, q, do, lse2, delta, k_desc, v_desc, stride_ks, stride_vs, bounds[stage],
                          bounds[stage + 1], m0, Lq, Lk, shift, WL, R, qk_scale, bias_bh, stride_bq, stride_bk,
                          slope2, softcap_scale, softcap2, seed, offset_lo, threshold, keep_scale, bh, offs_m,
                          offs_n, offs_d, offs_dv, D, DV, HAS_WL, HAS_R, stage != 1, HAS_BIAS, HAS_ALIBI,
                          SOFTCAP, DROPOUT, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, DOT_PRECISION, TMA)
    tl.store(dQ + b64 * stride_dqb + grows[:, None] * stride_dqs + h * stride_dqh + offs_d[None, :],
             (dq * dq_scale).to(dQ.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < D))


@triton.jit(do_not_specialize=[*DATA_DEPENDENT, "B"])
def _bwd_dbias_kernel(
    Q, K, V, dOut, Lse2, Delta, cu_q, cu_k,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_gb, stride_gs, stride_gh,
    stride_lb, stride_lh,
    Bias, stride_bb, stride_bh, stride_bq, stride_bk,
    Alibi, stride_ab, stride_ah,
    softcap_scale, softcap2, seed, offset_lo, threshold, keep_scale,
    dBias, stride_dbb, stride_dbh, stride_dbq, stride_dbk,
    seq_q, seq_k, B, H, BIAS_HEADS, qk_scale, WL, R, D: tl.constexpr, DV: tl.constexpr,
    GROUP: tl.constexpr, VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    HAS_WL: tl.constexpr, HAS_R: tl.constexpr,
    HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
    BIAS_BB: tl.constexpr, BIAS_BH: tl.constexpr, BIAS_BQ: tl.constexpr, BIAS_BK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One tile of a broadcast bias's gradient, summing dS over the broadcast batches, heads, queries
    and keys in a fixed order (deterministic). Recomputes S and dP for every tile it sums."""
    pid_q = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b_out = pid_bh // BIAS_HEADS
    h_out = pid_bh % BIAS_HEADS
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    n_b = B if BIAS_BB else 1
    n_h = H if BIAS_BH else 1
    for bi in range(n_b):
        b = bi if BIAS_BB else b_out
        b64 = b.to(tl.int64)
        q_start, Lq = seq_bounds(cu_q, b, seq_q, VARLEN)
        k_start, Lk = seq_bounds(cu_k, b, seq_k, VARLEN)
        shift = Lk - Lq if BOTTOM_RIGHT else 0
        q_lo = 0 if BIAS_BQ else pid_q * BLOCK_M
        q_hi = Lq if BIAS_BQ else tl.minimum(pid_q * BLOCK_M + 1, Lq)
        for hi in range(n_h):
            h = hi if BIAS_BH else h_out
            hk = h // GROUP
            Q_seq = Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qs + h * stride_qh
            dO_seq = dOut + b64 * stride_gb + q_start.to(tl.int64) * stride_gs + h * stride_gh
            K_seq = K + b64 * stride_kb + k_start.to(tl.int64) * stride_ks + hk * stride_kh
            V_seq = V + b64 * stride_vb + k_start.to(tl.int64) * stride_vs + hk * stride_vh
            l_head = b64 * stride_lb + h * stride_lh + q_start.to(tl.int64)
            bias_bh = Bias + b64 * stride_bb + h * stride_bh
            slope2 = 0.0
            if HAS_ALIBI:
                slope2 = tl.load(Alibi + b * stride_ab + h * stride_ah) * LOG2E
            for m0 in range(q_lo, q_hi, BLOCK_M):
                rows = m0 + offs_m
                row_ok = rows < Lq
                q = load_rows(Q_seq, m0, Lq, stride_qs, offs_m, offs_d, D, BLOCK_D, True, False)
                do = load_rows(dO_seq, m0, Lq, stride_gs, offs_m, offs_dv, DV, BLOCK_DV, True, False)
                lse2 = tl.load(Lse2 + l_head + rows, mask=row_ok, other=float("inf"))
                delta = tl.load(Delta + l_head + rows, mask=row_ok, other=0.0)
                band = key_stages(m0, Lq, Lk, shift, WL, R, HAS_WL, HAS_R, BLOCK_M, BLOCK_N)
                k_lo = band[0] if BIAS_BK else pid_k * BLOCK_N
                k_hi = band[3] if BIAS_BK else tl.minimum(pid_k * BLOCK_N + 1, Lk)
                for n0 in range(k_lo, k_hi, BLOCK_N):
                    ds = _ds_tile(q, do, lse2, delta, K_seq, V_seq, stride_ks, stride_vs, m0, n0, Lq, Lk,
                                        shift, WL, R, qk_scale, bias_bh, stride_bq, stride_bk, slope2,
                                        softcap_scale, softcap2, seed, offset_lo, threshold, keep_scale,
                                        b * H + h, offs_m, offs_n, offs_d, offs_dv, D, DV, HAS_WL, HAS_R, True,
                                        True, HAS_ALIBI, SOFTCAP, DROPOUT, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
                                        DOT_PRECISION, False)[0]
                    acc += ds
    db_base = dBias + b_out.to(tl.int64) * stride_dbb + h_out * stride_dbh
    if BIAS_BQ and BIAS_BK:
        tl.store(db_base, tl.sum(tl.sum(acc, 1), 0).to(dBias.dtype.element_ty))
    elif BIAS_BQ:
        cols = pid_k * BLOCK_N + offs_n
        tl.store(db_base + cols.to(tl.int64) * stride_dbk, tl.sum(acc, 0).to(dBias.dtype.element_ty),
                 mask=cols < seq_k)
    elif BIAS_BK:
        rows = pid_q * BLOCK_M + offs_m
        tl.store(db_base + rows.to(tl.int64) * stride_dbq, tl.sum(acc, 1).to(dBias.dtype.element_ty),
                 mask=rows < seq_q)
    else:
        rows = pid_q * BLOCK_M + offs_m[:, None]
        cols = pid_k * BLOCK_N + offs_n[None, :]
        tl.store(db_base + rows.to(tl.int64) * stride_dbq + cols.to(tl.int64) * stride_dbk,
                 acc.to(dBias.dtype.element_ty), mask=(rows < seq_q) & (cols < seq_k))


def _bias_broadcast(bias, problem) -> tuple[bool, bool, bool, bool]:
    """Which of the bias's (B, H, Sq, Sk) dims are broadcast (size 1 against a larger problem dim)."""
    full = (problem.batch, problem.heads, problem.max_q, problem.max_k)
    return tuple(n == 1 and f > 1 for n, f in zip(bias.shape, full, strict=True))


def launch_backward(dout, dlse, q, k, v, out, lse, bias, alibi, problem, opts, seed, config, need_dbias,
                    tma=None):
    """(dq, dk, dv, dbias) for the normalized layouts of options.py. No autograd, no syncs.

    ``config`` is a ``configs.BackwardConfig``: tiles of the kv kernel, of the dQ kernel when dQ is
    computed separately (deterministic), and how dQ is reduced otherwise. ``dbias`` has the bias's
    shape and dtype (None unless ``need_dbias``). ``tma``: load tiles through TMA descriptors; None
    decides from the device and alignment.
    """
    B, H, Hkv = problem.batch, problem.heads, problem.kv_heads
    D, DV, dense = problem.head_dim, problem.head_dim_v, problem.dense
    if 0 in (B, H, problem.max_q, problem.max_k):
        # No query or no key: every gradient is zero (an empty tensor, or zeros for the other side).
        dbias = torch.zeros_like(bias) if need_dbias else None
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), dbias
    BD, BDV = head_block(D), head_block(DV)
    cu_q = problem.cu_q if not dense else lse
    cu_k = problem.cu_k if not dense else lse
    l_strides = lse_strides(lse, dense)
    delta = torch.empty_like(lse)
    lse2 = torch.empty_like(lse)
    pre_block = 64
    _bwd_preprocess[(cdiv(problem.max_q, pre_block), H, B)](
        out, dout, dlse if dlse is not None else lse, lse, delta, lse2, cu_q,
        *row_strides(out, dense), *row_strides(dout, dense), *l_strides, problem.max_q, DV,
        VARLEN=not dense, HAS_DLSE=dlse is not None, BLOCK_M=pre_block, BLOCK_DV=BDV,
    )
    R = opts.visible_right()
    features, flags = feature_args(q, bias, alibi, opts, seed)
    shared = dict(GROUP=problem.group, VARLEN=not dense, BOTTOM_RIGHT=opts.bottom_right,
                  HAS_WL=opts.window_left >= 0, HAS_R=R >= 0, BLOCK_D=BD, BLOCK_DV=BDV,
                  DOT_PRECISION=dot_precision(q.dtype),
                  TMA=(config.kv.tma and use_tma(q, k, v, dout)) if tma is None else tma)
    qk_scale = opts.scale * LOG2E.value
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)

    # The bias gradient: zeros first, since tiles outside the visible band are never visited.
    dbias = None
    dbias_mode, bcast, dbias_buf = DBIAS_NONE, (False,) * 4, q
    if need_dbias:
        bcast = _bias_broadcast(bias, problem)
        if not any(bcast):
            dbias_mode = DBIAS_STORE
            dbias = dbias_buf = torch.zeros(bias.shape, device=q.device, dtype=bias.dtype)
        elif opts.deterministic:
            dbias = torch.zeros(bias.shape, device=q.device, dtype=bias.dtype)
        else:
            dbias_mode = DBIAS_ATOMIC
            dbias_buf = torch.zeros(bias.shape, device=q.device, dtype=torch.float32)
    db_strides = broadcast_strides(dbias_buf) if dbias_mode != DBIAS_NONE else (0, 0, 0, 0)

    kv = config.kv
    rows = q.shape[0] * q.shape[1] if dense else q.shape[0]
    if config.dq_mode == DQ_SEPARATE:
        dq_acc = dq = torch.empty_like(q)  # not touched by the kv kernel
        dq_strides = row_strides(dq, dense)
    else:
        # fp32 accumulator, head dim padded to BLOCK_D so TMA's 16-byte alignment always holds.
        dq_acc = torch.zeros((rows, H, BD), device=q.device, dtype=torch.float32)
        dq_strides = (problem.max_q * H * BD if dense else 0, H * BD, BD)
        if config.dq_mode == DQ_TMA:
            ensure_allocator()  # the kernel builds the dQ descriptors on the device
    _bwd_kv_kernel[(cdiv(problem.max_k, kv.block_n), Hkv, B)](
        q, k, v, dout, dq_acc, dk, dv, lse2, delta, cu_q, cu_k,
        *row_strides(q, dense), *row_strides(k, dense), *row_strides(v, dense), *row_strides(dout, dense),
        *dq_strides, *row_strides(dk, dense), *row_strides(dv, dense), *l_strides, *features,
        dbias_buf, *db_strides,
        problem.max_q, problem.max_k, H, qk_scale, opts.scale, opts.scale, opts.window_left, R, D=D, DV=DV,
        **flags, DBIAS_MODE=dbias_mode, BIAS_BQ=bcast[2], BIAS_BK=bcast[3], DQ_MODE=config.dq_mode,
        BLOCK_M=kv.block_m, BLOCK_N=kv.block_n, num_warps=kv.num_warps, num_stages=kv.num_stages, **shared,
    )
    if dbias_mode == DBIAS_ATOMIC:
        dbias = dbias_buf.to(bias.dtype)
    if config.dq_mode == DQ_SEPARATE:
        qc = config.q
        _bwd_q_kernel[(cdiv(problem.max_q, qc.block_m), H, B)](
            q, k, v, dout, dq, lse2, delta, cu_q, cu_k,
            *row_strides(q, dense), *row_strides(k, dense), *row_strides(v, dense), *row_strides(dout, dense),
            *row_strides(dq, dense), *l_strides, *features,
            problem.max_q, problem.max_k, H, qk_scale, opts.scale, opts.window_left, R, D=D, DV=DV, **flags,
            BLOCK_M=qc.block_m, BLOCK_N=qc.block_n, num_warps=qc.num_warps, num_stages=qc.num_stages, **shared,
        )
    else:
        dq = dq_acc[..., :D].reshape(q.shape).to(q.dtype)
    if need_dbias and dbias_mode == DBIAS_NONE:
        _launch_dbias(q, k, v, dout, lse2, delta, cu_q, cu_k, l_strides, features, flags, dbias, bcast,
                      problem, opts, config.q or kv, shared)
    return dq, dk, dv, dbias


def _launch_dbias(q, k, v, dout, lse2, delta, cu_q, cu_k, l_strides, features, flags, dbias, bcast,
                  problem, opts, tiles, shared):
    """The deterministic gradient of a broadcast bias (see ``_bwd_dbias_kernel``)."""
    dense, R = problem.dense, opts.visible_right()
    n_q = 1 if bcast[2] else cdiv(problem.max_q, tiles.block_m)
    n_k = 1 if bcast[3] else cdiv(problem.max_k, tiles.block_n)
    bias_heads = dbias.shape[1]
    flags = {name: value for name, value in flags.items() if name != "HAS_BIAS"}
    shared = {name: value for name, value in shared.items() if name != "TMA"}
    _bwd_dbias_kernel[(n_q, n_k, dbias.shape[0] * bias_heads)](
        q, k, v, dout, lse2, delta, cu_q, cu_k,
        *row_strides(q, dense), *row_strides(k, dense), *row_strides(v, dense), *row_strides(dout, dense),
        *l_strides, *features, dbias, *broadcast_strides(dbias),
        problem.max_q, problem.max_k, problem.batch, problem.heads, bias_heads, opts.scale * LOG2E.value,
        opts.window_left, R, D=problem.head_dim, DV=problem.head_dim_v, **flags,
        BIAS_BB=bcast[0], BIAS_BH=bcast[1], BIAS_BQ=bcast[2], BIAS_BK=bcast[3],
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, num_warps=tiles.num_warps, num_stages=1, **shared,
    )
