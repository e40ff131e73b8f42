"""Cross-entropy of token rows over a vocabulary, from logits in any float dtype, without a float32 copy of them.

``loss[r] = logsumexp(logits[r]) - logits[r, targets[r]]`` (0 where ``targets[r] == ignore_index``), summed or averaged
over the rows whose target isn't ignored, as ``torch.nn.functional.cross_entropy``.

The Triton kernels compute in float32 (float64 for float64) from the logits as they are: the forward reads each row
once (online max and sum of exponentials) and keeps the row's max and the log of its sum apart (their sum would lose
the latter to rounding where logits are large); the backward reads the row again and writes ``(softmax - onehot) *
grad`` in the logits' dtype. Torch's path (and transformers' loss, which upcasts first) makes a float32 copy of the
logits, their log-softmax, and a float32 gradient: for a language model's 32768 x 32000 bf16 logits, 12 GB of extra
traffic each way and 4 GB of memory. The PyTorch path (CPU) is ``F.cross_entropy`` on the upcast logits. A target
outside ``[0, V)`` (and not ``ignore_index``) gives NaN for its row on the GPU, where checking would read the device on
the host (torch's own kernel stops with a device-side assert there); on the CPU, torch raises.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import capabilities
from .._backend import refuse_double_backward, through_custom_op
from .._checks import (
    FLOAT_DTYPES,
    accumulate_dtype,
    check_choice,
    check_dtype,
    check_int,
    checks_metadata,
    is_integer_dtype,
)
from .._kernel_math import add_to_max_sum, exp, lowest_like, reduce_max_sum
from .._launch import fast_launch
from .._triton import tl, triton
from ..tiling import acc_type, cdiv, last_dim_contiguous, next_power_of_2

REDUCTIONS = ("mean", "sum", "none")
DOUBLE_BACKWARD = ("varlen.cross_entropy: the Triton path has no double backward (create_graph=True through it); "
                   "the torch backend has one")


# ------------------------------------------------------------------------------------ kernels
@fast_launch
@triton.jit(do_not_specialize=["n_rows"])
def _cross_entropy_fwd_kernel(logits, targets, losses, row_max, row_log_sum, n_rows, n_cols, stride_lr, ignore_index,
                              ACC: tl.constexpr, BLOCK_V: tl.constexpr):
    # One row: its max and the log of its sum of exp(x - max) by online max and sum (a running pair per lane,
    # combined once after the loop), the target's logit, the row's loss (max - picked) + log(sum): kept apart, since
    # max + log(sum) would lose log(sum) to rounding where |max| is large. The full blocks load unmasked and the
    # last, partial one masked: the loop's instructions per element bound the 16-bit forward (bench/NOTES.md).
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride_lr
    cols = tl.arange(0, BLOCK_V)
    s_lane = tl.zeros([BLOCK_V], ACC)
    m_lane = lowest_like(s_lane)
    n_full = n_cols // BLOCK_V * BLOCK_V
    for v0 in tl.range(0, n_full, BLOCK_V, num_stages=3):  # (pipelined: the next blocks' loads in flight)
        m_lane, s_lane = add_to_max_sum(m_lane, s_lane, tl.load(base + v0 + cols).to(ACC))
    if n_full < n_cols:
        x = tl.load(base + n_full + cols, mask=n_full + cols < n_cols, other=float("-inf")).to(ACC)
        m_lane, s_lane = add_to_max_sum(m_lane, s_lane, x)
    m, total = reduce_max_sum(m_lane, s_lane)
    shift = tl.where(m == float("-inf"), 0.0, m)
    log_sum = tl.log(total)
    target = tl.load(targets + row)
    valid = (target >= 0) & (target < n_cols)
    # (a bad target, or an empty vocabulary, reads nothing and gives NaN)
    picked = tl.load(base + tl.where(valid, target, 0), mask=valid, other=0.0).to(ACC)
    loss = tl.where(target == ignore_index, 0.0, tl.where(valid, (shift - picked) + log_sum, float("nan")))
    tl.store(losses + row, loss)
    tl.store(row_max + row, shift)
    tl.store(row_log_sum + row, log_sum)


@fast_launch
@triton.jit(do_not_specialize=["n_rows"])
def _cross_entropy_bwd_kernel(logits, targets, row_max, row_log_sum, row_scale, dlogits, n_rows, n_cols, stride_lr,
                              stride_dr, stride_scale, ignore_index, ACC: tl.constexpr, BLOCK_V: tl.constexpr):
    # d logits[r, c] = (exp(logits[r, c] - max[r] - log_sum[r]) - [c == target[r]]) * scale[r] over one block of one
    # row; 0 on rows whose target is ignored.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    ok = cols < n_cols
    x = tl.load(logits + row * stride_lr + cols, mask=ok, other=0.0).to(ACC)
    target = tl.load(targets + row)
    scale = tl.load(row_scale + row * stride_scale).to(ACC)
    scale = tl.where(target == ignore_index, 0.0, scale)
    p = exp((x - tl.load(row_max + row)) - tl.load(row_log_sum + row))
    d = (p - tl.where(cols == target, 1.0, 0.0)) * scale
    tl.store(dlogits + row * stride_dr + cols, d.to(dlogits.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------------- launchers
# Vocabulary entries per program (backward, 8 warps): 4K, 1K in float64.
_BLOCK_V = 4096
_BLOCK_V_FLOAT64 = 1024
# Per loop step of the forward, and its warps: 2K at 4 warps. H200 sweep, % of copy over the logits (bench/NOTES.md,
# "The cross-entropy forward's instructions"), 2K x 4 / 4K x 8 (the backward's plan, and the forward's before):
# 32768 x 32000 bf16 87-89 / 80-82, 8192 x 128256 bf16 87-91 / 78-84, 16384 x 50257 (rows not 16-byte aligned) fp16
# and bf16 76-78 / 51, float32 100 / 98-99.
_FWD_BLOCK_V = 2048
_FWD_WARPS = 4


def _block_v(n_cols: int, dtype: torch.dtype, most: int = _BLOCK_V) -> int:
    return min(next_power_of_2(max(n_cols, 1)), _BLOCK_V_FLOAT64 if dtype == torch.float64 else most)


def _check_rows(logits: Tensor, **per_row: Tensor) -> None:
    """``logits`` ``(N, V)`` with a unit column stride and one entry per row in each of ``per_row`` (the custom ops
    can be called directly: a kernel must not read outside its tensors)."""
    if logits.dim() != 2 or (logits.shape[1] > 1 and logits.stride(1) != 1):
        raise ValueError(f"logits: expected (N, V) rows with unit column stride, got shape {tuple(logits.shape)} "
                         f"strides {logits.stride()}")
    for name, t in per_row.items():
        if t.shape != logits.shape[:1]:
            raise ValueError(f"{name}: expected shape ({logits.shape[0]},), one entry per row of logits; got "
                             f"{tuple(t.shape)}")


def _check_target_dtype(targets: Tensor) -> None:
    """Integer class indices (the kernels add them to a pointer)."""
    if not is_integer_dtype(targets.dtype):
        raise TypeError(f"targets: expected integer class indices, got dtype {targets.dtype}")


def cross_entropy_fwd_triton(logits: Tensor, targets: Tensor, ignore_index: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row losses, maxima and logs of the sums of exponentials (float32; float64 for float64) of ``logits``
    ``(N, V)`` (unit column stride)."""
    _check_rows(logits, targets=targets)
    _check_target_dtype(targets)
    targets = targets.contiguous()  # (the kernel reads targets[row] at stride 1: a column or an expanded index isn't)
    n_rows, n_cols = logits.shape
    out_dtype = accumulate_dtype(logits.dtype)
    losses, row_max, row_log_sum = (torch.empty(n_rows, dtype=out_dtype, device=logits.device) for _ in range(3))
    if n_rows:
        _cross_entropy_fwd_kernel[(n_rows,)](logits, targets, losses, row_max, row_log_sum, n_rows, n_cols,
                                             logits.stride(0), ignore_index, ACC=acc_type(logits.dtype),
                                             BLOCK_V=_block_v(n_cols, logits.dtype, _FWD_BLOCK_V), num_warps=_FWD_WARPS)
    return losses, row_max, row_log_sum


