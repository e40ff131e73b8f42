"""Pointwise activations on jagged tensors: gelu, relu, silu, threshold.

A pointwise op doesn't see the sequence structure, so each runs once on the flat ``values`` with
PyTorch's own fused kernel, whose backward is fused too (``gelu_backward``, ``threshold_backward``,
``silu_backward``: PyTorch's ``NestedTensorBackward.cpp`` calls the same ones). There is no separate
Triton path: the same code runs on every device, whatever :func:`varlen.use_backend` says.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._checks import FLOAT_DTYPES, check_choice, check_dtype, check_real
from ..jagged import JaggedTensor, as_jagged

GELU_APPROXIMATIONS = ("none", "tanh")


def _jagged_float(x, name: str = "x") -> JaggedTensor:
    x = as_jagged(x, name)
    check_dtype(f"{name}.values", x.values, FLOAT_DTYPES)
    return x


def gelu(x: JaggedTensor | torch.Tensor, approximate: str = "none") -> JaggedTensor:
    """GELU of a jagged tensor ``(B, j, *inner)``, as ``torch.nn.functional.gelu``.

    Args:
        x: a JaggedTensor or a ``torch.nested`` jagged tensor, floating point.
        approximate: ``"none"`` (exact, with erf) or ``"tanh"``.

    Returns a JaggedTensor with ``x``'s offsets. Raises TypeError for a non-jagged ``x`` or a
    non-float dtype, ValueError for another ``approximate``.
    """
    x = _jagged_float(x)
    check_choice("approximate", approximate, GELU_APPROXIMATIONS)
    return x.with_values(F.gelu(x.values, approximate=approximate))


def relu(x: JaggedTensor | torch.Tensor) -> JaggedTensor:
    """``max(x, 0)`` of a floating-point jagged tensor; the gradient at 0 is 0 (as torch's)."""
    x = _jagged_float(x)
    return x.with_values(F.relu(x.values))


def silu(x: JaggedTensor | torch.Tensor) -> JaggedTensor:
    """``x * sigmoid(x)`` of a floating-point jagged tensor."""
    x = _jagged_float(x)
    return x.with_values(F.silu(x.values))


def threshold(x: JaggedTensor | torch.Tensor, threshold: float, value: float) -> JaggedTensor:
    """``x`` where ``x > threshold``, else ``value`` (as ``torch.nn.functional.threshold``).

    The gradient flows to the elements above ``threshold`` only. Raises TypeError when ``threshold``
    or ``value`` is not a real number.
    """
    x = _jagged_float(x)
    check_real("threshold", threshold)
    check_real("value", value)
    return x.with_values(F.threshold(x.values, threshold, value))
