"""Layer and RMS normalization of jagged tensors over trailing (inner) dims.

Normalizing over inner dims treats every row of ``values`` on its own, so each op runs once on the
flat ``values`` with ``torch.nn.functional.layer_norm`` (whose backward, ``native_layer_norm_backward``
as in PyTorch's ``layer_norm_backward_nested``, gives the gradients of x, weight and bias in one fused
pass) or ``torch.nn.functional.rms_norm``. The same code runs on every device, whatever
:func:`varlen.use_backend` says.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .. import _amp
from .._checks import FLOAT_DTYPES, check_dtype, check_real, check_same_device, check_same_dtype, check_tensor
from ..jagged import JaggedTensor, as_jagged


def _normalized_shape(normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, int) and not isinstance(normalized_shape, bool):
        normalized_shape = (normalized_shape,)
    if isinstance(normalized_shape, torch.Size):
        normalized_shape = tuple(normalized_shape)
    if (not isinstance(normalized_shape, Sequence)
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in normalized_shape)):
        raise TypeError(f"normalized_shape: expected an int or a sequence of ints, got {normalized_shape!r}")
    if len(normalized_shape) == 0:
        raise ValueError("normalized_shape: expected at least one dim, got ()")
    return tuple(normalized_shape)


def _check_affine(name: str, t, shape: tuple[int, ...], x: JaggedTensor) -> None:
    if t is None:
        return
    check_tensor(name, t)
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape} (normalized_shape), got {tuple(t.shape)}")
    check_same_device([("x.values", x.values), (name, t)])
    if _amp.autocast_dtype(x.device) is None:  # under autocast, torch's layer_norm casts mixed dtypes itself
        check_same_dtype([("x.values", x.values), (name, t)])


def layer_norm(x: JaggedTensor | torch.Tensor, normalized_shape: int | Sequence[int],
               weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> JaggedTensor:
    """Layer norm of a jagged ``(B, j, *inner)`` over the trailing dims ``normalized_shape``.

    Args:
        x: a JaggedTensor or a ``torch.nested`` jagged tensor, floating point.
        normalized_shape: an int or a sequence of ints equal to the last dims of ``inner``. The
            ragged dim (and the batch dim) can't be normalized over: a row's statistics would mix
            sequences of different lengths.
        weight, bias: optional ``normalized_shape`` tensors, ``x``'s dtype and device.
        eps: added to the variance, >= 0.

    Returns a JaggedTensor with ``x``'s offsets, differentiable w.r.t. x, weight and bias. Under
    ``torch.autocast`` it follows ``torch.nn.functional.layer_norm`` (float32 on CUDA).
    Raises TypeError (non-jagged ``x``, wrong types, dtype mismatch) or ValueError (shapes, device,
    ``eps`` < 0) naming the argument.
    """
    x = as_jagged(x, "x")
    shape = _check_norm(x, normalized_shape, {"weight": weight, "bias": bias}, eps)
    return x.with_values(F.layer_norm(x.values, shape, weight, bias, float(eps)))


def rms_norm(x: JaggedTensor | torch.Tensor, normalized_shape: int | Sequence[int],
             weight: torch.Tensor | None = None, eps: float | None = None) -> JaggedTensor:
    """RMS norm of a jagged ``(B, j, *inner)`` over the trailing dims ``normalized_shape``:
    ``x / sqrt(mean(x**2) + eps) * weight``, as ``torch.nn.functional.rms_norm``.

    Args:
        x: a JaggedTensor or a ``torch.nested`` jagged tensor, floating point.
        normalized_shape: an int or a sequence of ints equal to the last dims of ``inner`` (not the ragged
            dim, as :func:`layer_norm`).
        weight: optional ``normalized_shape`` tensor, ``x``'s dtype and device.
        eps: added to the mean square, >= 0; None takes ``torch.finfo(x.dtype).eps``, as torch.

    Returns a JaggedTensor with ``x``'s offsets, differentiable w.r.t. x and weight. Under ``torch.autocast``
    it follows ``torch.nn.functional.rms_norm``. Raises TypeError / ValueError naming the argument, as
    :func:`layer_norm`.
    """
    x = as_jagged(x, "x")
    shape = _check_norm(x, normalized_shape, {"weight": weight}, 0.0 if eps is None else eps)
    return x.with_values(F.rms_norm(x.values, shape, weight, None if eps is None else float(eps)))


def _check_norm(x: JaggedTensor, normalized_shape, affine: dict, eps) -> tuple[int, ...]:
    """The checks both norms share; returns ``normalized_shape`` as a tuple."""
    check_dtype("x.values", x.values, FLOAT_DTYPES)
    shape = _normalized_shape(normalized_shape)
    inner = tuple(x.inner_shape)
    if len(shape) > len(inner):
        raise ValueError(f"normalized_shape: {shape} has {len(shape)} dims but x's inner shape {inner} "
                         f"(x is (B, j, *inner)) has {len(inner)}; normalizing over the ragged dim j is "
                         "not supported with the jagged layout")
    if inner[len(inner) - len(shape):] != shape:
        raise ValueError(f"normalized_shape: {shape} must equal the last dims of x's inner shape {inner}")
    for name, t in affine.items():
        _check_affine(name, t, shape, x)
    if not check_real("eps", eps) >= 0:
        raise ValueError(f"eps: got {eps}; must be >= 0")
    return shape