def cross_entropy_bwd_triton(logits: Tensor, targets: Tensor, row_max: Tensor, row_log_sum: Tensor, row_scale: Tensor,
                             ignore_index: int) -> Tensor:
    """The gradient w.r.t. ``logits`` of ``sum_r row_scale[r] * loss[r]`` (``row_scale`` ``(N,)``, any stride, e.g.
    an expanded scalar): a new contiguous tensor in the logits' dtype."""
    _check_rows(logits, targets=targets, row_max=row_max, row_log_sum=row_log_sum, row_scale=row_scale)
    _check_target_dtype(targets)
    targets, row_max, row_log_sum = (t.contiguous() for t in (targets, row_max, row_log_sum))  # (read at stride 1)
    n_rows, n_cols = logits.shape
    dlogits = torch.empty((n_rows, n_cols), dtype=logits.dtype, device=logits.device)
    if dlogits.numel():
        block_v = _block_v(n_cols, logits.dtype)
        _cross_entropy_bwd_kernel[(n_rows, cdiv(n_cols, block_v))](
            logits, targets, row_max, row_log_sum, row_scale, dlogits, n_rows, n_cols, logits.stride(0),
            dlogits.stride(0), row_scale.stride(0), ignore_index, ACC=acc_type(logits.dtype), BLOCK_V=block_v,
            num_warps=8)
    return dlogits


# ------------------------------------------------------------------------------------ custom ops
# torch.compile sees each step as one opaque op with its output shape from the fake implementation. Eager calls
# run the kernels directly (varlen._backend.through_custom_op).
_fwd_op = torch.library.custom_op("varlen::cross_entropy_forward", cross_entropy_fwd_triton, mutates_args=())
_bwd_op = torch.library.custom_op("varlen::cross_entropy_backward", cross_entropy_bwd_triton, mutates_args=())


