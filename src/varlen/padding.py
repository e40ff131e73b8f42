"""Conversion between jagged ``values`` and a padded ``(B, max_len, *inner)`` tensor.

Each direction is the other's backward (so double backward works too). One launch for the whole
batch on either path. The Triton kernels see the inner dims flattened into F contiguous columns and
tile the work as (sequence, block of rows, block of columns), columns fastest, so that neighbouring
programs touch neighbouring memory.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.types import Number

from . import capabilities
from ._backend import gradient_op, through_custom_op
from ._checks import check_rows
from ._launch import fast_launch
from ._triton import tl, triton
from .offsets import row_positions
from .tiling import as_columns, cdiv, copy_tiles, known_multiple, row_align, sequence_rows, tile_coords


# ------------------------------------------------------------------------------------ kernels
# The padded width and the tile counts change with every batch: Triton must not specialize on them (a new
# kernel variant per batch). The padded side's batch stride is passed as a count of one of its other strides
# (``unit_stride``: the row stride, a model constant), so that its alignment survives; a count, not a copy,
# also covers broadcast rows (stride 0: the gradient of a sum over the padded rows).
@fast_launch
@triton.jit(do_not_specialize=["total", "width", "n_row_tiles"])
def _jagged_to_padded_kernel(values, offsets, pad, out, total, width, n_cols, n_row_tiles, n_col_tiles,
                             stride_vr, stride_vc, stride_or,
                             BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, ROW_ALIGN: tl.constexpr):
    # One program per (sequence, block of padded rows, block of columns); every padded row is written.
    # values has `total` rows; out is a contiguous (B, width, n_cols) tensor.
    n_cols = known_multiple(n_cols, ROW_ALIGN)
    stride_vr = known_multiple(stride_vr, ROW_ALIGN)
    stride_or = known_multiple(stride_or, ROW_ALIGN)
    b, row_tile, col_tile, start, length = tile_coords(tl.program_id(0), n_row_tiles, n_col_tiles, offsets,
                                                       total)
    rows = row_tile * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    cols = col_tile * BLOCK_F + tl.arange(0, BLOCK_F).to(tl.int64)
    col_ok = (cols < n_cols)[None, :]
    in_seq = (rows < length)[:, None] & col_ok
    x = tl.load(values + (start + rows)[:, None] * stride_vr + cols[None, :] * stride_vc, mask=in_seq)
    x = tl.where(in_seq, x, tl.load(pad))
    dst = out + (b.to(tl.int64) * width + rows[:, None]) * stride_or + cols[None, :]
    tl.store(dst, x, mask=(rows < width)[:, None] & col_ok)


@fast_launch
@triton.jit(do_not_specialize=["total", "width", "n_row_tiles", "batch_units"])
def _padded_to_jagged_kernel(padded, offsets, out, total, width, n_cols, n_row_tiles, n_col_tiles,
                             batch_units, unit_stride, stride_pr, stride_pc, stride_or,
                             BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, ROW_ALIGN: tl.constexpr):
    # One program per (sequence, block of rows up to max_len, block of columns); blocks past the
    # sequence's end have nothing to copy and return at once. padded has `width` rows per sequence,
    # out `total` rows: a sequence longer than `width` (wrong offsets) is cut there.
    n_cols = known_multiple(n_cols, ROW_ALIGN)
    unit_stride = known_multiple(unit_stride, ROW_ALIGN)
    stride_pr = known_multiple(stride_pr, ROW_ALIGN)
    stride_or = known_multiple(stride_or, ROW_ALIGN)
    b, row_tile, col_tile, start, length = tile_coords(tl.program_id(0), n_row_tiles, n_col_tiles, offsets,
                                                       total)
    length = tl.minimum(length, width)
    if row_tile * BLOCK_T >= length:
        return
    rows = row_tile * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    cols = col_tile * BLOCK_F + tl.arange(0, BLOCK_F).to(tl.int64)
    mask = (rows < length)[:, None] & (cols < n_cols)[None, :]
    src = (padded + b.to(tl.int64) * batch_units * unit_stride + rows[:, None] * stride_pr
           + cols[None, :] * stride_pc)
    x = tl.load(src, mask=mask)
    tl.store(out + (start + rows)[:, None] * stride_or + cols[None, :], x, mask=mask)


# Rows of an odd number of elements (3 columns: ROW_ALIGN 1) can't be loaded several elements at a time, and tiles of
# 4-column blocks leave a lane in four idle. Where a sequence's rows are contiguous (and the padded rows too) they are
# one run of length * F elements, and its padded rows another of width * F: these kernels copy the runs instead, in
# blocks of FLAT_BLOCK elements. H200, bf16 / float32, max_len 300-4096, % of copy, tiles -> runs (bench/NOTES.md,
# "Rows not 16 elements apart"): at 3 and 5 columns to_padded 13-48 -> 58-91, from_padded 14-62 -> 56-92. One column
# keeps its tiles (which are runs already, of the sequence's length): runs of 1024 lost at 300 rows (bf16 35 -> 26)
# and won at 4096 (41 -> 72). Two columns (ROW_ALIGN 2) keep them too: from_padded lost (bf16 79 -> 52).
FLAT_BLOCK = 1024


@fast_launch
@triton.jit(do_not_specialize=["total", "width", "n_blocks"])
def _flat_to_padded_kernel(values, offsets, pad, out, total, width, n_cols, n_blocks, BLOCK: tl.constexpr):
    # One program per (sequence, block of its padded run): values and out have contiguous rows of n_cols elements.
    b = tl.program_id(0) // n_blocks
    start, length = sequence_rows(offsets, b, total)
    at = (tl.program_id(0) % n_blocks).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = at < tl.minimum(length, width) * n_cols
    x = tl.where(live, tl.load(values + start * n_cols + at, mask=live), tl.load(pad))
    tl.store(out + b.to(tl.int64) * width * n_cols + at, x, mask=at < width * n_cols)


@fast_launch
@triton.jit(do_not_specialize=["total", "width", "n_blocks"])
def _flat_from_padded_kernel(padded, offsets, out, total, width, n_cols, n_blocks, BLOCK: tl.constexpr):
    # One program per (sequence, block of its run, up to max_len rows); blocks past the sequence's end return.
    b = tl.program_id(0) // n_blocks
    start, length = sequence_rows(offsets, b, total)
    n_live = tl.minimum(length, width) * n_cols
    first = (tl.program_id(0) % n_blocks).to(tl.int64) * BLOCK
    if first >= n_live:
        return
    at = first + tl.arange(0, BLOCK)
    x = tl.load(padded + b.to(tl.int64) * width * n_cols + at, mask=at < n_live)
    tl.store(out + start * n_cols + at, x, mask=at < n_live)


# ----------------------------------------------------------------------------------- launchers
def _flat_rows(n_cols: int, *row_strides: int) -> bool:
    """Whether the copies take flat runs: rows of an odd number of elements, more than one, each after another."""
    return n_cols > 1 and n_cols % 2 == 1 and all(stride == n_cols for stride in row_strides)


def _to_padded_triton(values: torch.Tensor, offsets: torch.Tensor, width: int, padding_value,
                      *, block_t: int | None = None, block_f: int | None = None) -> torch.Tensor:
    B = offsets.shape[0] - 1
    out = torch.empty((B, width, *values.shape[1:]), dtype=values.dtype, device=values.device)
    if out.numel() == 0:
        return out
    if values.shape[0] == 0:
        return out.fill_(padding_value)
    v = as_columns(values, 1)
    o = as_columns(out, 2)
    n_cols = v.shape[1]
    offsets = offsets.contiguous()  # (read at stride 1; a custom op's caller may pass a view)
    bt, bf = copy_tiles(width, n_cols, v.element_size(), v.device)
    bt, bf = block_t or bt, block_f or bf
    pad = torch.full((), padding_value, dtype=values.dtype, device=values.device)
    pad = pad.view(torch.uint8) if pad.dtype == torch.bool else pad
    if block_t is None and block_f is None and v.stride(1) == 1 and _flat_rows(n_cols, v.stride(0)):
        n_blocks = cdiv(width * n_cols, FLAT_BLOCK)
        _flat_to_padded_kernel[(B * n_blocks,)](v, offsets, pad, o, v.shape[0], width, n_cols, n_blocks,
                                                BLOCK=FLAT_BLOCK)
        return out
    n_row_tiles, n_col_tiles = cdiv(width, bt), cdiv(n_cols, bf)
    _jagged_to_padded_kernel[(B * n_row_tiles * n_col_tiles,)](
        v, offsets, pad, o, v.shape[0], width, n_cols, n_row_tiles, n_col_tiles,
        v.stride(0), v.stride(1), o.stride(1), BLOCK_T=bt, BLOCK_F=bf,
        ROW_ALIGN=row_align(n_cols, v.stride(0), o.stride(1)))
    return out


def _from_padded_triton(padded: torch.Tensor, offsets: torch.Tensor, total: int, max_len: int,
                        *, block_t: int | None = None, block_f: int | None = None) -> torch.Tensor:
    B = offsets.shape[0] - 1
    check_rows("padded", padded, B, "one per sequence of offsets")
    offsets = offsets.contiguous()  # (read at stride 1)
    out = torch.empty((total, *padded.shape[2:]), dtype=padded.dtype, device=padded.device)
    if out.numel() == 0:
        return out
    p = as_columns(padded, 2)
    # The batch stride as a whole number of row (or column) strides; 1-element units otherwise.
    unit = next((st for st in (p.stride(1), p.stride(2)) if st and p.stride(0) % st == 0), 1)
    o = as_columns(out, 1)
    n_cols = o.shape[1]
    if (block_t is None and block_f is None and p.stride(2) == 1 and p.stride(0) == p.shape[1] * n_cols
            and _flat_rows(n_cols, p.stride(1))):
        n_blocks = cdiv(min(max_len, p.shape[1]) * n_cols, FLAT_BLOCK)
        _flat_from_padded_kernel[(B * n_blocks,)](p, offsets, o, total, p.shape[1], n_cols, n_blocks,
                                                  BLOCK=FLAT_BLOCK)
        return out
    bt, bf = copy_tiles(max_len, n_cols, o.element_size(), o.device)
    bt, bf = block_t or bt, block_f or bf
    n_row_tiles, n_col_tiles = cdiv(max_len, bt), cdiv(n_cols, bf)
    _padded_to_jagged_kernel[(B * n_row_tiles * n_col_tiles,)](
        p, offsets, o, total, p.shape[1], n_cols, n_row_tiles, n_col_tiles,
        p.stride(0) // unit, unit, p.stride(1), p.stride(2), o.stride(0), BLOCK_T=bt, BLOCK_F=bf,
        ROW_ALIGN=row_align(n_cols, unit, p.stride(1), o.stride(0)))
    return out


def _to_padded_torch(values, offsets, width, padding_value):
    seq, pos = row_positions(offsets, values.shape[0], width)
    out = values.new_full((offsets.shape[0] - 1, width, *values.shape[1:]), padding_value)
    out[seq, pos] = values
    return out


def _from_padded_torch(padded, offsets, total):
    seq, pos = row_positions(offsets, total, padded.shape[1])
    return padded[seq, pos]


def copy_backend(t: torch.Tensor, requested: str | None = None) -> str:
    """The backend of a kernel that only moves ``t``'s elements (the ``copy`` family)."""
    return capabilities.resolve(t.device, t.dtype, "copy", requested)


