"""Triton kernels for layer and RMS norm over the last dim of ``(N, F)`` rows, forward and backward.

Each row is normalized on its own: ``y = (x - mean) * rstd * weight + bias`` (layer norm, ``centered``) or
``y = x * rstd * weight`` (RMS norm), ``rstd = 1 / sqrt(mean((x - mean)**2) + eps)`` (the mean square for RMS norm),
in float32 (float64 for float64), each result rounded once. The forward reads each row once and writes it once,
keeping the mean and rstd per row (in that dtype) for the backward. The backward reads ``x`` and the gradient once and
writes ``dx``; the weight's and bias's gradients are sums over all rows, which each program accumulates over the
rows it takes (a fixed stride of row tiles) in registers and writes once: one partial row per program, added up in a
fixed order after the launch (deterministic). torch's backward reads the rows once more for the weight's gradient, in
a kernel that runs at a third of the bandwidth on tall rows (32768 x 768: 115 us against ~50 for a whole pass).
"""

from __future__ import annotations

import math
import struct

import torch
from torch import Tensor

from .._backend import refuse_double_backward, through_custom_op
from .._checks import FLOAT_DTYPES, accumulate_dtype, check_dtype
from .._launch import fast_launch
from .._triton import tl, triton
from ..tiling import acc_type, cdiv, known_multiple, last_dim_contiguous, next_power_of_2, row_align, sm_count


# ------------------------------------------------------------------------------------ kernels
@triton.jit
def _inverse_sqrt(v):
    """``1 / sqrt(v)`` rounded as IEEE operations (float32's ``tl.sqrt`` and division are approximate)."""
    if v.dtype == tl.float64:
        return 1.0 / tl.sqrt(v)
    else:
        return tl.div_rn(tl.full(v.shape, 1.0, v.dtype), tl.sqrt_rn(v))


