"""SwiGLU of jagged tensors: ``silu(gate) * up`` from the two halves of the last dim, the gate first (the
feed-forward activation of Llama-style blocks, from one projection that makes both halves).

The Triton kernels read ``x`` once and write the result once; the backward reads ``x`` and the gradient once and
writes both halves of ``dx`` into one tensor (torch's ops make the two halves' gradients apart and concatenate
them). Their math is in float32 (float64 for float64), each result rounded once. The PyTorch path (CPU) is
``silu(gate) * up`` in torch ops with torch's autograd, which rounds ``silu(gate)`` to ``x``'s dtype before the
product.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import capabilities
from .._backend import refuse_double_backward, through_custom_op
from .._checks import FLOAT_DTYPES, check_dtype
from .._launch import fast_launch
from .._triton import tl, triton
from ..jagged import JaggedTensor, as_jagged
from ..tiling import acc_type, cdiv, known_multiple, last_dim_contiguous, next_power_of_2, row_align


# ------------------------------------------------------------------------------------ kernels
@fast_launch
@triton.jit(do_not_specialize=["n_rows"])
def _swiglu_fwd_kernel(gate, up, out, n_rows, n_cols, stride_gr, stride_ur, stride_or, ACC: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, ROW_ALIGN: tl.constexpr):
    # out[r, c] = silu(gate[r, c]) * up[r, c] over BLOCK_R rows x BLOCK_C columns.
    n_cols = known_multiple(n_cols, ROW_ALIGN)
    stride_gr = known_multiple(stride_gr, ROW_ALIGN)
    stride_ur = known_multiple(stride_ur, ROW_ALIGN)
    stride_or = known_multiple(stride_or, ROW_ALIGN)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    a = tl.load(gate + rows[:, None] * stride_gr + cols[None, :], mask=mask, other=0.0).to(ACC)
    b = tl.load(up + rows[:, None] * stride_ur + cols[None, :], mask=mask, other=0.0).to(ACC)
    tl.store(out + rows[:, None] * stride_or + cols[None, :], (a * tl.sigmoid(a) * b).to(out.dtype.element_ty),
             mask=mask)


@fast_launch
@triton.jit(do_not_specialize=["n_rows"])
def _swiglu_bwd_kernel(gate, up, grad, d_gate, d_up, n_rows, n_cols, stride_gr, stride_ur, stride_yr, stride_dgr,
                       stride_dur, ACC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                       ROW_ALIGN: tl.constexpr):
    # d up = grad * silu(gate); d gate = grad * up * silu'(gate), silu' = sigmoid * (1 + gate * (1 - sigmoid)).
    n_cols = known_multiple(n_cols, ROW_ALIGN)
    stride_gr = known_multiple(stride_gr, ROW_ALIGN)
    stride_ur = known_multiple(stride_ur, ROW_ALIGN)
    stride_yr = known_multiple(stride_yr, ROW_ALIGN)
    stride_dgr = known_multiple(stride_dgr, ROW_ALIGN)
    stride_dur = known_multiple(stride_dur, ROW_ALIGN)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    a = tl.load(gate + rows[:, None] * stride_gr + cols[None, :], mask=mask, other=0.0).to(ACC)
    b = tl.load(up + rows[:, None] * stride_ur + cols[None, :], mask=mask, other=0.0).to(ACC)
    g = tl.load(grad + rows[:, None] * stride_yr + cols[None, :], mask=mask, other=0.0).to(ACC)
    sig = tl.sigmoid(a)
    tl.store(d_gate + rows[:, None] * stride_dgr + cols[None, :],
             (g * b * sig * (1.0 + a * (1.0 - sig))).to(d_gate.dtype.element_ty), mask=mask)
    tl.store(d_up + rows[:, None] * stride_dur + cols[None, :], (g * a * sig).to(d_up.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------- launchers
# Elements of each input one program takes (a bandwidth-bound elementwise kernel: enough bytes in flight); 1K in
# float64, whose 4K spilled (tools/swiglu_variants.py).
_TILE_ELEMS = 4096
_TILE_ELEMS_FLOAT64 = 1024


def _tiles(n_rows: int, n_cols: int, dtype: torch.dtype) -> tuple[tuple[int, int], dict]:
    elems = _TILE_ELEMS_FLOAT64 if dtype == torch.float64 else _TILE_ELEMS
    block_c = min(next_power_of_2(n_cols), elems)
    block_r = max(1, elems // block_c)
    return (cdiv(n_rows, block_r), cdiv(n_cols, block_c)), dict(BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)


def _check_rows(gate: Tensor, **others: Tensor) -> None:
    """The launchers' operands are ``(N, F)`` tensors of one shape (the custom ops can be called directly: a kernel
    must not read outside them)."""
    for name, t in others.items():
        if gate.dim() != 2 or t.shape != gate.shape:
            raise ValueError(f"{name}: expected gate's (N, F) shape {tuple(gate.shape)}, got {tuple(t.shape)}")


def silu_mul_fwd_triton(gate: Tensor, up: Tensor) -> Tensor:
    """``silu(gate) * up`` of two ``(N, F)`` tensors (any row strides): a new contiguous ``(N, F)``."""
    _check_rows(gate, up=up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if out.numel() == 0:
        return out
    gate, up = last_dim_contiguous(gate), last_dim_contiguous(up)
    grid, tiles = _tiles(*gate.shape, gate.dtype)
    _swiglu_fwd_kernel[grid](gate, up, out, *gate.shape, gate.stride(0), up.stride(0), out.stride(0),
                             ACC=acc_type(gate.dtype), ROW_ALIGN=row_align(gate.shape[1], gate.stride(0),
                                                                           up.stride(0), out.stride(0)), **tiles)
    return out


def silu_mul_bwd_into(gate: Tensor, up: Tensor, grad: Tensor, d_gate: Tensor, d_up: Tensor) -> None:
    """The gradients of :func:`silu_mul_fwd_triton` given ``grad``, written into ``d_gate`` and ``d_up`` (``(N, F)``,
    any row strides, last stride 1: e.g. the two halves of one tensor)."""
    _check_rows(gate, up=up, grad=grad, d_gate=d_gate, d_up=d_up)
    if grad.numel() == 0:
        return
    gate, up, grad = last_dim_contiguous(gate), last_dim_contiguous(up), last_dim_contiguous(grad)
    grid, tiles = _tiles(*grad.shape, gate.dtype)
    strides = (gate.stride(0), up.stride(0), grad.stride(0), d_gate.stride(0), d_up.stride(0))
    _swiglu_bwd_kernel[grid](gate, up, grad, d_gate, d_up, *grad.shape, *strides, ACC=acc_type(gate.dtype),
                             ROW_ALIGN=row_align(grad.shape[1], *strides), **tiles)


def swiglu_fwd_triton(x: Tensor) -> Tensor:
    """``x`` ``(N, 2F)`` (any row stride) -> ``silu(x[:, :F]) * x[:, F:]``, a new contiguous ``(N, F)``."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x: expected (N, 2F) rows, got shape {tuple(x.shape)}")
    gate, up = x.chunk(2, dim=-1)
    return silu_mul_fwd_triton(gate, up)