# ------------------------------------------------------------------------------------ custom ops
# torch.compile sees each direction as one opaque op (whatever the backend launches inside), with its
# output shape from the fake implementation; the host ints stay symbolic, so new lengths don't recompile.
# Eager calls run the implementations directly (varlen._backend.through_custom_op).
def _to_padded(values: Tensor, offsets: Tensor, width: int, padding_value: Number, backend: str) -> Tensor:
    if backend == "triton":
        return _to_padded_triton(values, offsets, width, padding_value)
    return _to_padded_torch(values, offsets, width, padding_value)


def _from_padded(padded: Tensor, offsets: Tensor, total: int, max_len: int, backend: str) -> Tensor:
    if backend == "triton":
        return _from_padded_triton(padded, offsets, total, max_len)
    return _from_padded_torch(padded, offsets, total)


_to_padded_op = torch.library.custom_op("varlen::jagged_to_padded", _to_padded, mutates_args=())
_from_padded_op = torch.library.custom_op("varlen::padded_to_jagged", _from_padded, mutates_args=())


@_to_padded_op.register_fake
def _(values, offsets, width, padding_value, backend):
    return values.new_empty((offsets.shape[0] - 1, width, *values.shape[1:]))


@_from_padded_op.register_fake
def _(padded, offsets, total, max_len, backend):
    return padded.new_empty((total, *padded.shape[2:]))


