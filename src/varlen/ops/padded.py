"""Conversion between jagged ``values`` and a padded ``(B, max_len, *inner)`` tensor.

Each direction is the other's backward (so double backward works too). One launch for the whole
batch on either path. The Triton kernels see the inner dims flattened into F contiguous columns and
tile the work as (sequence, block of rows, block of columns), columns fastest, so that neighbouring
programs touch neighbouring memory.

This module also holds the small launch helpers the other jagged-op kernels share (column views,
tile sizes, SM count, splitting long sequences); they carry no autograd.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.types import Number

from .. import _backend
from ..jagged import segment_ids

# Element types the copy kernels (padded conversion, select) move; others take the PyTorch path.
COPY_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.int16,
               torch.int32, torch.int64, torch.uint8, torch.bool)


# ------------------------------------------------------------------------------ launch helpers
def as_columns(t: torch.Tensor, lead: int) -> torch.Tensor:
    """``t`` as ``(*t.shape[:lead], F)``, F the product of the other dims: a view when the inner dims
    can be flattened without a copy. ``bool`` is viewed as ``uint8`` (Triton loads bytes)."""
    flat = t.reshape(*t.shape[:lead], math.prod(t.shape[lead:]))
    return flat.view(torch.uint8) if flat.dtype == torch.bool else flat


def acc_type(dtype: torch.dtype):
    """The Triton type to accumulate in: float64 for float64 inputs, else float32."""
    return tl.float64 if dtype == torch.float64 else tl.float32


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 1 elsewhere (the interpreter runs one at a time)."""
    if device.type != "cuda":
        return 1
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def copy_tiles(n_rows: int, n_cols: int, elem_size: int, device: torch.device) -> tuple[int, int]:
    """(rows, columns) of the tile one program of a copy-like kernel moves.

    On a GPU: up to 512 contiguous bytes of a row (coalesced 16-byte vectors) and ~16 KB per tile. Under
    the interpreter the cost is per program, so tiles are as large as the input allows.
    """
    if device.type == "cuda":
        block_f = min(triton.next_power_of_2(n_cols), max(1, 512 // elem_size))
        block_t = min(triton.next_power_of_2(max(n_rows, 1)), max(1, 16384 // (block_f * elem_size)))
    else:
        block_f = min(triton.next_power_of_2(n_cols), 1024)
        block_t = min(triton.next_power_of_2(max(n_rows, 1)), max(1, 65536 // block_f))
    return block_t, block_f


def chunk_rows_for(max_len: int, programs_per_chunk: int, block_t: int, device: torch.device, *,
                   waves: int = 4, min_tiles: int = 4, max_rows: int | None = None) -> int:
    """Rows of a sequence that one program reduces, a multiple of ``block_t``.

    Long sequences are split into chunks reduced by separate programs (partials combined afterwards),
    so that a batch of a few long sequences still gives ``waves`` programs per SM, and, with
    ``max_rows``, so that no program runs much longer than the others (a long tail leaves SMs idle).
    A chunk is at least ``min_tiles`` tiles long. Off the GPU a sequence is one chunk.
    """
    whole = max(block_t, triton.cdiv(max_len, block_t) * block_t)
    if device.type != "cuda":
        return whole
    n_chunks = triton.cdiv(waves * sm_count(device), max(programs_per_chunk, 1))
    rows = triton.cdiv(triton.cdiv(max_len, n_chunks), block_t) * block_t
    if max_rows is not None:
        rows = min(rows, max_rows // block_t * block_t)
    return min(whole, max(rows, min_tiles * block_t))


# ------------------------------------------------------------------------------------ kernels
@triton.jit
def tile_coords(pid, n_row_tiles, n_col_tiles, offsets):
    """Program ``pid`` of a (sequence, row tile, column tile) grid, column tiles fastest: the sequence
    b, the row and column tiles, and the sequence's first row and length (int64)."""
    col_tile = pid % n_col_tiles
    b = pid // n_col_tiles // n_row_tiles
    row_tile = pid // n_col_tiles % n_row_tiles
    start = tl.load(offsets + b).to(tl.int64)
    length = tl.load(offsets + b + 1).to(tl.int64) - start
    return b, row_tile, col_tile, start, length


@triton.jit
def chunk_coords(pid, n_chunks, n_col_tiles, offsets, chunk_rows):
    """Program ``pid`` of a (sequence, chunk, column tile) grid, column tiles fastest.

    Returns the sequence b, the flat (b, chunk) index, the column tile, the sequence's first row and
    length, and the chunk's rows ``[lo, hi)`` inside the sequence (empty when ``lo >= length``).
    """
    col_tile = pid % n_col_tiles
    b_chunk = pid // n_col_tiles
    b = b_chunk // n_chunks
    start = tl.load(offsets + b).to(tl.int64)
    length = tl.load(offsets + b + 1).to(tl.int64) - start
    lo = (b_chunk % n_chunks).to(tl.int64) * chunk_rows
    hi = tl.minimum(lo + chunk_rows, length)
    return b, b_chunk, col_tile, start, length, lo, hi


# The padded width and the tile counts change with every batch: Triton must not specialize on them (a new
# kernel variant per batch). The padded side's batch stride is passed as a number of rows, so that its
# alignment (known from the row stride, a model constant) survives.
@triton.jit(do_not_specialize=["width", "n_row_tiles"])
def _jagged_to_padded_kernel(values, offsets, pad, out, width, n_cols, n_row_tiles, n_col_tiles,
                             stride_vr, stride_vc, stride_or,
                             BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr):
    # One program per (sequence, block of padded rows, block of columns); every padded row is written.
    # out is a contiguous (B, width, n_cols) tensor.
    b, row_tile, col_tile, start, length = tile_coords(tl.program_id(0), n_row_tiles, n_col_tiles, offsets)
    rows = row_tile * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    cols = col_tile * BLOCK_F + tl.arange(0, BLOCK_F).to(tl.int64)
    col_ok = (cols < n_cols)[None, :]
    in_seq = (rows < length)[:, None] & col_ok
    x = tl.load(values + (start + rows)[:, None] * stride_vr + cols[None, :] * stride_vc, mask=in_seq)
    x = tl.where(in_seq, x, tl.load(pad))
    dst = out + (b.to(tl.int64) * width + rows[:, None]) * stride_or + cols[None, :]
    tl.store(dst, x, mask=(rows < width)[:, None] & col_ok)


@triton.jit(do_not_specialize=["n_row_tiles", "rows_per_batch"])
def _padded_to_jagged_kernel(padded, offsets, out, n_cols, n_row_tiles, n_col_tiles,
                             rows_per_batch, stride_pr, stride_pc, stride_or,
                             BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr):
    # One program per (sequence, block of rows up to max_len, block of columns); blocks past the
    # sequence's end have nothing to copy and return at once.
    b, row_tile, col_tile, start, length = tile_coords(tl.program_id(0), n_row_tiles, n_col_tiles, offsets)
    if row_tile * BLOCK_T >= length:
        return
    rows = row_tile * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    cols = col_tile * BLOCK_F + tl.arange(0, BLOCK_F).to(tl.int64)
    mask = (rows < length)[:, None] & (cols < n_cols)[None, :]
    src = padded + (b.to(tl.int64) * rows_per_batch + rows[:, None]) * stride_pr + cols[None, :] * stride_pc
    x = tl.load(src, mask=mask)
    tl.store(out + (start + rows)[:, None] * stride_or + cols[None, :], x, mask=mask)


# ----------------------------------------------------------------------------------- launchers
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
    bt, bf = copy_tiles(width, n_cols, v.element_size(), v.device)
    bt, bf = block_t or bt, block_f or bf
    pad = torch.full((), padding_value, dtype=values.dtype, device=values.device)
    pad = pad.view(torch.uint8) if pad.dtype == torch.bool else pad
    n_row_tiles, n_col_tiles = triton.cdiv(width, bt), triton.cdiv(n_cols, bf)
    _jagged_to_padded_kernel[(B * n_row_tiles * n_col_tiles,)](
        v, offsets, pad, o, width, n_cols, n_row_tiles, n_col_tiles,
        v.stride(0), v.stride(1), o.stride(1), BLOCK_T=bt, BLOCK_F=bf)
    return out


def _from_padded_triton(padded: torch.Tensor, offsets: torch.Tensor, total: int, max_len: int,
                        *, block_t: int | None = None, block_f: int | None = None) -> torch.Tensor:
    B = offsets.shape[0] - 1
    out = torch.empty((total, *padded.shape[2:]), dtype=padded.dtype, device=padded.device)
    if out.numel() == 0:
        return out
    p = as_columns(padded, 2)
    if p.stride(1) == 0 or p.stride(0) % p.stride(1):
        p = p.contiguous()  # the kernel takes the batch stride as a whole number of rows
    o = as_columns(out, 1)
    n_cols = o.shape[1]
    bt, bf = copy_tiles(max_len, n_cols, o.element_size(), o.device)
    bt, bf = block_t or bt, block_f or bf
    n_row_tiles, n_col_tiles = triton.cdiv(max_len, bt), triton.cdiv(n_cols, bf)
    _padded_to_jagged_kernel[(B * n_row_tiles * n_col_tiles,)](
        p, offsets, o, n_cols, n_row_tiles, n_col_tiles,
        p.stride(0) // p.stride(1), p.stride(1), p.stride(2), o.stride(0), BLOCK_T=bt, BLOCK_F=bf)
    return out


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


def copy_backend(t: torch.Tensor) -> str:
    """The backend for a kernel that only moves elements: Triton when it runs here and the dtype is
    one it moves (see ``COPY_DTYPES``), else PyTorch."""
    backend = _backend.resolve(t.device)
    return backend if t.dtype in COPY_DTYPES else "torch"


# ------------------------------------------------------------------------------------ custom ops
# torch.compile sees each direction as one opaque op (whatever the backend launches inside), with its
# output shape from the fake implementation; the host ints stay symbolic, so new lengths don't recompile.
@torch.library.custom_op("varlen::jagged_to_padded", mutates_args=())
def _to_padded_op(values: Tensor, offsets: Tensor, width: int, padding_value: Number, backend: str) -> Tensor:
    if backend == "triton":
        return _to_padded_triton(values, offsets, width, padding_value)
    return _to_padded_torch(values, offsets, width, padding_value)


@_to_padded_op.register_fake
def _(values, offsets, width, padding_value, backend):
    return values.new_empty((offsets.shape[0] - 1, width, *values.shape[1:]))


@torch.library.custom_op("varlen::padded_to_jagged", mutates_args=())
def _from_padded_op(padded: Tensor, offsets: Tensor, total: int, max_len: int, backend: str) -> Tensor:
    if backend == "triton":
        return _from_padded_triton(padded, offsets, total, max_len)
    return _from_padded_torch(padded, offsets, total)


@_from_padded_op.register_fake
def _(padded, offsets, total, max_len, backend):
    return padded.new_empty((total, *padded.shape[2:]))


# -------------------------------------------------------------------------------------- autograd
class _JaggedToPadded(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, offsets, width, padding_value, backend):
        ctx.save_for_backward(offsets)
        ctx.total = values.shape[0]
        ctx.backend = backend
        return _to_padded_op(values, offsets, width, padding_value, backend)

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        # Rows past a sequence's end are padding: their gradient is dropped.
        width = grad.shape[1]
        return _PaddedToJagged.apply(grad, offsets, ctx.total, width, ctx.backend), None, None, None, None


class _PaddedToJagged(torch.autograd.Function):
    @staticmethod
    def forward(ctx, padded, offsets, total, max_len, backend):
        ctx.save_for_backward(offsets)
        ctx.width = padded.shape[1]
        ctx.backend = backend
        return _from_padded_op(padded, offsets, total, max_len, backend)

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        return _JaggedToPadded.apply(grad, offsets, ctx.width, 0.0, ctx.backend), None, None, None, None


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
