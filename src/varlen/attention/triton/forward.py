"""Attention forward: online softmax over key tiles, storing the logsumexp for the backward.

One program per (query block, query head, sequence). Scores live in log2 units (``exp2``), the lse
is stored in natural log for the user. Tiles outside a block's visible band are skipped; tiles inside
it run without mask arithmetic. Dropout drops probabilities after the row sums, so the lse and the
normalization are those of the undropped softmax, as in the definition.
"""

import torch
import triton
import triton.language as tl

from ..._amp import dot_precision
from .launch import DATA_DEPENDENT, cdiv, feature_args, head_block, lse_strides, row_strides, use_tma
from .masks import key_stages, seq_bounds
from .scores import LOG2E, keep_tile, score_tile
from .tiles import load_rows, rows_desc

# Kernels may read globals only as constexprs.
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _fwd_tiles(acc, m_i, l_i, q, k_desc, v_desc, stride_ks, stride_vs,
               start, end, m0, Lq, Lk, shift, WL, R, qk_scale,
               bias_bh, stride_bq, stride_bk, slope2, softcap_scale, softcap2,
               seed, offset_lo, threshold, bh,
               offs_m, offs_n, offs_d, offs_dv, D: tl.constexpr, DV: tl.constexpr,
               HAS_WL: tl.constexpr, HAS_R: tl.constexpr, MASKED: tl.constexpr,
               HAS_BIAS: tl.constexpr, HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
               DOT_PRECISION: tl.constexpr, TMA: tl.constexpr):
    for n0 in range(start, end, BLOCK_N):
        n0 = tl.multiple_of(n0, BLOCK_N)
        k = load_rows(k_desc, n0, Lk, stride_ks, offs_n, offs_d, D, BLOCK_D, MASKED, TMA)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s = score_tile(qk, m0 + offs_m[:, None], n0 + offs_n[None, :], Lq, Lk, shift, WL, R, qk_scale,
                       softcap_scale, softcap2, bias_bh, stride_bq, stride_bk, slope2,
                       HAS_WL, HAS_R, MASKED, HAS_BIAS, HAS_ALIBI, SOFTCAP)[0]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; subtracting 0 instead keeps exp2 at 0, not NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DROPOUT:
            p = tl.where(keep_tile(seed, offset_lo, threshold, bh, m0, n0, BLOCK_M, BLOCK_N), p, 0.0)
        v = load_rows(v_desc, n0, Lk, stride_vs, offs_n, offs_dv, DV, BLOCK_DV, MASKED, TMA)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=DATA_DEPENDENT)
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, cu_q, cu_k,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh,
    Bias, stride_bb, stride_bh, stride_bq, stride_bk,
    Alibi, stride_ab, stride_ah,
    softcap_scale, softcap2, seed, offset_lo, threshold, keep_scale,
    seq_q, seq_k, H, qk_scale, WL, R, D: tl.constexpr, DV: tl.constexpr,
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

    Q_seq = Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qs + h * stride_qh
    K_seq = K + b64 * stride_kb + k_start.to(tl.int64) * stride_ks + hk * stride_kh
    V_seq = V + b64 * stride_vb + k_start.to(tl.int64) * stride_vs + hk * stride_vh
    q_desc = rows_desc(Q_seq, Lq, stride_qs, D, BLOCK_M, BLOCK_D, TMA)
    k_desc = rows_desc(K_seq, Lk, stride_ks, D, BLOCK_N, BLOCK_D, TMA)
    v_desc = rows_desc(V_seq, Lk, stride_vs, DV, BLOCK_N, BLOCK_DV, TMA)
    q = load_rows(q_desc, m0, Lq, stride_qs, offs_m, offs_d, D, BLOCK_D, True, TMA)
    bias_bh = Bias + b64 * stride_bb + h * stride_bh
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(Alibi + b * stride_ab + h * stride_ah) * LOG2E
    bh = b * H + h

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Three stages over the visible key tiles: masked lower edge, unmasked middle, masked upper edge.
    bounds = key_stages(m0, Lq, Lk, shift, WL, R, HAS_WL, HAS_R, BLOCK_M, BLOCK_N)
    for stage in tl.static_range(3):
        acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, k_desc, v_desc, stride_ks, stride_vs, bounds[stage],
                                   bounds[stage + 1], m0, Lq, Lk, shift, WL, R, qk_scale, bias_bh, stride_bq,
                                   stride_bk, slope2, softcap_scale, softcap2, seed, offset_lo, threshold, bh,
                                   offs_m, offs_n, offs_d, offs_dv, D, DV, HAS_WL, HAS_R, stage != 1,
                                   HAS_BIAS, HAS_ALIBI, SOFTCAP, DROPOUT,
                                   BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, DOT_PRECISION, TMA)

    # Rows that saw no key: output 0 and lse -inf.
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    if DROPOUT:
        out = out * keep_scale
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    rows = m0 + offs_m
    row_ok = rows < Lq
    O_row = Out + b64 * stride_ob + (q_start + rows[:, None]).to(tl.int64) * stride_os + h * stride_oh
    tl.store(O_row + offs_dv[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(Lse + b64 * stride_lb + h * stride_lh + (q_start + rows).to(tl.int64), lse, mask=row_ok)


def launch_forward(q, k, v, bias, alibi, problem, opts, seed, config, tma=None):
    """Allocate out and lse and run the forward kernel. No autograd, no syncs.

    ``tma``: load tiles through TMA descriptors; None decides from the device and alignment.
    """
    B, H, D, DV, dense = problem.batch, problem.heads, problem.head_dim, problem.head_dim_v, problem.dense
    if dense:
        out = torch.empty((B, problem.max_q, H, DV), device=q.device, dtype=q.dtype)
        lse = torch.empty((B, H, problem.max_q), device=q.device, dtype=torch.float32)
        cu_q = cu_k = lse  # unused when not VARLEN
    else:
        out = torch.empty((q.shape[0], H, DV), device=q.device, dtype=q.dtype)
        lse = torch.empty((H, q.shape[0]), device=q.device, dtype=torch.float32)
        cu_q, cu_k = problem.cu_q, problem.cu_k
    features, flags = feature_args(q, bias, alibi, opts, seed)
    R = opts.visible_right()
    grid = (cdiv(problem.max_q, config.block_m), H, B)
    if 0 in grid:  # no query: nothing to write
        return out, lse
    _attn_fwd_kernel[grid](
        q, k, v, out, lse, cu_q, cu_k,
        *row_strides(q, dense), *row_strides(k, dense), *row_strides(v, dense), *row_strides(out, dense),
        *lse_strides(lse, dense), *features,
        problem.max_q, problem.max_k, H, opts.scale * LOG2E.value, opts.window_left, R, D=D, DV=DV,
        GROUP=problem.group, VARLEN=not dense, BOTTOM_RIGHT=opts.bottom_right,
        HAS_WL=opts.window_left >= 0, HAS_R=R >= 0, **flags,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=head_block(D), BLOCK_DV=head_block(DV),
        DOT_PRECISION=dot_precision(q.dtype), TMA=(config.tma and use_tma(q, k, v)) if tma is None else tma,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out, lse
