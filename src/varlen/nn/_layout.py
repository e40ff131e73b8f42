"""The two input layouts the modules take, and the row-wise steps that treat both alike.

A module's input is either jagged ``(B, j, E)`` (a JaggedTensor, or a ``torch.nested`` jagged tensor,
viewed as one) or dense ``(B, S, E)``. Everything but attention acts on each token (row) on its own,
so on a jagged input it runs once on the flat ``values`` through the varlen ops, and on a dense one
it runs on the tensor as is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import _amp, ops
from .._checks import FLOAT_DTYPES, check_dtype
from ..jagged import JaggedTensor, as_jagged
from ..ops.norm import normalize
from ..ops.rotary import rotate
from ..ops.swiglu import swiglu_values


def as_input(x, name: str, features: int, dtype: torch.dtype) -> JaggedTensor | torch.Tensor:
    """``x`` checked to be jagged ``(B, j, features)`` or dense ``(B, S, features)`` of ``dtype`` (any float
    dtype under ``torch.autocast``)."""
    if isinstance(x, JaggedTensor) or (isinstance(x, torch.Tensor) and x.is_nested):
        x = as_jagged(x, name)
        rows, layout = x.values, "jagged (B, j, E)"
        shape = tuple("j" if d is None else d for d in x.shape)
    elif isinstance(x, torch.Tensor):
        rows, layout, shape = x, "dense (B, S, E)", tuple(x.shape)
    else:
        raise TypeError(f"{name}: expected a varlen.JaggedTensor (B, j, E), a torch.nested jagged tensor or a "
                        f"dense torch.Tensor (B, S, E), got {type(x).__name__}")
    if len(shape) != 3 or shape[-1] != features:
        raise ValueError(f"{name}: expected a {layout} tensor with E = {features}, got shape {shape}")
    check_dtype(name, rows, FLOAT_DTYPES)
    # Under torch.autocast each op casts its inputs (as in torch.nn), so activations may differ from the
    # parameters' dtype.
    if rows.dtype != dtype and _amp.autocast_dtype(rows.device) is None:
        raise TypeError(f"{name}: dtype {rows.dtype} differs from the module's parameters' {dtype}; convert "
                        "one of them (e.g. module.to(dtype)) or run under torch.autocast")
    return x


def is_jagged(x) -> bool:
    return isinstance(x, JaggedTensor)


def batch_size(x) -> int:
    """The batch size of a (jagged or dense) input."""
    return x.batch_size if is_jagged(x) else x.shape[0]


def rowwise(x, fn):
    """``fn`` applied to the tokens: a jagged tensor's flat values, or the dense tensor itself."""
    return x.with_values(fn(x.values)) if is_jagged(x) else fn(x)


def split(x, sizes: tuple[int, ...], dim: int):
    """``x``'s tokens cut into consecutive parts of ``sizes`` along the token dim ``dim`` (negative, counted from the
    last: jagged values and dense tensors number their leading dims differently), as views. One ``split`` rather than
    a slice per part: autograd then builds the gradient of ``x`` with one ``cat``, where slices would each fill a zero
    tensor of ``x``'s shape, copy their gradient in and add them up."""
    if dim >= 0:
        raise ValueError(f"dim: expected a negative dim (counted from the last), got {dim}")
    if not is_jagged(x):
        return list(x.split(list(sizes), dim=dim))
    return [x.with_values(part) for part in x.values.split(list(sizes), dim=dim)]


def linear(x, layer: torch.nn.Linear):
    return ops.linear(x, layer.weight, layer.bias) if is_jagged(x) else layer(x)


def norm(x, module: torch.nn.LayerNorm | torch.nn.RMSNorm):
    """A ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` applied to each token (varlen's norm kernels on CUDA; torch's
    norm under ``torch.compile``, which Inductor fuses: ``ops.norm.normalize``)."""
    rms = isinstance(module, torch.nn.RMSNorm)
    if not is_jagged(x):
        return normalize(x, tuple(module.normalized_shape), module.weight, None if rms else module.bias, module.eps,
                         centered=not rms)
    if rms:
        return ops.rms_norm(x, module.normalized_shape, module.weight, module.eps)
    return ops.layer_norm(x, module.normalized_shape, module.weight, module.bias, module.eps)


def rotary(x, base: float):
    """Rotary embeddings of ``(B, j or S, heads, head_dim)`` tokens, positions counted from each sequence's start."""
    if is_jagged(x):
        return ops.rotary(x, base)
    positions = torch.arange(x.shape[1], device=x.device).repeat(x.shape[0])
    return rotate(x.flatten(0, 1), positions, base).unflatten(0, x.shape[:2])


def add(x, y):
    """``x + y`` for two tensors of one layout (jagged ones with the same offsets)."""
    return x.with_values(x.values + y.values) if is_jagged(x) else x + y


# name: (function of the tokens, hidden features per feed-forward feature: "swiglu" takes a gate and an input).
ACTIVATIONS = {"relu": (F.relu, 1), "gelu": (F.gelu, 1), "swiglu": (swiglu_values, 2)}


def activation(x, name: str):
    return rowwise(x, ACTIVATIONS[name][0])
