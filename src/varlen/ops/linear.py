"""Linear maps of jagged tensors: linear, matmul (shared or per-sequence weights), transposed_matmul.

Our counterpart of PyTorch's ``nested_linear_backward`` / ``matmul_backward_nested`` on the jagged
layout. A weight shared by every sequence (``linear``, ``matmul`` with a 2-D ``w``) is applied to the
flat ``values`` in one dense product, whose autograd backward is already one product per input. A
weight per sequence (``matmul`` with ``w (B, K, N)``) is a grouped GEMM, and its weight gradient
``dw_b = x_bᵀ dy_b`` is :func:`transposed_matmul`; the two ops are each other's backward:

    y = matmul(x, w):            dx_b = dy_b w_bᵀ (matmul with w transposed),  dw_b = x_bᵀ dy_b
    out = transposed_matmul(x, y): dx_b = y_b dout_bᵀ,  dy_b = x_b dout_b  (both matmuls)

The backwards call the differentiable ops themselves, so double backward works too. The Triton
kernels (``_linear_kernels.py``) take float16/bfloat16/float32; float64 (and any path resolved to
``"torch"``) uses the PyTorch path below, which has no per-sequence loop and no host sync either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _amp, capabilities
from .._backend import gradient_op, through_custom_op
from .._checks import FLOAT_DTYPES, check_dtype, check_ndim, check_same_device, check_same_dtype, check_tensor
from ..jagged import JaggedTensor, as_jagged, check_same_offsets
from ..padding import from_padded_values, to_padded_values
from . import _linear_kernels

MATMUL_CASES = ("x jagged (B, j, *, K) @ w dense (K, N) -> jagged (B, j, *, N)",
                "x jagged (B, j, K) @ w dense (B, K, N), w[b] for sequence b -> jagged (B, j, N)")


def _kernel_backend(t: torch.Tensor, requested: str | None) -> str:
    """The backend of the per-sequence products of ``t`` (the ``matmul`` family)."""
    return capabilities.resolve(t.device, t.dtype, "matmul", requested)


# ------------------------------------------------------------------------------ PyTorch path
# Both products go through the padded form and one torch.bmm: memory B * max_len * (K + N) for the
# padded operands, where gathering w per row (values.unsqueeze(1) @ w[segment_ids]) would take
# total * K * N. The zero padding adds nothing to the sums of transposed_matmul. (They run inside an
# autograd Function or a custom op: the conversions need no autograd of their own.)

def _grouped_matmul_torch(x, offsets, max_len, w):
    padded = to_padded_values(x, offsets, max_len)
    return from_padded_values(torch.bmm(padded, w), offsets, x.shape[0], max_len)


def _transposed_matmul_torch(x, y, offsets, max_len):
    return torch.bmm(to_padded_values(x, offsets, max_len).transpose(1, 2), to_padded_values(y, offsets, max_len))


# torch.compile sees each product as one opaque op (whatever the backend launches inside), with its
# output shape from the fake implementation; the host ints stay symbolic, so new lengths don't recompile.
# Eager calls run the implementations directly (varlen._backend.through_custom_op).
def _grouped_matmul(x: Tensor, offsets: Tensor, max_len: int, w: Tensor, backend: str) -> Tensor:
    if backend == "triton":
        return _linear_kernels.grouped_matmul(x, offsets, w)
    return _grouped_matmul_torch(x, offsets, max_len, w)


def _transposed_matmul(x: Tensor, y: Tensor, offsets: Tensor, max_len: int, backend: str) -> Tensor:
    if backend == "triton":
        return _linear_kernels.transposed_matmul(x, y, offsets, max_len)
    return _transposed_matmul_torch(x, y, offsets, max_len)


_grouped_matmul_op = torch.library.custom_op("varlen::grouped_matmul", _grouped_matmul, mutates_args=())
_transposed_matmul_op = torch.library.custom_op("varlen::transposed_matmul", _transposed_matmul, mutates_args=())


@_grouped_matmul_op.register_fake
def _(x, offsets, max_len, w, backend):
    return x.new_empty((x.shape[0], w.shape[2]))


@_transposed_matmul_op.register_fake
def _(x, y, offsets, max_len, backend):
    return x.new_empty((offsets.shape[0] - 1, x.shape[1], y.shape[1]))


def _run_grouped_matmul(x: Tensor, w: Tensor, offsets: Tensor, max_len: int, backend: str) -> Tensor:
    grouped_matmul = _grouped_matmul_op if through_custom_op() else _grouped_matmul
    return grouped_matmul(x, offsets, max_len, w, backend)


def _run_transposed_matmul(x: Tensor, y: Tensor, offsets: Tensor, max_len: int, backend: str) -> Tensor:
    transposed_matmul = _transposed_matmul_op if through_custom_op() else _transposed_matmul
    return transposed_matmul(x, y, offsets, max_len, backend)


# ---------------------------------------------------------------------------------- autograd
class _GroupedMatmul(torch.autograd.Function):
    """values ``(total, K)``, w ``(B, K, N)`` -> ``(total, N)``, row r times w[its sequence]."""

    @staticmethod
    def forward(ctx, x, w, offsets, max_len, backend):
        x_grad, w_grad = ctx.needs_input_grad[:2]
        ctx.save_for_backward(x if w_grad else None, w if x_grad else None, offsets)
        ctx.max_len, ctx.backend = max_len, backend
        return _run_grouped_matmul(x, w, offsets, max_len, backend)

    @staticmethod
    def backward(ctx, grad):
        x, w, offsets = ctx.saved_tensors
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = gradient_op(_GroupedMatmul, _run_grouped_matmul, grad, w.transpose(1, 2), offsets, ctx.max_len,
                             ctx.backend)
        if ctx.needs_input_grad[1]:
            dw = gradient_op(_TransposedMatmul, _run_transposed_matmul, x, grad, offsets, ctx.max_len, ctx.backend)
        return dx, dw, None, None, None


class _TransposedMatmul(torch.autograd.Function):
    """values x ``(total, K)``, y ``(total, N)`` -> ``(B, K, N)``, out[b] = x_bᵀ y_b."""

    @staticmethod
    def forward(ctx, x, y, offsets, max_len, backend):
        x_grad, y_grad = ctx.needs_input_grad[:2]
        ctx.save_for_backward(x if y_grad else None, y if x_grad else None, offsets)
        ctx.max_len, ctx.backend = max_len, backend
        return _run_transposed_matmul(x, y, offsets, max_len, backend)

    @staticmethod
    def backward(ctx, grad):
        x, y, offsets = ctx.saved_tensors
        dx = dy = None
        if ctx.needs_input_grad[0]:
            dx = gradient_op(_GroupedMatmul, _run_grouped_matmul, y, grad.transpose(1, 2), offsets, ctx.max_len,
                             ctx.backend)
        if ctx.needs_input_grad[1]:
            dy = gradient_op(_GroupedMatmul, _run_grouped_matmul, x, grad, offsets, ctx.max_len, ctx.backend)
        return dx, dy, None, None, None


# ------------------------------------------------------------------------------ public ops
def _jagged_operand(x, name: str) -> JaggedTensor:
    x = as_jagged(x, name)
    check_dtype(f"{name}.values", x.values, FLOAT_DTYPES)
    return x


def _check_matrix_rows(name: str, x: JaggedTensor) -> None:
    if x.values.dim() != 2:
        raise ValueError(f"{name}: expected a jagged (B, j, K), got logical shape "
                         f"{tuple('j' if d is None else d for d in x.shape)}")


def linear(x: JaggedTensor | torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> JaggedTensor:
    """``x @ weightᵀ + bias`` for a jagged ``x (B, j, *, K)``, as ``torch.nn.functional.linear``.

    Args:
        x: a JaggedTensor or ``torch.nested`` jagged tensor with at least one inner dim, K last.
        weight: ``(N, K)``, ``x``'s dtype and device.
        bias: optional ``(N,)``.

    Returns a JaggedTensor ``(B, j, *, N)`` with ``x``'s offsets, differentiable w.r.t. x, weight
    and bias. One dense product on the flat values, whatever the backend. Raises TypeError
    (non-jagged ``x``, non-tensor weight/bias, dtype) or ValueError (shapes, devices).
    """
    x = _jagged_operand(x, "x")
    if x.values.dim() < 2:
        raise ValueError("x: expected a jagged (B, j, *, K) with at least one inner dim, got logical "
                         f"shape {tuple('j' if d is None else d for d in x.shape)}")
    check_tensor("weight", weight)
    check_ndim("weight", weight, 2, "(N, K)")
    K = x.values.shape[-1]
    if weight.shape[1] != K:
        raise ValueError(f"weight: expected shape (N, {K}) to match x's last dim K = {K}, "
                         f"got {tuple(weight.shape)}")
    if bias is not None:
        check_tensor("bias", bias)
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias: expected shape ({weight.shape[0]},) (weight's N), "
                             f"got {tuple(bias.shape)}")
    check_same_device([("x.values", x.values), ("weight", weight), ("bias", bias)])
    values, weight, bias = _amp.cast(_amp.LOWER_PRECISION, x.device, x.values, weight, bias)
    check_same_dtype([("x.values", values), ("weight", weight), ("bias", bias)])
    return x.with_values(F.linear(values, weight, bias))


def matmul(x: JaggedTensor | torch.Tensor, w: torch.Tensor, *, backend: str | None = None) -> JaggedTensor:
    """Jagged times dense: one shared matrix, or one matrix per sequence.

    Supported cases:

    * ``x (B, j, *, K)`` @ ``w (K, N)`` -> ``(B, j, *, N)``: one dense product on the flat values.
    * ``x (B, j, K)`` @ ``w (B, K, N)`` -> ``(B, j, N)``: sequence b times ``w[b]``, a grouped GEMM
      (one Triton launch for the batch; on the PyTorch path one ``bmm`` of the padded form).

    Differentiable w.r.t. ``x`` and ``w`` (``w``'s gradient in the second case is
    :func:`transposed_matmul`). A jagged ``w`` (e.g. ``(B, K, j2)``) is not supported (TypeError
    listing the cases above); other shapes, batch sizes, devices: ValueError; dtypes: TypeError.
    ``backend``: for the per-sequence case, ``"auto"``, ``"triton"`` or ``"torch"``; None (default): the
    enclosing ``varlen.use_backend``'s choice.
    """
    x = _jagged_operand(x, "x")
    if isinstance(w, JaggedTensor) or (isinstance(w, torch.Tensor) and w.is_nested):
        raise TypeError(f"w: a jagged w is not supported; supported cases: {'; '.join(MATMUL_CASES)}")
    check_tensor("w", w, kind="a dense torch.Tensor (K, N) or (B, K, N)")
    check_same_device([("x.values", x.values), ("w", w)])
    values, w = _amp.cast(_amp.LOWER_PRECISION, x.device, x.values, w)
    check_same_dtype([("x.values", values), ("w", w)])
    K = values.shape[-1] if values.dim() >= 2 else None
    if w.dim() == 2:
        if K is None or w.shape[0] != K:
            raise ValueError(f"w: shape {tuple(w.shape)} doesn't fit x of logical shape "
                             f"{tuple('j' if d is None else d for d in x.shape)}: x must be (B, j, *, K) "
                             "and w (K, N)")
        return x.with_values(values @ w)
    if w.dim() == 3:
        _check_matrix_rows("x", x)
        if w.shape[0] != x.batch_size:
            raise ValueError(f"w: per-sequence weights (B, K, N) need B = x's batch size {x.batch_size}, "
                             f"got shape {tuple(w.shape)}")
        if w.shape[1] != K:
            raise ValueError(f"w: expected shape ({x.batch_size}, {K}, N) to match x's K = {K}, "
                             f"got {tuple(w.shape)}")
        backend = _kernel_backend(values, backend)
        return x.with_values(_GroupedMatmul.apply(values, w, x.offsets, x.max_len, backend))
    raise ValueError(f"w: expected 2 or 3 dims, got shape {tuple(w.shape)}; supported cases: "
                     f"{'; '.join(MATMUL_CASES)}")


def transposed_matmul(x: JaggedTensor | torch.Tensor, y: JaggedTensor | torch.Tensor, *,
                      backend: str | None = None) -> torch.Tensor:
    """Dense ``(B, K, N)`` with ``out[b] = x_bᵀ y_b``: sum over sequence b's rows of ``x[r]ᵀ y[r]``.

    Args:
        x: jagged ``(B, j, K)``.
        y: jagged ``(B, j, N)`` with the same lengths as ``x``.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``; None (default): the enclosing
            ``varlen.use_backend``'s choice (see ``varlen.capabilities.JAGGED_KERNELS``).

    An empty sequence gives a zero matrix. This is the weight gradient of the per-sequence
    :func:`matmul`; it is differentiable w.r.t. x and y. On the Triton path, one launch for the batch
    (a program per sequence, K tile and N tile; long sequences are split over several programs when
    there are too few for the GPU). Raises TypeError (non-jagged inputs, dtypes) or ValueError
    (shapes, different lengths, devices).
    """
    x = _jagged_operand(x, "x")
    y = _jagged_operand(y, "y")
    _check_matrix_rows("x", x)
    _check_matrix_rows("y", y)
    check_same_offsets("y", y, "x", x)
    x_values, y_values = _amp.cast(_amp.LOWER_PRECISION, x.device, x.values, y.values)
    check_same_dtype([("x.values", x_values), ("y.values", y_values)])
    backend = _kernel_backend(x_values, backend)
    return _TransposedMatmul.apply(x_values, y_values, x.offsets, x.max_len, backend)
