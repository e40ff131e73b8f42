"""Conversion between jagged ``values`` and a padded ``(B, max_len, *inner)`` tensor.

Each direction is the other's backward. One launch for the whole batch on either path.
"""

from __future__ import annotations

import torch

from .. import _backend
from ..jagged import segment_ids


def _row_positions(offsets: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row of values: its sequence b and its position inside that sequence."""
    seq = segment_ids(offsets, total)
    pos = torch.arange(total, device=offsets.device) - offsets.to(torch.int64)[seq]
    return seq, pos


def _to_padded_torch(values, offsets, width, padding_value):
    seq, pos = _row_positions(offsets, values.shape[0])
    out = values.new_full((offsets.shape[0] - 1, width, *values.shape[1:]), padding_value)
    out[seq, pos] = values
    return out


def _from_padded_torch(padded, offsets, total):
    seq, pos = _row_positions(offsets, total)
    return padded[seq, pos]


def _to_padded(values, offsets, width, padding_value):
    return _to_padded_torch(values, offsets, width, padding_value)


def _from_padded(padded, offsets, total, max_len):
    return _from_padded_torch(padded, offsets, total)


class _JaggedToPadded(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, offsets, width, padding_value):
        ctx.save_for_backward(offsets)
        ctx.total = values.shape[0]
        ctx.max_len = width
        return _to_padded(values, offsets, width, padding_value)

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        return _from_padded(grad, offsets, ctx.total, ctx.max_len), None, None, None


class _PaddedToJagged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, padded, offsets, total, max_len):
        ctx.save_for_backward(offsets)
        ctx.width = padded.shape[1]
        return _from_padded(padded, offsets, total, max_len)

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        return _to_padded(grad, offsets, ctx.width, 0.0), None, None, None


def jagged_to_padded(values: torch.Tensor, offsets: torch.Tensor, width: int,
                     padding_value: float = 0.0) -> torch.Tensor:
    """``(B, width, *inner)`` from jagged ``values``/``offsets``; ``width`` >= the longest length."""
    return _JaggedToPadded.apply(values, offsets, width, padding_value)


def padded_to_jagged(padded: torch.Tensor, offsets: torch.Tensor, total: int, max_len: int) -> torch.Tensor:
    """``(total, *inner)`` values: the first ``L_b`` rows of each ``padded[b]``."""
    return _PaddedToJagged.apply(padded, offsets, total, max_len)
