"""Attention backward, as in ``kernel_backward.h``, with FA3's five-matmul schedule.

1. ``_bwd_preprocess``: ``delta = rowsum(dO * O) - dlse`` and the lse in log2 units (a row that saw
   no key gets +inf there, so its recomputed probabilities are exactly 0).
2. ``_bwd_kv_kernel``: one program per (key block, kv head, sequence) keeps dK and dV in registers,
   walks the query tiles that can see its keys (for each q head of its GQA group), recomputes
   P = exp2(S - lse), and computes dV += Pᵀ dO, dP = dO Vᵀ, dS = P (dP - delta), dK += dSᵀ Q, and,
   unless deterministic, dQ += dS K added into an fp32 buffer: a TMA bulk reduce of the whole tile on
   Hopper (``DQ_MODE`` 2), element atomics elsewhere and under the interpreter (1).
3. Deterministic mode: ``_bwd_q_kernel``, one program per query block walking its key tiles, computes
   dQ without atomics (recomputing S and dP: seven matmuls of work for five counted).
"""

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .configs import DQ_SEPARATE, DQ_TMA
from .forward import LOG2E, dot_precision, head_block, use_tma
from .masks import key_stages, query_stages, seq_bounds, visible
from .tiles import load_rows, rows_desc


@triton.jit
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
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    tl.store(Delta + lse_off, delta, mask=row_ok)
    tl.store(Lse2 + lse_off, lse2, mask=row_ok)


