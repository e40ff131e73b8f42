"""Attention forward: online softmax over key tiles, storing the logsumexp for the backward.

One program per (query block, query head, sequence). Scores live in log2 units (``exp2``), the lse
is stored in natural log for the user. Tiles outside a block's visible band are skipped; tiles inside
it run without mask arithmetic.
"""

import torch
import triton
import triton.language as tl

from ..._backend import interpreter_enabled
from .masks import key_stages, seq_bounds, visible
from .tiles import load_rows, rows_desc

LOG2E = 1.4426950408889634
# Kernels may read globals only as constexprs.
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _fwd_tiles(acc, m_i, l_i, q, k_desc, v_desc, stride_ks, stride_vs,
               start, end, m0, Lq, Lk, shift, WL, R, qk_scale,
               offs_m, offs_n, offs_d, offs_dv, D: tl.constexpr, DV: tl.constexpr,
               HAS_WL: tl.constexpr, HAS_R: tl.constexpr, MASKED: tl.constexpr,
               BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
               DOT_PRECISION: tl.constexpr, TMA: tl.constexpr):
    for n0 in range(start, end, BLOCK_N):
        n0 = tl.multiple_of(n0, BLOCK_N)
        k = load_rows(k_desc, n0, Lk, stride_ks, offs_n, offs_d, D, BLOCK_D, MASKED, TMA)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if MASKED:
            ok = visible(m0 + offs_m[:, None], n0 + offs_n[None, :], Lq, Lk, shift, WL, R, HAS_WL, HAS_R)
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; subtracting 0 instead keeps exp2 at 0, not NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_rows(v_desc, n0, Lk, stride_vs, offs_n, offs_dv, DV, BLOCK_DV, MASKED, TMA)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, cu_q, cu_k,
    stride_qb, stride_qs, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ob, stride_os, stride_oh,
    stride_lb, stride_lh,
    seq_q, seq_k, H, qk_scale, WL, R, D: tl.constexpr, DV: tl.constexpr,
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

    Q_seq = Q + b64 * stride_qb + q_start.to(tl.int64) * stride_qs + h * stride_qh
    K_seq = K + b64 * stride_kb + k_start.to(tl.int64) * stride_ks + hk * stride_kh
    V_seq = V + b64 * stride_vb + k_start.to(tl.int64) * stride_vs + hk * stride_vh
    q_desc = rows_desc(Q_seq, Lq, stride_qs, D, BLOCK_M, BLOCK_D, TMA)
    k_desc = rows_desc(K_seq, Lk, stride_ks, D, BLOCK_N, BLOCK_D, TMA)
    v_desc = rows_desc(V_seq, Lk, stride_vs, DV, BLOCK_N, BLOCK_DV, TMA)
    q = load_rows(q_desc, m0, Lq, stride_qs, offs_m, offs_d, D, BLOCK_D, True, TMA)

    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    t_lo, u_lo, u_hi, t_hi = key_stages(m0, Lq, Lk, shift, WL, R, HAS_WL, HAS_R, BLOCK_M, BLOCK_N)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, k_desc, v_desc, stride_ks, stride_vs, t_lo, u_lo,
                               m0, Lq, Lk, shift, WL, R, qk_scale, offs_m, offs_n, offs_d, offs_dv, D, DV,
                               HAS_WL, HAS_R, True, BLOCK_D, BLOCK_DV, BLOCK_N, DOT_PRECISION, TMA)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, k_desc, v_desc, stride_ks, stride_vs, u_lo, u_hi,
                               m0, Lq, Lk, shift, WL, R, qk_scale, offs_m, offs_n, offs_d, offs_dv, D, DV,
                               HAS_WL, HAS_R, False, BLOCK_D, BLOCK_DV, BLOCK_N, DOT_PRECISION, TMA)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q, k_desc, v_desc, stride_ks, stride_vs, u_hi, t_hi,
                               m0, Lq, Lk, shift, WL, R, qk_scale, offs_m, offs_n, offs_d, offs_dv, D, DV,
                               HAS_WL, HAS_R, True, BLOCK_D, BLOCK_DV, BLOCK_N, DOT_PRECISION, TMA)

    # Rows that saw no key: output 0 and lse -inf.
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    rows = m0 + offs_m
    row_ok = rows < Lq
    O_row = Out + b64 * stride_ob + (q_start + rows[:, None]).to(tl.int64) * stride_os + h * stride_oh
    tl.store(O_row + offs_dv[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(Lse + b64 * stride_lb + h * stride_lh + (q_start + rows).to(tl.int64), lse, mask=row_ok)


def launch_forward(q, k, v, problem, opts, config, tma=None):
    """Allocate out and lse and run the forward kernel. No autograd, no syncs.

    ``tma``: load tiles through TMA descriptors; None decides from the device and alignment.
    """
    B, H, D, DV = problem.batch, problem.heads, problem.head_dim, problem.head_dim_v
    if problem.dense:
        out = torch.empty((B, problem.max_q, H, DV), device=q.device, dtype=q.dtype)
        lse = torch.empty((B, H, problem.max_q), device=q.device, dtype=torch.float32)
        q_strides = (q.stride(0), q.stride(1), q.stride(2))
        k_strides = (k.stride(0), k.stride(1), k.stride(2))
        v_strides = (v.stride(0), v.stride(1), v.stride(2))
        o_strides = (out.stride(0), out.stride(1), out.stride(2))
        l_strides = (lse.stride(0), lse.stride(1))
        cu_q = cu_k = q  # unused when not VARLEN
    else:
        out = torch.empty((q.shape[0], H, DV), device=q.device, dtype=q.dtype)
        lse = torch.empty((H, q.shape[0]), device=q.device, dtype=torch.float32)
        q_strides = (0, q.stride(0), q.stride(1))
        k_strides = (0, k.stride(0), k.stride(1))
        v_strides = (0, v.stride(0), v.stride(1))
        o_strides = (0, out.stride(0), out.stride(1))
        l_strides = (0, lse.stride(0))
        cu_q, cu_k = problem.cu_q, problem.cu_k
    R = opts.visible_right()
    grid = (triton.cdiv(problem.max_q, config.block_m), H, B)
    _attn_fwd_kernel[grid](
        q, k, v, out, lse, cu_q, cu_k,
        *q_strides, *k_strides, *v_strides, *o_strides, *l_strides,
        problem.max_q, problem.max_k, H, opts.scale * LOG2E, opts.window_left, R, D=D, DV=DV,
        GROUP=problem.group, VARLEN=not problem.dense, BOTTOM_RIGHT=opts.bottom_right,
        HAS_WL=opts.window_left >= 0, HAS_R=R >= 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_D=head_block(D), BLOCK_DV=head_block(DV),
        DOT_PRECISION=dot_precision(q.dtype), TMA=(config.tma and use_tma(q, k, v)) if tma is None else tma,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out, lse


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs follow torch's matmul setting: tf32 unless the user asked for "highest"."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def use_tma(*tensors) -> bool:
    """Tiles load through TMA descriptors on Hopper+, when every base and row stride is 16-byte aligned."""
    t0 = tensors[0]
    if t0.device.type != "cuda" or interpreter_enabled():
        return False
    if torch.cuda.get_device_capability(t0.device)[0] < 9:
        return False
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16 or any((st * size) % 16 for st in t.stride()[:-1]):
            return False
    ensure_allocator()
    return True


def ensure_allocator() -> None:
    """Device-side descriptors need scratch memory from a Triton allocator; ours hands out torch memory."""
    global _ALLOCATOR_SET
    if not _ALLOCATOR_SET:
        triton.set_allocator(lambda size, alignment, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
        _ALLOCATOR_SET = True


_ALLOCATOR_SET = False


def head_block(d: int) -> int:
    return max(16, triton.next_power_of_2(d))
