"""A drop-in for flash-attn 2.x's ``flash_attn.bert_padding``: between padded batches and varlen rows.

``from varlen.bert_padding import unpad_input, pad_input`` in place of ``from flash_attn.bert_padding
import ...``: the same public names, signatures and returns as flash-attn 2.7 / 2.8 (``unpad_input`` has
returned five values, with ``unused_mask``, since 2.7.0). The round trip around varlen's attention::

    q_unpad, indices, cu_seqlens, max_seqlen, _ = unpad_input(q, attention_mask)  # (B, S, H, D) -> (total, H, D)
    out_unpad = flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    out = pad_input(out_unpad, indices, B, S)                                       # zeros at the padding

What the returns are, as in flash-attn: the gathered rows in ``hidden_states``' dtype; ``indices`` int64
positions in the flattened ``(B * S)`` batch, in row-major order; ``cu_seqlens`` int32 ``(B + 1,)``
offsets; ``max_seqlen_in_batch`` a Python int; ``seqused`` int32 ``(B,)``; all on the mask's device
(which must be ``hidden_states``' device). ``unpad_input`` reads on the host, as flash-attn does: two
device-to-host syncs on a GPU, one for the positions of the valid tokens (``nonzero``) and one for
``max_seqlen_in_batch``; ``unpad_input_for_concatenated_sequences`` also makes two (it copies the lengths to the
host once, then finds the positions). ``pad_input`` and the ``index_*`` functions make none: they check their
indices (in range; distinct where rows are scattered to them) on the CPU and in varlen's checking mode
(``varlen.set_checks``), and trust them on a GPU otherwise (an index out of range is then torch's device-side
error).

The ``index_*`` functions are differentiable: ``index_first_axis`` gathers rows and its backward
scatters the gradient into zeros; ``index_put_first_axis`` scatters rows into zeros and its backward
gathers; ``index_first_axis_residual`` also returns the (detached) input, whose gradient its backward
adds to. The ``IndexFirstAxis``, ``IndexPutFirstAxis`` and ``IndexFirstAxisResidual`` autograd functions
behind them are exported too (call them with ``.apply``).

Differences from flash-attn: errors are ValueError / TypeError naming the argument (flash-attn asserts
or fails inside torch); a mask entry counts as valid when it is nonzero (flash-attn sums the mask, which
is the same for 0/1 masks); ``index_first_axis``'s backward adds the gradients of repeated indices
(flash-attn keeps one; the same for the distinct indices ``unpad_input`` returns); ``hidden_states`` of
only ``(B, S)`` and 1-dim inputs to the ``index_*`` functions work; an empty batch gives
``max_seqlen_in_batch = 0``.
"""

from __future__ import annotations

import torch

from ._checks import INDEX_DTYPES, check_dtype, check_same_device, check_tensor, checks_metadata, host_int

__all__ = [
    "IndexFirstAxis",
    "IndexFirstAxisResidual",
    "IndexPutFirstAxis",
    "index_first_axis",
    "index_first_axis_residual",
    "index_put_first_axis",
    "pad_input",
    "unpad_input",
    "unpad_input_for_concatenated_sequences",
]