def swiglu_bwd_triton(x: Tensor, grad: Tensor) -> Tensor:
    """The gradient of :func:`swiglu_fwd_triton` w.r.t. ``x``, given ``grad`` ``(N, F)``: a new contiguous
    ``(N, 2F)``, both halves written by one kernel (no concatenation)."""
    dx = torch.empty((grad.shape[0], 2 * grad.shape[1]), dtype=x.dtype, device=x.device)
    silu_mul_bwd_into(*x.chunk(2, dim=-1), grad, *dx.chunk(2, dim=-1))
    return dx


def silu_mul_bwd_triton(gate: Tensor, up: Tensor, grad: Tensor) -> tuple[Tensor, Tensor]:
    """The gradients of :func:`silu_mul_fwd_triton` w.r.t. ``gate`` and ``up``: new contiguous ``(N, F)`` tensors."""
    d_gate, d_up = (torch.empty(grad.shape, dtype=gate.dtype, device=gate.device) for _ in range(2))
    silu_mul_bwd_into(gate, up, grad, d_gate, d_up)
    return d_gate, d_up


DOUBLE_BACKWARD = ("varlen.swiglu / silu_mul: the Triton path has no double backward (create_graph=True through it); "
                   "the torch backend has one")


# ------------------------------------------------------------------------------------ custom ops
# torch.compile sees each step as one opaque op with its output shape from the fake implementation. Eager calls
# run the kernels directly (varlen._backend.through_custom_op).
_swiglu_fwd_op = torch.library.custom_op("varlen::swiglu_forward", swiglu_fwd_triton, mutates_args=())
_swiglu_bwd_op = torch.library.custom_op("varlen::swiglu_backward", swiglu_bwd_triton, mutates_args=())
_silu_mul_fwd_op = torch.library.custom_op("varlen::silu_mul_forward", silu_mul_fwd_triton, mutates_args=())
_silu_mul_bwd_op = torch.library.custom_op("varlen::silu_mul_backward", silu_mul_bwd_triton, mutates_args=())