@fast_launch
@triton.jit(do_not_specialize=["n_rows"])
def _norm_fwd_kernel(x, weight, bias, y, mean, rstd, n_rows, n_cols, stride_xr, stride_yr, eps_hi, eps_lo,
                     CENTERED: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ACC: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr, ROW_ALIGN: tl.constexpr):
    # BLOCK_R whole rows (BLOCK_F >= n_cols): their statistics, then the normalized rows. eps arrives as two float32
    # halves (Triton passes Python floats as float32; float64 rows need its other bits).
    n_cols = known_multiple(n_cols, ROW_ALIGN)
    stride_xr = known_multiple(stride_xr, ROW_ALIGN)
    stride_yr = known_multiple(stride_yr, ROW_ALIGN)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    cols = tl.arange(0, BLOCK_F)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    mask = row_ok[:, None] & col_ok[None, :]
    v = tl.load(x + rows[:, None] * stride_xr + cols[None, :], mask=mask, other=0.0).to(ACC)
    if CENTERED:
        mu = tl.sum(v, 1) / n_cols
        v = tl.where(mask, v - mu[:, None], 0.0)
        tl.store(mean + rows, mu, mask=row_ok)
    r = _inverse_sqrt(tl.sum(v * v, 1) / n_cols + eps_hi + eps_lo)  # (each added in ACC)
    tl.store(rstd + rows, r, mask=row_ok)
    out = v * r[:, None]
    if HAS_WEIGHT:
        out = out * tl.load(weight + cols, mask=col_ok, other=0.0).to(ACC)[None, :]
    if HAS_BIAS:
        out = out + tl.load(bias + cols, mask=col_ok, other=0.0).to(ACC)[None, :]
    tl.store(y + rows[:, None] * stride_yr + cols[None, :], out.to(y.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit(do_not_specialize=["n_rows"])
def _norm_bwd_kernel(x, weight, grad, mean, rstd, dx, weight_part, bias_part, n_rows, n_cols, stride_xr, stride_gr,
                     stride_dxr, CENTERED: tl.constexpr, HAS_WEIGHT: tl.constexpr, WEIGHT_GRAD: tl.constexpr,
                     BIAS_GRAD: tl.constexpr, ACC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr,
                     ROW_ALIGN: tl.constexpr):
    # Row tiles pid, pid + programs, ...: with xhat = (x - mean) * rstd and g' = g * weight,
    # dx = rstd * (g' - xhat * mean(g' xhat) [- mean(g')]); the weight's gradient sum(g * xhat) and the bias's sum(g)
    # over this program's rows, kept per (row slot, column) and reduced over the slots once, after the loop.
    n_cols = known_multiple(n_cols, ROW_ALIGN)
    stride_xr = known_multiple(stride_xr, ROW_ALIGN)
    stride_gr = known_multiple(stride_gr, ROW_ALIGN)
    stride_dxr = known_multiple(stride_dxr, ROW_ALIGN)
    cols = tl.arange(0, BLOCK_F)
    col_ok = cols < n_cols
    if HAS_WEIGHT:
        w = tl.load(weight + cols, mask=col_ok, other=0.0).to(ACC)
    weight_acc = tl.zeros([BLOCK_R, BLOCK_F], ACC)
    bias_acc = tl.zeros([BLOCK_R, BLOCK_F], ACC)
    # (int64: no wrap past 2**31 rows.) Software-pipelined three deep (cp.async into shared memory): the next tiles'
    # loads are in flight while this tile's math runs. Loaded one tile at a time, the programs kept too few bytes in
    # flight for the H200's bandwidth: bf16 layer norm 77.5% of copy, 92-93% pipelined (bench/NOTES.md).
    for r0 in tl.range(tl.program_id(0).to(tl.int64) * BLOCK_R, n_rows, tl.num_programs(0) * BLOCK_R, num_stages=3):
        rows = r0 + tl.arange(0, BLOCK_R).to(tl.int64)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        v = tl.load(x + rows[:, None] * stride_xr + cols[None, :], mask=mask, other=0.0).to(ACC)
        g = tl.load(grad + rows[:, None] * stride_gr + cols[None, :], mask=mask, other=0.0).to(ACC)
        r = tl.load(rstd + rows, mask=row_ok, other=0.0)
        if CENTERED:
            v = v - tl.load(mean + rows, mask=row_ok, other=0.0)[:, None]
        xhat = tl.where(mask, v * r[:, None], 0.0)
        gw = g * w[None, :] if HAS_WEIGHT else g
        d = gw - xhat * (tl.sum(xhat * gw, 1) / n_cols)[:, None]
        if CENTERED:
            d = d - (tl.sum(gw, 1) / n_cols)[:, None]
        tl.store(dx + rows[:, None] * stride_dxr + cols[None, :], (d * r[:, None]).to(dx.dtype.element_ty), mask=mask)
        if WEIGHT_GRAD:
            weight_acc += g * xhat
        if BIAS_GRAD:
            bias_acc += g
    if WEIGHT_GRAD:
        tl.store(weight_part + tl.program_id(0) * n_cols + cols, tl.sum(weight_acc, 0), mask=col_ok)
    if BIAS_GRAD:
        tl.store(bias_part + tl.program_id(0) * n_cols + cols, tl.sum(bias_acc, 0), mask=col_ok)


@fast_launch
@triton.jit(do_not_specialize=["n_parts"])
def _norm_sum_parts_kernel(parts, first, second, n_parts, n_cols, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    # first (program_id(1) == 0) or second = the sum over p, in a fixed order, of parts[program_id(1), p, :], for one
    # block of columns: the weight's and the bias's gradients from the backward programs' partial rows (as many as
    # the backward had programs: fewer than the GPU's slots for short batches, so not a specialized integer).
    which = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < n_cols
    base = parts + which.to(tl.int64) * n_parts * n_cols
    acc = tl.zeros([BLOCK_P, BLOCK_C], parts.dtype.element_ty)
    for p0 in range(0, n_parts, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        acc += tl.load(base + p[:, None] * n_cols + cols[None, :], mask=(p < n_parts)[:, None] & col_ok[None, :],
                       other=0.0)
    total = tl.sum(acc, 0)
    if which == 0:
        tl.store(first + cols, total.to(first.dtype.element_ty), mask=col_ok)
    else:
        tl.store(second + cols, total.to(second.dtype.element_ty), mask=col_ok)


# ----------------------------------------------------------------------------------- launchers
# Elements of each input one program holds (whole rows) and per thread at most (so the warps grow with wider rows);
# float64 half as many (two registers each). The forward's 4K-element tiles run at 97-99% of copy bandwidth (H100).
# The backward, by the inputs' element size: (programs per SM, tile elements), the best all-round of an H200 sweep of
# the pipelined kernel (bench/NOTES.md, "The norm backward pipelined": 2-8 programs per SM, tiles of 1K-4K elements,
# at 142014 x 1024 and 131072 x 768, layer and RMS norm): 84-93% of copy in 16 bits, 96-97% in float32, 93-97% in
# float64. 16 bits keep the plan that was the H100's best unpipelined (4, 2048).
_FWD_TILE_ELEMS = 4096
_THREAD_ELEMS = 16
_BWD_PLANS = {2: (4, 2048), 4: (4, 1024), 8: (2, 2048)}
# The partial rows' sum: rows per load and columns per program.
_SUM_ROWS, _SUM_COLS = 64, 32


def max_cols(dtype: torch.dtype) -> int:
    """The widest row (the product of ``normalized_shape``) the kernels take for ``dtype``: one program holds whole
    rows, so wider ones would spill (``tools/norm_variants.py``); they take torch's kernels (``norm.normalize``)."""
    return 2048 if dtype == torch.float64 else 8192


def _tiles(n_cols: int, dtype: torch.dtype, tile_elems: int) -> dict:
    halve = 2 if dtype == torch.float64 else 1
    block_f = next_power_of_2(n_cols)
    block_r = max(1, tile_elems // halve // block_f)
    num_warps = min(16, max(4, block_r * block_f * halve // (32 * _THREAD_ELEMS)))
    return dict(BLOCK_R=block_r, BLOCK_F=block_f, num_warps=num_warps)


def _check_rows(x: Tensor, **operands: Tensor | None) -> None:
    """The launchers' operands: float ``x`` ``(N, F)`` with ``0 < F <=`` :func:`max_cols`, float per-column ones
    ``(F,)``, per-row ones ``(N,)``, the gradient ``(N, F)`` (the custom ops can be called directly: a kernel must not
    read outside them, nor take integers for floats)."""
    check_dtype("x", x, FLOAT_DTYPES)
    if x.dim() != 2 or not 0 < x.shape[-1] <= max_cols(x.dtype):
        raise ValueError(f"x: expected (N, F) rows with 0 < F <= {max_cols(x.dtype)}, got shape {tuple(x.shape)}")
    n_rows, n_cols = x.shape
    shapes = {"weight": (n_cols,), "bias": (n_cols,), "mean": (n_rows,), "rstd": (n_rows,), "grad": (n_rows, n_cols)}
    for name, t in operands.items():
        if t is None:
            continue
        check_dtype(name, t, FLOAT_DTYPES)
        if tuple(t.shape) != shapes[name]:
            raise ValueError(f"{name}: expected shape {shapes[name]}, got {tuple(t.shape)}")


def float32_halves(value: float) -> tuple[float, float]:
    """``value`` as float32 high and low parts whose float64 sum keeps 48 of its bits; beyond float32's range, inf
    and 0 (the low part would be inf - inf)."""
    high = struct.unpack("f", struct.pack("f", value))[0]
    if not math.isfinite(high):
        return high, 0.0
    return high, value - high


def _contiguous(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.contiguous()


def norm_fwd_triton(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                    centered: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Layer norm (``centered``) or RMS norm of the rows of ``x`` ``(N, F)`` (any row stride): the normalized rows (a
    new contiguous tensor in ``x``'s dtype), each row's mean (empty unless ``centered``) and rstd (float32; float64
    for float64)."""
    _check_rows(x, weight=weight, bias=bias)
    n_rows, n_cols = x.shape
    stat_dtype = accumulate_dtype(x.dtype)
    y = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    mean = torch.empty(n_rows if centered else 0, dtype=stat_dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=stat_dtype, device=x.device)
    if n_rows:
        x, weight, bias = last_dim_contiguous(x), _contiguous(weight), _contiguous(bias)
        tiles = _tiles(n_cols, x.dtype, _FWD_TILE_ELEMS)
        _norm_fwd_kernel[(cdiv(n_rows, tiles["BLOCK_R"]),)](
            x, weight, bias, y, mean, rstd, n_rows, n_cols, x.stride(0), y.stride(0), *float32_halves(eps),
            CENTERED=centered, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, ACC=acc_type(x.dtype),
            ROW_ALIGN=row_align(n_cols, x.stride(0), y.stride(0)), **tiles)
    return y, mean, rstd


def norm_bwd_triton(x: Tensor, weight: Tensor | None, grad: Tensor, mean: Tensor, rstd: Tensor, centered: bool,
                    weight_grad: bool, bias_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of :func:`norm_fwd_triton` given ``grad``: ``dx`` (contiguous, ``x``'s dtype), and the weight's
    and bias's (their dtype; empty where not asked for)."""
    _check_rows(x, weight=weight, grad=grad, mean=mean if centered else None, rstd=rstd)
    n_rows, n_cols = x.shape
    if weight_grad and weight is None:
        raise ValueError("weight_grad: there is no weight")
    dx = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    out_dtype = x.dtype if weight is None else weight.dtype
    d_weight, d_bias = (torch.empty(n_cols if wanted else 0, dtype=out_dtype, device=x.device)
                        for wanted in (weight_grad, bias_grad))
    programs_per_sm, tile_elems = _BWD_PLANS[x.element_size()]
    tiles = _tiles(n_cols, x.dtype, tile_elems)
    programs = max(1, min(cdiv(n_rows, tiles["BLOCK_R"]), programs_per_sm * sm_count(x.device)))
    # The programs' partial rows of the weight's gradient, then of the bias's (those asked for); zeros without rows.
    n_parts = weight_grad + bias_grad
    parts = (torch.empty if n_rows else torch.zeros)((n_parts, programs, n_cols), dtype=rstd.dtype, device=x.device)
    if n_rows:
        x, grad = last_dim_contiguous(x), last_dim_contiguous(grad)
        weight, mean, rstd = _contiguous(weight), mean.contiguous(), rstd.contiguous()
        weight_part, bias_part = (parts[0], parts[n_parts - 1]) if n_parts else (parts, parts)
        _norm_bwd_kernel[(programs,)](
            x, weight, grad, mean, rstd, dx, weight_part, bias_part, n_rows, n_cols, x.stride(0), grad.stride(0),
            dx.stride(0), CENTERED=centered, HAS_WEIGHT=weight is not None, WEIGHT_GRAD=weight_grad,
            BIAS_GRAD=bias_grad, ACC=acc_type(x.dtype), ROW_ALIGN=row_align(n_cols, x.stride(0), grad.stride(0),
                                                                            dx.stride(0)), **tiles)
    if n_parts:
        first, second = (d_weight, d_bias) if weight_grad else (d_bias, d_weight)
        _norm_sum_parts_kernel[(cdiv(n_cols, _SUM_COLS), parts.shape[0])](
            parts, first, second, parts.shape[1], n_cols, BLOCK_P=_SUM_ROWS, BLOCK_C=_SUM_COLS, num_warps=4)
    return dx, d_weight, d_bias


DOUBLE_BACKWARD = ("varlen.layer_norm / rms_norm: the Triton path has no double backward (create_graph=True "
                   "through it); the torch backend has one")


# ------------------------------------------------------------------------------------ custom ops
# torch.compile sees each step as one opaque op with its output shapes from the fake implementation. Eager calls
# run the kernels directly (varlen._backend.through_custom_op).
_norm_fwd_op = torch.library.custom_op("varlen::norm_forward", norm_fwd_triton, mutates_args=())
_norm_bwd_op = torch.library.custom_op("varlen::norm_backward", norm_bwd_triton, mutates_args=())


@_norm_fwd_op.register_fake
def _(x, weight, bias, eps, centered):
    stat_dtype = accumulate_dtype(x.dtype)
    return (x.new_empty(x.shape), x.new_empty(x.shape[0] if centered else 0, dtype=stat_dtype),
            x.new_empty(x.shape[0], dtype=stat_dtype))


@_norm_bwd_op.register_fake
def _(x, weight, grad, mean, rstd, centered, weight_grad, bias_grad):
    n_cols, out_dtype = x.shape[1], (x.dtype if weight is None else weight.dtype)
    return (x.new_empty(x.shape), x.new_empty(n_cols if weight_grad else 0, dtype=out_dtype),
            x.new_empty(n_cols if bias_grad else 0, dtype=out_dtype))


class NormRows(torch.autograd.Function):
    """Layer or RMS norm of ``(N, F)`` rows through the Triton kernels: ``apply(x, weight, bias, eps, centered)``
    (``weight``, ``bias``: ``(F,)`` or None, any float dtype: read in the computing dtype; their gradients come back in
    the weight's dtype)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, centered):
        y, mean, rstd = (_norm_fwd_op if through_custom_op() else norm_fwd_triton)(x, weight, bias, eps, centered)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.centered = centered
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, mean, rstd = ctx.saved_tensors
        _, weight_grad, bias_grad, _, _ = ctx.needs_input_grad
        dx, d_weight, d_bias = (_norm_bwd_op if through_custom_op() else norm_bwd_triton)(
            x, weight, grad, mean, rstd, ctx.centered, weight_grad, bias_grad)
        grads = refuse_double_backward(DOUBLE_BACKWARD, (dx, d_weight, d_bias), x, weight, grad)
        return grads[0], grads[1] if weight_grad else None, grads[2] if bias_grad else None, None, None