@triton.jit
def _bwd_kv_tiles(dk, dv, k, v, q_desc, do_desc, dQ_head, dQ_desc, dq_row0, dq_col0, Lse2_head, Delta_head,
                  stride_qs, stride_gs, stride_dqs, start, end, n0, Lq, Lk, shift, WL, R, qk_scale, dq_scale,
                  offs_m, offs_n, offs_d, offs_dv, D: tl.constexpr, DV: tl.constexpr,
                  HAS_WL: tl.constexpr, HAS_R: tl.constexpr, MASKED: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, DQ_MODE: tl.constexpr,
                  BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr):
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
        st = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale
        pt = tl.exp2(st - lse2[None, :])
        if MASKED:
            ok = visible(rows[None, :], n0 + offs_n[:, None], Lq, Lk, shift, WL, R, HAS_WL, HAS_R)
            pt = tl.where(ok, pt, 0.0)
        dv += tl.dot(pt.to(do.dtype), do, input_precision=DOT_PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        dst = pt * (dpt - delta[None, :])
        dk += tl.dot(dst.to(q.dtype), q, input_precision=DOT_PRECISION)
        if DQ_MODE == 2:
            # One bulk reduce of the tile (TMA). Rows past the sequence's end carry exact zeros (their P
            # is masked), so the tile may overlap the next sequence's rows.
            dq = tl.dot(tl.trans(dst.to(k.dtype)), k, input_precision=DOT_PRECISION) * dq_scale
            dQ_desc.atomic_add([dq_row0 + m0, dq_col0], dq)
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


@triton.jit
def _bwd_kv_kernel(
    Q, K, V, dOut, dQacc, dQ_desc, dK, dV, Lse2, Delta, cu_q, cu_k,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_gb, stride_gs, stride_gh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_dkb, stride_dks, stride_dkh,
    stride_dvb, stride_dvs, stride_dvh,
    stride_lb, stride_lh,
    seq_q, seq_k, qk_scale, dq_scale, dk_scale, WL, R, D: tl.constexpr, DV: tl.constexpr,
    GROUP: tl.constexpr, VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    HAS_WL: tl.constexpr, HAS_R: tl.constexpr, DQ_MODE: tl.constexpr,
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
    t_lo, u_lo, u_hi, t_hi = query_stages(n0, Lq, Lk, shift, WL, R, HAS_WL, HAS_R, BLOCK_M, BLOCK_N)
    q_base = b64 * stride_qb + q_start.to(tl.int64) * stride_qs
    g_base = b64 * stride_gb + q_start.to(tl.int64) * stride_gs
    dq_base = b64 * stride_dqb + q_start.to(tl.int64) * stride_dqs
    l_base = b64 * stride_lb + q_start.to(tl.int64)
    # Row of the fp32 dQ buffer, seen by the TMA descriptor as (rows, H * BLOCK_D).
    dq_row0 = q_start if VARLEN else b * seq_q + q_start
    for g in range(GROUP):
        h = hk * GROUP + g
        q_desc = rows_desc(Q + q_base + h * stride_qh, Lq, stride_qs, D, BLOCK_M, BLOCK_D, TMA)
        do_desc = rows_desc(dOut + g_base + h * stride_gh, Lq, stride_gs, DV, BLOCK_M, BLOCK_DV, TMA)
        dQ_head = dQacc + dq_base + h * stride_dqh
        dq_col0 = h * BLOCK_D
        Lse2_head = Lse2 + l_base + h * stride_lh
        Delta_head = Delta + l_base + h * stride_lh
        dk, dv = _bwd_kv_tiles(dk, dv, k, v, q_desc, do_desc, dQ_head, dQ_desc, dq_row0, dq_col0,
                               Lse2_head, Delta_head, stride_qs, stride_gs, stride_dqs, t_lo, u_lo,
                               n0, Lq, Lk, shift, WL, R, qk_scale, dq_scale, offs_m, offs_n, offs_d, offs_dv, D, DV,
                               HAS_WL, HAS_R, True, BLOCK_D, BLOCK_DV, DQ_MODE, BLOCK_M, DOT_PRECISION, TMA)
        dk, dv = _bwd_kv_tiles(dk, dv, k, v, q_desc, do_desc, dQ_head, dQ_desc, dq_row0, dq_col0,
                               Lse2_head, Delta_head, stride_qs, stride_gs, stride_dqs, u_lo, u_hi,
                               n0, Lq, Lk, shift, WL, R, qk_scale, dq_scale, offs_m, offs_n, offs_d, offs_dv, D, DV,
                               HAS_WL, HAS_R, False, BLOCK_D, BLOCK_DV, DQ_MODE, BLOCK_M, DOT_PRECISION, TMA)
        dk, dv = _bwd_kv_tiles(dk, dv, k, v, q_desc, do_desc, dQ_head, dQ_desc, dq_row0, dq_col0,
                               Lse2_head, Delta_head, stride_qs, stride_gs, stride_dqs, u_hi, t_hi,
                               n0, Lq, Lk, shift, WL, R, qk_scale, dq_scale, offs_m, offs_n, offs_d, offs_dv, D, DV,
                               HAS_WL, HAS_R, True, BLOCK_D, BLOCK_DV, DQ_MODE, BLOCK_M, DOT_PRECISION, TMA)
    cols = n0 + offs_n
    col_ok = cols < Lk
    kcols = (k_start + cols).to(tl.int64)
    tl.store(dK + b64 * stride_dkb + kcols[:, None] * stride_dks + hk * stride_dkh + offs_d[None, :],
             (dk * dk_scale).to(dK.dtype.element_ty), mask=col_ok[:, None] & (offs_d[None, :] < D))
    tl.store(dV + b64 * stride_dvb + kcols[:, None] * stride_dvs + hk * stride_dvh + offs_dv[None, :],
             dv.to(dV.dtype.element_ty), mask=col_ok[:, None] & (offs_dv[None, :] < DV))


@triton.jit
def _bwd_q_tiles(dq, q, do, lse2, delta, k_desc, v_desc, stride_ks, stride_vs,
                 start, end, m0, Lq, Lk, shift, WL, R, qk_scale, offs_m, offs_n, offs_d, offs_dv,
                 D: tl.constexpr, DV: tl.constexpr,
                 HAS_WL: tl.constexpr, HAS_R: tl.constexpr, MASKED: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, TMA: tl.constexpr):
    for n0 in range(start, end, BLOCK_N):
        n0 = tl.multiple_of(n0, BLOCK_N)
        k = load_rows(k_desc, n0, Lk, stride_ks, offs_n, offs_d, D, BLOCK_D, MASKED, TMA)
        v = load_rows(v_desc, n0, Lk, stride_vs, offs_n, offs_dv, DV, BLOCK_DV, MASKED, TMA)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        p = tl.exp2(s - lse2[:, None])
        if MASKED:
            ok = visible(m0 + offs_m[:, None], n0 + offs_n[None, :], Lq, Lk, shift, WL, R, HAS_WL, HAS_R)
            p = tl.where(ok, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def _bwd_q_kernel(
    Q, K, V, dOut, dQ, Lse2, Delta, cu_q, cu_k,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_gb, stride_gs, stride_gh,
    stride_dqb, stride_dqs, stride_dqh,
    stride_lb, stride_lh,
    seq_q, seq_k, qk_scale, dq_scale, WL, R, D: tl.constexpr, DV: tl.constexpr,
    GROUP: tl.constexpr, VARLEN: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    HAS_WL: tl.constexpr, HAS_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr, TMA: tl.constexpr,
):
    pid_m = tl.program_id(0)
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
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    t_lo, u_lo, u_hi, t_hi = key_stages(m0, Lq, Lk, shift, WL, R, HAS_WL, HAS_R, BLOCK_M, BLOCK_N)
    dq = _bwd_q_tiles(dq, q, do, lse2, delta, k_desc, v_desc, stride_ks, stride_vs, t_lo, u_lo,
                      m0, Lq, Lk, shift, WL, R, qk_scale, offs_m, offs_n, offs_d, offs_dv, D, DV,
                      HAS_WL, HAS_R, True, BLOCK_D, BLOCK_DV, BLOCK_N, DOT_PRECISION, TMA)
    dq = _bwd_q_tiles(dq, q, do, lse2, delta, k_desc, v_desc, stride_ks, stride_vs, u_lo, u_hi,
                      m0, Lq, Lk, shift, WL, R, qk_scale, offs_m, offs_n, offs_d, offs_dv, D, DV,
                      HAS_WL, HAS_R, False, BLOCK_D, BLOCK_DV, BLOCK_N, DOT_PRECISION, TMA)
    dq = _bwd_q_tiles(dq, q, do, lse2, delta, k_desc, v_desc, stride_ks, stride_vs, u_hi, t_hi,
                      m0, Lq, Lk, shift, WL, R, qk_scale, offs_m, offs_n, offs_d, offs_dv, D, DV,
                      HAS_WL, HAS_R, True, BLOCK_D, BLOCK_DV, BLOCK_N, DOT_PRECISION, TMA)
    tl.store(dQ + b64 * stride_dqb + grows[:, None] * stride_dqs + h * stride_dqh + offs_d[None, :],
             (dq * dq_scale).to(dQ.dtype.element_ty), mask=row_ok[:, None] & (offs_d[None, :] < D))


def _rows3(t, dense):
    """(batch, seq, head) strides of a (B, S, H, X) or (T, H, X) tensor; batch stride 0 when jagged."""
    return (t.stride(0), t.stride(1), t.stride(2)) if dense else (0, t.stride(0), t.stride(1))


def launch_backward(dout, dlse, q, k, v, out, lse, problem, opts, config, tma=None):
    """(dq, dk, dv) for the normalized layouts of options.py. No autograd, no syncs.

    ``config`` is a ``configs.BackwardConfig``: tiles of the kv kernel, of the dq kernel when dQ is
    computed separately (deterministic), and how dQ is reduced otherwise. ``tma``: load tiles through
    TMA descriptors; None decides from the device and alignment.
    """
    B, H, Hkv = problem.batch, problem.heads, problem.kv_heads
    D, DV, dense = problem.head_dim, problem.head_dim_v, problem.dense
    BD, BDV = head_block(D), head_block(DV)
    cu_q = problem.cu_q if not dense else lse
    cu_k = problem.cu_k if not dense else lse
    l_strides = (lse.stride(0), lse.stride(1)) if dense else (0, lse.stride(0))
    delta = torch.empty_like(lse)
    lse2 = torch.empty_like(lse)
    pre_block = 64
    _bwd_preprocess[(triton.cdiv(problem.max_q, pre_block), H, B)](
        out, dout, dlse if dlse is not None else lse, lse, delta, lse2, cu_q,
        *_rows3(out, dense), *_rows3(dout, dense), *l_strides, problem.max_q, DV,
        VARLEN=not dense, HAS_DLSE=dlse is not None, BLOCK_M=pre_block, BLOCK_DV=BDV,
    )
    R = opts.visible_right()
    shared = dict(GROUP=problem.group, VARLEN=not dense, BOTTOM_RIGHT=opts.bottom_right,
                  HAS_WL=opts.window_left >= 0, HAS_R=R >= 0, BLOCK_D=BD, BLOCK_DV=BDV,
                  DOT_PRECISION=dot_precision(q.dtype),
                  TMA=(config.kv.tma and use_tma(q, k, v, dout)) if tma is None else tma)
    qk_scale = opts.scale * LOG2E
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    kv = config.kv
    rows = q.shape[0] * q.shape[1] if dense else q.shape[0]
    if config.dq_mode == DQ_SEPARATE:
        dq_acc = dq = torch.empty_like(q)  # not touched by the kv kernel
        dq_desc = dq_acc
        dq_strides = _rows3(dq, dense)
    else:
        # fp32 accumulator, head dim padded to BLOCK_D so TMA's 16-byte alignment always holds.
        dq_acc = torch.zeros((rows, H, BD), device=q.device, dtype=torch.float32)
        dq_strides = (problem.max_q * H * BD if dense else 0, H * BD, BD)
        if config.dq_mode == DQ_TMA:
            dq_desc = TensorDescriptor(dq_acc.view(rows, H * BD), shape=[rows, H * BD], strides=[H * BD, 1],
                                       block_shape=[kv.block_m, BD])
        else:
            dq_desc = dq_acc
    _bwd_kv_kernel[(triton.cdiv(problem.max_k, kv.block_n), Hkv, B)](
        q, k, v, dout, dq_acc, dq_desc, dk, dv, lse2, delta, cu_q, cu_k,
        *_rows3(q, dense), *_rows3(k, dense), *_rows3(v, dense), *_rows3(dout, dense), *dq_strides,
        *_rows3(dk, dense), *_rows3(dv, dense), *l_strides,
        problem.max_q, problem.max_k, qk_scale, opts.scale, opts.scale, opts.window_left, R, D=D, DV=DV,
        DQ_MODE=config.dq_mode, BLOCK_M=kv.block_m, BLOCK_N=kv.block_n, num_warps=kv.num_warps,
        num_stages=kv.num_stages, **shared,
    )
    if config.dq_mode == DQ_SEPARATE:
        qc = config.q
        _bwd_q_kernel[(triton.cdiv(problem.max_q, qc.block_m), H, B)](
            q, k, v, dout, dq, lse2, delta, cu_q, cu_k,
            *_rows3(q, dense), *_rows3(k, dense), *_rows3(v, dense), *_rows3(dout, dense),
            *_rows3(dq, dense), *l_strides,
            problem.max_q, problem.max_k, qk_scale, opts.scale, opts.window_left, R, D=D, DV=DV,
            BLOCK_M=qc.block_m, BLOCK_N=qc.block_n, num_warps=qc.num_warps, num_stages=qc.num_stages, **shared,
        )
    else:
        dq = dq_acc[..., :D].reshape(q.shape).to(q.dtype)
    return dq, dk, dv
