"""Rotary position embeddings (RoPE) of jagged tensors, positions counted within each sequence.

Each row is rotated by its position: the pairs ``(x[i], x[i + D/2])`` of the last dim (the "half" layout of
GPT-NeoX and Hugging Face's Llama) turn by ``position * base ** (-2 i / D)``. The angles are computed in
float32 (float64 for float64 inputs), their cosines and sines rounded to ``x``'s dtype and applied there, as
transformers' Llama does, so a model ported from it computes the same numbers. Plain torch ops on the flat
values (autograd gives the backward, one more rotation); the positions come from the device offsets, with no
host sync.
"""

from __future__ import annotations

import numbers

import torch

from .._checks import FLOAT_DTYPES, check_dtype
from ..jagged import JaggedTensor, as_jagged
from ..offsets import row_positions


def check_rotary_base(base, name: str = "base") -> float:
    if isinstance(base, bool) or not isinstance(base, numbers.Real) or not base > 0:
        raise ValueError(f"{name}: expected a real number > 0 (the wavelength scale, e.g. 10000.0), got {base!r}")
    return float(base)


def rotate(x: torch.Tensor, positions: torch.Tensor, base: float) -> torch.Tensor:
    """``x`` ``(N, ..., D)`` rotated by ``positions`` ``(N,)`` (any integer or float dtype); ``D`` even."""
    half = x.shape[-1] // 2
    exact = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / base ** (torch.arange(0, half, device=x.device, dtype=exact) / half)
    angles = positions.to(exact)[:, None] * inv_freq[None, :]  # (elementwise: autocast leaves it alone)
    angles = torch.cat([angles, angles], dim=-1).view(x.shape[0], *(1,) * (x.dim() - 2), 2 * half)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rotary(x: JaggedTensor | torch.Tensor, base: float = 10000.0) -> JaggedTensor:
    """Rotary position embedding of a jagged ``(B, j, *inner, D)`` tensor, each row by its position inside
    its sequence (0 for each sequence's first row).

    Args:
        x: a JaggedTensor or a ``torch.nested`` jagged tensor, floating point, with at least one inner dim
            (typically ``(B, j, heads, head_dim)``); its last dim ``D`` even.
        base: the wavelength scale (``rope_theta`` in transformers' configs), > 0.

    Returns a JaggedTensor with ``x``'s offsets, differentiable w.r.t. x. Raises TypeError for a non-jagged
    or non-float ``x``, ValueError for an odd or missing last dim or a bad ``base``.
    """
    x = as_jagged(x, "x")
    check_dtype("x.values", x.values, FLOAT_DTYPES)
    base = check_rotary_base(base)
    if x.values.dim() < 2 or x.values.shape[-1] % 2:
        raise ValueError(f"x: rotary embeddings turn pairs of the last dim, which must be even; got inner shape "
                         f"{tuple(x.inner_shape)}")
    _, positions = row_positions(x.offsets, x.values.shape[0], max(x.max_len, 1))
    return x.with_values(rotate(x.values, positions, base))