@_swiglu_fwd_op.register_fake
def _(x):
    return x.new_empty((x.shape[0], x.shape[1] // 2))


@_swiglu_bwd_op.register_fake
def _(x, grad):
    return x.new_empty((grad.shape[0], 2 * grad.shape[1]))


@_silu_mul_fwd_op.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


@_silu_mul_bwd_op.register_fake
def _(gate, up, grad):
    return gate.new_empty(grad.shape), gate.new_empty(grad.shape)


class _SwiGLU(torch.autograd.Function):
    """One input, its halves the gate and up: one gradient tensor."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return (_swiglu_fwd_op if through_custom_op() else swiglu_fwd_triton)(x)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        dx = (_swiglu_bwd_op if through_custom_op() else swiglu_bwd_triton)(x, grad)
        return refuse_double_backward(DOUBLE_BACKWARD, (dx,), x, grad)


class _SiluMul(torch.autograd.Function):
    """Gate and up as two tensors (two projections): two gradient tensors."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return (_silu_mul_fwd_op if through_custom_op() else silu_mul_fwd_triton)(gate, up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        grads = (_silu_mul_bwd_op if through_custom_op() else silu_mul_bwd_triton)(gate, up, grad)
        return refuse_double_backward(DOUBLE_BACKWARD, tuple(grads), gate, up, grad)


# ---------------------------------------------------------------------------------------- public
def swiglu_values(x: Tensor, backend: str | None = None) -> Tensor:
    """``silu(gate) * up`` of a tensor ``(..., 2F)`` (gate: the first ``F`` features): the op behind
    :func:`swiglu` and ``varlen.nn``'s ``activation="swiglu"`` on dense inputs. Returns ``(..., F)``. Raises
    ValueError for a last dim that is odd or missing."""
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x: SwiGLU splits the last dim into a gate and an input of equal widths, so it must be "
                         f"even; got shape {tuple(x.shape)}")
    backend = capabilities.resolve(x.device, x.dtype, "ragged", backend)
    if backend == "torch":
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # a view wherever the leading dims are one stride apart
    return _SwiGLU.apply(rows).view(*x.shape[:-1], x.shape[-1] // 2)


def silu_mul(gate: Tensor, up: Tensor, backend: str | None = None) -> Tensor:
    """``silu(gate) * up`` of two tensors of one shape and dtype (the outputs of a gate and an up projection, as in
    transformers' Llama MLP): the same kernels as :func:`swiglu`, gradients for both."""
    for name, t in (("gate", gate), ("up", up)):
        if not isinstance(t, Tensor) or t.dim() < 1:
            raise TypeError(f"{name}: expected a tensor of at least one dim, got "
                            f"{type(t).__name__ if not isinstance(t, Tensor) else 'a 0-dim tensor'}")
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        raise ValueError(f"up: expected gate's shape, dtype and device {tuple(gate.shape)}, {gate.dtype}, "
                         f"{gate.device}; got {tuple(up.shape)}, {up.dtype}, {up.device}")
    backend = capabilities.resolve(gate.device, gate.dtype, "ragged", backend)
    if backend == "torch":
        return F.silu(gate) * up
    n_rows = math.prod(gate.shape[:-1])
    rows = [t.reshape(n_rows, t.shape[-1]) for t in (gate, up)]
    return _SiluMul.apply(*rows).view(gate.shape)


def swiglu(x: JaggedTensor | Tensor, *, backend: str | None = None) -> JaggedTensor:
    """SwiGLU of a jagged ``(B, j, *inner, 2F)`` tensor: ``silu(gate) * up`` with ``gate, up = x.chunk(2, -1)``.

    Args:
        x: a JaggedTensor or a ``torch.nested`` jagged tensor, floating point, with at least one inner dim; its last
            dim even (the gate's features, then the input's).
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (default: :func:`varlen.use_backend`'s).

    Returns a JaggedTensor ``(B, j, *inner, F)`` with ``x``'s offsets and dtype, differentiable w.r.t. x. Like torch's
    ``silu`` and ``mul``, it has no autocast rule: it computes in ``x``'s dtype (the kernels' arithmetic in float32).
    Raises TypeError for a non-jagged or non-float ``x``, ValueError for an odd or missing last dim.
    """
    x = as_jagged(x, "x")
    check_dtype("x.values", x.values, FLOAT_DTYPES)
    if x.values.dim() < 2 or x.values.shape[-1] % 2:
        raise ValueError(f"x: SwiGLU splits the last dim into a gate and an input of equal widths, so it must be "
                         f"even; got inner shape {tuple(x.inner_shape)}")
    return x.with_values(swiglu_values(x.values, backend))
