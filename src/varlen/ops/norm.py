"""Layer and RMS normalization of jagged tensors over trailing (inner) dims.

Normalizing over inner dims treats every row of ``values`` on its own, so each op runs once on the flat ``values``.
On CUDA the Triton kernels (``_norm_kernels.py``) run it, forward and backward, each row read once and written once;
the gradients of the weight and bias are summed in the same backward pass, in a fixed order. Otherwise (the CPU,
``backend="torch"``, rows wider than the kernels take, and the automatic choice under ``torch.compile``, where
Inductor fuses torch's norm with its neighbours) ``torch.nn.functional.layer_norm`` (whose backward,
``native_layer_norm_backward`` as in PyTorch's ``layer_norm_backward_nested``, gives the gradients of x, weight and
bias in one fused pass) or ``torch.nn.functional.rms_norm``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import guard_or_false

from .. import _amp, capabilities
from .._backend import scoped
from .._checks import (
    FLOAT_DTYPES,
    accumulate_dtype,
    check_dtype,
    check_int,
    check_real,
    check_same_device,
    check_same_dtype,
    check_tensor,
    is_int,
)
from ..jagged import JaggedTensor, as_jagged
from ._norm_kernels import NormRows, max_cols


def _normalized_shape(normalized_shape) -> tuple[int, ...]:
    if is_int(normalized_shape):
        normalized_shape = (normalized_shape,)
    if isinstance(normalized_shape, torch.Size):
        normalized_shape = tuple(normalized_shape)
    if (not isinstance(normalized_shape, Sequence)
            or not all(is_int(n) for n in normalized_shape)):
        raise TypeError(f"normalized_shape: expected an int or a sequence of ints, got {normalized_shape!r}")
    if len(normalized_shape) == 0:
        raise ValueError("normalized_shape: expected at least one dim, got ()")
    return tuple(check_int("normalized_shape", n) for n in normalized_shape)


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
               eps: float = 1e-5, *, backend: str | None = None) -> JaggedTensor:
    """Layer norm of a jagged ``(B, j, *inner)`` over the trailing dims ``normalized_shape``.

    Args:
        x: a JaggedTensor or a ``torch.nested`` jagged tensor, floating point.
        normalized_shape: an int or a sequence of ints equal to the last dims of ``inner``. The
            ragged dim (and the batch dim) can't be normalized over: a row's statistics would mix
            sequences of different lengths.
        weight, bias: optional ``normalized_shape`` tensors, ``x``'s dtype and device.
        eps: added to the variance, >= 0.
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (default: :func:`varlen.use_backend`'s). ``"auto"``
            takes the Triton kernels on CUDA, and torch's norm under ``torch.compile`` (Inductor fuses it).

    Returns a JaggedTensor with ``x``'s offsets, differentiable w.r.t. x, weight and bias. Under
    ``torch.autocast`` it follows ``torch.nn.functional.layer_norm`` (float32 on CUDA).
    Raises TypeError (non-jagged ``x``, wrong types, dtype mismatch) or ValueError (shapes, device,
    ``eps`` < 0, ``backend="triton"`` where it can't run) naming the argument.
    """
    x = as_jagged(x, "x")
    shape = _check_norm(x, normalized_shape, {"weight": weight, "bias": bias}, eps)
    return x.with_values(normalize(x.values, shape, weight, bias, float(eps), centered=True, backend=backend))


def rms_norm(x: JaggedTensor | torch.Tensor, normalized_shape: int | Sequence[int],
             weight: torch.Tensor | None = None, eps: float | None = None, *,
             backend: str | None = None) -> JaggedTensor:
    """RMS norm of a jagged ``(B, j, *inner)`` over the trailing dims ``normalized_shape``:
    ``x / sqrt(mean(x**2) + eps) * weight``, as ``torch.nn.functional.rms_norm``.

    Args:
        x: a JaggedTensor or a ``torch.nested`` jagged tensor, floating point.
        normalized_shape: an int or a sequence of ints equal to the last dims of ``inner`` (not the ragged
            dim, as :func:`layer_norm`).
        weight: optional ``normalized_shape`` tensor, ``x``'s dtype and device.
        eps: added to the mean square, >= 0; None takes the epsilon of the dtype it computes in (float32's for
            16-bit and float32 ``x``, float64's for float64), as torch.
        backend: as :func:`layer_norm`.

    Returns a JaggedTensor with ``x``'s offsets, differentiable w.r.t. x and weight. Under ``torch.autocast`` it
    follows ``torch.nn.functional.rms_norm``: float32 on CUDA from torch 2.12 on; torch 2.11 has no rule (the
    arithmetic is float32 whatever ``x``'s dtype, the result in ``x``'s dtype, the weight of any dtype). Raises
    TypeError / ValueError naming the argument, as :func:`layer_norm`.
    """
    x = as_jagged(x, "x")
    shape = _check_norm(x, normalized_shape, {"weight": weight}, 0.0 if eps is None else eps)
    return x.with_values(normalize(x.values, shape, weight, None, None if eps is None else float(eps),
                                   centered=False, backend=backend))


def _left_to_inductor(backend: str | None) -> bool:
    """Whether an automatic choice takes torch's norm because ``torch.compile`` traces the call: Inductor fuses torch's
    norm with the additions and casts beside it, which an opaque kernel prevents. The demo's compiled GPU recipe
    (``make demo``'s model, H100, batch 256): 19.0 ms per step with torch's layer norm, 22.1 with these kernels
    (bench/NOTES.md, "Norms under torch.compile"). ``backend="triton"`` still takes the kernels."""
    return torch.compiler.is_compiling() and (scoped() if backend is None else backend) == "auto"


def normalize(values: torch.Tensor, shape: tuple[int, ...], weight: torch.Tensor | None, bias: torch.Tensor | None,
              eps: float | None, *, centered: bool, backend: str | None = None) -> torch.Tensor:
    """Layer norm (``centered``) or RMS norm (``bias`` None) of ``values`` over its last dims ``shape``, as
    ``torch.nn.functional.layer_norm`` / ``rms_norm``: the op behind :func:`layer_norm`, :func:`rms_norm`,
    ``varlen.nn``'s norms on dense inputs and ``use_varlen_kernels``' RMSNorm. The arguments are not checked here
    (the public functions do).

    torch's rules, kept on the Triton path: under CUDA autocast layer norm runs in float32 (its inputs cast), and RMS
    norm too where this torch has that rule (``_amp.RMS_NORM_AUTOCASTS``); after that, layer norm takes one dtype
    (mixed dtypes get torch's error), while RMS norm computes in float32 (float64 for float64) with a weight of any
    dtype and returns ``values``' dtype. ``eps`` None: 1e-5 for layer norm, and for RMS norm the epsilon of the
    dtype it computes in (float32's for 16-bit inputs)."""
    n_cols = math.prod(shape)
    too_wide = (f"normalized_shape {shape} (the kernels normalize rows of at most {max_cols(values.dtype)} elements "
                f"in {values.dtype}; use backend='torch')" if n_cols > max_cols(values.dtype) else None)
    resolved = capabilities.resolve(values.device, values.dtype, "ragged", backend, too_wide)
    if resolved == "triton" and _left_to_inductor(backend):
        resolved = "torch"
    if centered and eps is None:
        eps = 1e-5
    if resolved == "torch" or guard_or_false(values.numel() == 0):  # (unbacked rows: the kernels take 0 rows)
        if centered:
            return F.layer_norm(values, shape, weight, bias, eps)
        return F.rms_norm(values, shape, weight, eps)
    if centered or _amp.RMS_NORM_AUTOCASTS:
        values, weight, bias = _amp.cast(_amp.FLOAT32, values.device, values, weight, bias)
    if centered and any(t is not None and t.dtype != values.dtype for t in (weight, bias)):
        return F.layer_norm(values, shape, weight, bias, eps)  # torch's error for mixed dtypes
    if eps is None:
        eps = torch.finfo(accumulate_dtype(values.dtype)).eps
    rows = values.reshape(-1, n_cols)  # a view wherever the leading dims are one stride apart
    out = NormRows.apply(rows, None if weight is None else weight.reshape(n_cols),
                         None if bias is None else bias.reshape(n_cols), float(eps), centered)
    return out.view(values.shape)


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