def _run_to_padded(values: Tensor, offsets: Tensor, width: int, padding_value: Number, backend: str) -> Tensor:
    to_padded = _to_padded_op if through_custom_op() else _to_padded
    return to_padded(values, offsets, width, padding_value, backend)


def _run_from_padded(padded: Tensor, offsets: Tensor, total: int, max_len: int, backend: str) -> Tensor:
    from_padded = _from_padded_op if through_custom_op() else _from_padded
    return from_padded(padded, offsets, total, max_len, backend)


# -------------------------------------------------------------------------------------- autograd
class _JaggedToPadded(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, offsets, width, padding_value, backend):
        ctx.save_for_backward(offsets)
        ctx.total = values.shape[0]
        ctx.backend = backend
        return _run_to_padded(values, offsets, width, padding_value, backend)

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        # Rows past a sequence's end are padding: their gradient is dropped.
        width = grad.shape[1]
        dx = gradient_op(_PaddedToJagged, _run_from_padded, grad, offsets, ctx.total, width, ctx.backend)
        return dx, None, None, None, None


class _PaddedToJagged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, padded, offsets, total, max_len, backend):
        ctx.save_for_backward(offsets)
        ctx.width = padded.shape[1]
        ctx.backend = backend
        return _run_from_padded(padded, offsets, total, max_len, backend)

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        dpadded = gradient_op(_JaggedToPadded, _run_to_padded, grad, offsets, ctx.width, 0.0, ctx.backend)
        return dpadded, None, None, None, None