@_fwd_op.register_fake
def _(logits, targets, ignore_index):
    dtype = accumulate_dtype(logits.dtype)
    return tuple(logits.new_empty(logits.shape[:1], dtype=dtype) for _ in range(3))


@_bwd_op.register_fake
def _(logits, targets, row_max, row_log_sum, row_scale, ignore_index):
    return logits.new_empty(logits.shape)


class _RowLosses(torch.autograd.Function):
    """Per-row losses (0 where ignored); the backward takes any per-row gradient."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index):
        fwd = _fwd_op if through_custom_op() else cross_entropy_fwd_triton
        losses, row_max, row_log_sum = fwd(logits, targets, ignore_index)
        ctx.save_for_backward(logits, targets, row_max, row_log_sum)
        ctx.ignore_index = ignore_index
        return losses

    @staticmethod
    def backward(ctx, grad):
        logits, targets, row_max, row_log_sum = ctx.saved_tensors
        bwd = _bwd_op if through_custom_op() else cross_entropy_bwd_triton
        dlogits = bwd(logits, targets, row_max, row_log_sum, grad, ctx.ignore_index)
        return (*refuse_double_backward(DOUBLE_BACKWARD, (dlogits,), logits, grad), None, None)


# ---------------------------------------------------------------------------------------- public
def _check_target_range(targets: Tensor, ignore_index: int, classes: int) -> None:
    """ValueError for a target outside ``[0, classes)`` that isn't ``ignore_index`` (read on the host: CPU tensors, or
    a GPU under ``varlen.set_checks(True)``)."""
    outside = (targets != ignore_index) & ((targets < 0) | (targets >= classes))
    if bool(outside.any()):
        rows = outside.nonzero().flatten()[:5].tolist()
        raise ValueError(f"targets: {targets[rows].tolist()} at rows {rows} lie outside [0, {classes}) (the logits' "
                         f"classes) and are not ignore_index ({ignore_index})")


def cross_entropy(logits: Tensor, targets: Tensor, *, ignore_index: int = -100, reduction: str = "mean",
                  backend: str | None = None) -> Tensor:
    """``torch.nn.functional.cross_entropy(logits.float(), targets, ignore_index=..., reduction=...)`` for token rows,
    without the float32 copy of the logits (see the module's docstring).

    Args:
        logits: ``(N, V)`` floating point (a language model's head output, e.g. a JaggedTensor's ``values``).
        targets: ``(N,)`` integer class indices in ``[0, V)``, or ``ignore_index``.
        ignore_index: the target value whose rows add nothing (and count for nothing in the mean).
        reduction: ``"mean"`` (over the rows not ignored: NaN if there are none, as torch's), ``"sum"`` or
            ``"none"`` (per-row losses, 0 where ignored).
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (default: :func:`varlen.use_backend`'s).

    Returns the loss in float32 (float64 for float64 logits), differentiable w.r.t. ``logits`` (once: the Triton path
    has no double backward); the gradient comes in the logits' dtype. Raises TypeError for non-tensors, non-float
    logits, non-integer targets or a non-integer ``ignore_index``, ValueError for shapes that don't match, targets on
    another device, another ``reduction``, or targets outside ``[0, V)`` other than ``ignore_index`` where they can be
    read without a sync (CPU tensors; a GPU under ``varlen.set_checks(True)``). Elsewhere such a target's row gets a
    NaN loss from the Triton kernels (which read no logit outside the row), and torch's own error from
    ``backend="torch"``.
    """
    for name, t in (("logits", logits), ("targets", targets)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    check_dtype("logits", logits, FLOAT_DTYPES)
    _check_target_dtype(targets)
    ignore_index = check_int("ignore_index", ignore_index)
    if not -(2 ** 63) <= ignore_index < 2 ** 63:
        raise ValueError(f"ignore_index: expected an int64 value, got {ignore_index}")
    check_choice("reduction", reduction, REDUCTIONS)
    if logits.dim() != 2:
        raise ValueError(f"logits: expected (N, V) rows, got shape {tuple(logits.shape)}")
    if targets.shape != logits.shape[:1]:
        raise ValueError(f"targets: expected shape ({logits.shape[0]},), one per row of logits {tuple(logits.shape)}; "
                         f"got {tuple(targets.shape)}")
    if targets.device != logits.device:
        raise ValueError(f"targets: on {targets.device}, but logits are on {logits.device}")
    if checks_metadata(targets.device):
        _check_target_range(targets, ignore_index, logits.shape[1])
    backend = capabilities.resolve(logits.device, logits.dtype, "ragged", backend)
    if backend == "torch":
        upcast = logits.double() if logits.dtype == torch.float64 else logits.float()
        return F.cross_entropy(upcast, targets.long(), ignore_index=ignore_index, reduction=reduction)
    losses = _RowLosses.apply(last_dim_contiguous(logits), targets.to(torch.int64), ignore_index)
    if reduction == "none":
        return losses
    total = losses.sum()
    return total if reduction == "sum" else total / (targets != ignore_index).sum()