_LENGTH_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
# (float 0/1 masks too, as after ``attention_mask.to(dtype)``: flash-attn's unpad_input takes them)
_MASK_DTYPES = (torch.bool, *_LENGTH_DTYPES, torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ------------------------------------------------------------------------------------ autograd functions
class IndexFirstAxis(torch.autograd.Function):
    """``input[indices]`` along dim 0; the backward scatters the gradient into zeros of ``input``'s shape."""

    @staticmethod
    def forward(ctx, input, indices):
        _check_rows("input", input)
        _check_indices(indices, input, "input", input.shape[0])
        ctx.save_for_backward(indices)
        ctx.first_axis_dim = input.shape[0]
        return input.index_select(0, indices)

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        grad_input = grad_output.new_zeros(ctx.first_axis_dim, *grad_output.shape[1:])
        return grad_input.index_add_(0, indices, grad_output), None


class IndexPutFirstAxis(torch.autograd.Function):
    """Zeros of ``(first_axis_dim, *values.shape[1:])`` with row ``indices[r]`` set to ``values[r]``; the
    backward gathers the gradient's rows ``indices``. The indices should be distinct."""

    @staticmethod
    def forward(ctx, values, indices, first_axis_dim):
        _check_rows("values", values)
        first_axis_dim = host_int("first_axis_dim", first_axis_dim)
        _check_indices(indices, values, "values", first_axis_dim, distinct=True)
        if indices.shape[0] != values.shape[0]:
            raise ValueError(f"indices: {indices.shape[0]} indices for the {values.shape[0]} rows of values; "
                             "there must be one index per row")
        ctx.save_for_backward(indices)
        output = values.new_zeros(first_axis_dim, *values.shape[1:])
        output[indices] = values
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (indices,) = ctx.saved_tensors
        return grad_output.index_select(0, indices), None, None


class IndexFirstAxisResidual(torch.autograd.Function):
    """``(input[indices], input)``: the rows and the input itself (detached), for a block that goes on with
    both; the backward adds the rows' gradient into the input's."""

    @staticmethod
    def forward(ctx, input, indices):
        _check_rows("input", input)
        _check_indices(indices, input, "input", input.shape[0])
        ctx.save_for_backward(indices)
        return input.index_select(0, indices), input.detach()

    @staticmethod
    def backward(ctx, grad_output, grad_residual):
        (indices,) = ctx.saved_tensors
        return grad_residual.index_add(0, indices, grad_output), None


def index_first_axis(input, indices):
    """``input[indices]`` for ``input`` ``(N, ...)`` and int ``indices`` ``(n,)``: ``(n, ...)``. Differentiable
    (the backward scatters into zeros)."""
    return IndexFirstAxis.apply(input, indices)


def index_put_first_axis(values, indices, first_axis_dim):
    """A ``(first_axis_dim, ...)`` zero tensor with rows ``indices`` set to ``values`` ``(n, ...)``.
    Differentiable (the backward gathers); the indices should be distinct."""
    return IndexPutFirstAxis.apply(values, indices, first_axis_dim)


def index_first_axis_residual(input, indices):
    """``(input[indices], input.detach())``; gradients of both outputs reach ``input``."""
    return IndexFirstAxisResidual.apply(input, indices)


# ------------------------------------------------------------------------------------- padding helpers
def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """The valid tokens of a padded batch, one after another, as flash-attn's varlen functions take them.

    Args:
        hidden_states: ``(B, S, ...)``.
        attention_mask: ``(B, S)`` bool, integer or float; nonzero marks a valid token (anywhere in its row).
        unused_mask: None, or ``(B, S)`` like ``attention_mask``: tokens that are allocated but unused.
            They are kept in the rows and counted in ``cu_seqlens``, but not in ``seqused`` (for kernels
            that take ``seqused``; put them after the used tokens of their sequence).

    Returns:
        ``(hidden_states_unpadded (total, ...), indices (total,) int64, cu_seqlens (B + 1,) int32,
        max_seqlen_in_batch int, seqused (B,) int32)``: the tokens where either mask is nonzero, their
        positions in the flattened ``(B * S, ...)`` batch, the offsets of each sequence's tokens, the
        longest sequence, and each sequence's count of ``attention_mask`` tokens.
    """
    _check_rows("hidden_states", hidden_states, ndim=2, layout="(batch, seqlen, ...)")
    _check_mask("attention_mask", attention_mask, hidden_states)
    valid = attention_mask != 0
    if unused_mask is None:
        kept = valid
    else:
        _check_mask("unused_mask", unused_mask, hidden_states)
        kept = valid | (unused_mask != 0)
    seqlens = kept.sum(dim=-1, dtype=torch.int32)
    indices = kept.flatten().nonzero().flatten()
    rows = hidden_states.flatten(0, 1)
    return (index_first_axis(rows, indices), indices, _cu_seqlens(seqlens), _max(seqlens),
            valid.sum(dim=-1, dtype=torch.int32))


def unpad_input_for_concatenated_sequences(hidden_states, attention_mask_in_length):
    """``unpad_input`` for rows that each hold several sequences one after another.

    Args:
        hidden_states: ``(B, S, ...)``.
        attention_mask_in_length: ``(B, S)`` integer: row b lists the lengths of the sequences packed at
            the start of ``hidden_states[b]``, then zeros; e.g. ``[2, 3, 0, 0, 0, 0]`` is two sequences
            of lengths 2 and 3 followed by one padding token.

    Returns:
        ``(hidden_states_unpadded (total, ...), indices (total,) int64, cu_seqlens (n + 1,) int32,
        max_seqlen_in_batch int)``, with one offset per packed sequence (n of them, in row order).
    """
    _check_rows("hidden_states", hidden_states, ndim=2, layout="(batch, seqlen, ...)")
    lengths = attention_mask_in_length
    _check_mask("attention_mask_in_length", lengths, hidden_states, dtypes=_LENGTH_DTYPES)  # (integers, not bools)
    host = lengths.cpu()  # the one copy of the lengths to the host (a device-to-host sync on a GPU)
    if bool((host < 0).any()):
        raise ValueError("attention_mask_in_length: has negative entries; each row holds sequence lengths")
    S = lengths.shape[1]
    host_per_row = host.sum(dim=-1)
    if bool((host_per_row > S).any()):
        b = int((host_per_row > S).nonzero()[0, 0])
        raise ValueError(f"attention_mask_in_length: row {b} sums to {int(host_per_row[b])}, more than its "
                         f"{S} positions")
    seqlens = host.flatten()[host.flatten() != 0]
    kept = torch.arange(S, device=lengths.device) < lengths.sum(dim=-1).unsqueeze(1)
    indices = kept.flatten().nonzero().flatten()  # on the device (the second sync)
    rows = hidden_states.flatten(0, 1)
    cu_seqlens = _cu_seqlens(seqlens).to(lengths.device, non_blocking=True)  # host to device: no sync
    return index_first_axis(rows, indices), indices, cu_seqlens, _max(seqlens)


def pad_input(hidden_states, indices, batch, seqlen):
    """The inverse of ``unpad_input``: ``(batch, seqlen, ...)`` zeros with the given rows put back.

    Args:
        hidden_states: ``(total, ...)``, one row per index.
        indices: ``(total,)`` integer positions in the flattened ``(batch * seqlen)`` batch, distinct
            (``unpad_input``'s).
        batch, seqlen: ints (or 1-element integer tensors), the padded shape.

    Returns:
        ``(batch, seqlen, ...)``, differentiable with respect to ``hidden_states``.
    """
    batch, seqlen = host_int("batch", batch), host_int("seqlen", seqlen)
    output = index_put_first_axis(hidden_states, indices, batch * seqlen)
    return output.view(batch, seqlen, *output.shape[1:])


# ------------------------------------------------------------------------------------------- checks
def _check_rows(name: str, t, ndim: int = 1, layout: str = "(rows, ...)") -> None:
    check_tensor(name, t)
    if t.dim() < ndim:
        raise ValueError(f"{name}: expected at least {ndim} dim{'s' if ndim > 1 else ''} {layout}, got shape "
                         f"{tuple(t.shape)}")


def _check_indices(indices, rows: torch.Tensor, rows_name: str, bound: int, distinct: bool = False) -> None:
    """``indices``: 1-dim integers on ``rows``' device; where they can be read without a sync (the CPU, a GPU in
    varlen's checking mode), each in ``[0, bound)`` and, where rows are scattered to them (``distinct``), distinct."""
    check_tensor("indices", indices)
    check_dtype("indices", indices, INDEX_DTYPES)
    if indices.dim() != 1:
        raise ValueError(f"indices: expected 1 dim (n,), got shape {tuple(indices.shape)}")
    check_same_device([(rows_name, rows), ("indices", indices)])
    if not checks_metadata(indices.device) or indices.numel() == 0:
        return
    outside = (indices < 0) | (indices >= bound)
    if bool(outside.any()):
        raise ValueError(f"indices: {indices[outside][:5].tolist()} lie outside [0, {bound})")
    # (unpad_input's indices increase: one comparison pass shows them distinct, where unique sorts them, 36 against
    # 398 us at 32k indices; other orders are sorted)
    if distinct and not bool((indices[1:] > indices[:-1]).all()) and indices.unique().numel() != indices.numel():
        raise ValueError(f"indices: repeat a row ({_repeated(indices)}); the rows they scatter to must be distinct")


def _repeated(indices: torch.Tensor) -> list[int]:
    values, counts = indices.unique(return_counts=True)
    return values[counts > 1][:5].tolist()


def _check_mask(name: str, mask, hidden_states: torch.Tensor, dtypes=_MASK_DTYPES) -> None:
    """Checks a ``(B, S)`` mask (or lengths) of one of ``dtypes`` against ``hidden_states`` ``(B, S, ...)``."""
    check_tensor(name, mask)
    check_dtype(name, mask, dtypes)
    if mask.shape != hidden_states.shape[:2]:
        raise ValueError(f"{name}: expected shape (batch, seqlen) = {tuple(hidden_states.shape[:2])} to match "
                         f"hidden_states, got {tuple(mask.shape)}")
    check_same_device([("hidden_states", hidden_states), (name, mask)])


def _cu_seqlens(seqlens: torch.Tensor) -> torch.Tensor:
    """``(n + 1,)`` int32 offsets, starting at 0, of sequences of the given lengths."""
    return torch.cat([seqlens.new_zeros(1, dtype=torch.int32), seqlens.cumsum(0, dtype=torch.int32)])


def _max(seqlens: torch.Tensor) -> int:
    return int(seqlens.max()) if seqlens.numel() else 0