# ---------------------------------------------------------------------------------------- public
def jagged_to_padded(values: torch.Tensor, offsets: torch.Tensor, width: int,
                     padding_value: float = 0.0) -> torch.Tensor:
    """``(B, width, *inner)`` from jagged ``values``/``offsets``; ``width`` >= the longest length.

    Positions past a sequence's end hold ``padding_value``. Differentiable (the backward gathers
    the gradient of the valid positions). ``offsets`` are trusted (validated by JaggedTensor).
    """
    return _JaggedToPadded.apply(values, offsets, width, padding_value, copy_backend(values))


def padded_to_jagged(padded: torch.Tensor, offsets: torch.Tensor, total: int, max_len: int) -> torch.Tensor:
    """``(total, *inner)`` values: the first ``L_b`` rows of each ``padded[b]``.

    ``total`` is ``offsets[-1]`` and ``max_len`` the longest length (<= ``padded.shape[1]``), both
    host ints so no launch waits on the device. Differentiable (the backward pads with zeros).
    """
    return _PaddedToJagged.apply(padded, offsets, total, max_len, copy_backend(padded))


def to_padded_values(values: torch.Tensor, offsets: torch.Tensor, width: int,
                     padding_value: float = 0.0) -> torch.Tensor:
    """:func:`jagged_to_padded` without autograd, for code that runs inside an autograd Function or a custom
    op already (the torch backend of the per-sequence matmuls): no Function to apply, no host time for it."""
    return _run_to_padded(values, offsets, width, padding_value, copy_backend(values))


def from_padded_values(padded: torch.Tensor, offsets: torch.Tensor, total: int, max_len: int) -> torch.Tensor:
    """:func:`padded_to_jagged` without autograd, for the same callers as :func:`to_padded_values`."""
    return _run_from_padded(padded, offsets, total, max_len, copy_backend(padded))
