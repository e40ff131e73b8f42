"""How the jagged-op kernels tile their work: column views, tile sizes, the SM count, splitting long
sequences, and the jit helpers that map a program to its sequence; and the integer helpers of every launcher.

Offsets are trusted on the GPU (checking them takes a device-to-host copy; see ``varlen.set_checks``), so
the kernels never index with them unchecked: :func:`sequence_rows` clamps a sequence's rows into the
buffer, so that offsets which overrun ``total`` or decrease give short or empty sequences, never an access
outside the tensors.
"""

from __future__ import annotations

import functools
import math

import torch

from ._triton import tl, triton


# ------------------------------------------------------------------------------ launch helpers
# Plain Python for the launchers' integer arithmetic: triton.cdiv and triton.next_power_of_2 are JIT-callable
# wrappers, about 2 us per host call (25x a plain one; more on a slow host), which small calls feel.
def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def as_columns(t: torch.Tensor, lead: int) -> torch.Tensor:
    """``t`` as ``(*t.shape[:lead], F)``, F the product of the other dims: a view when the inner dims
    can be flattened without a copy. ``bool`` is viewed as ``uint8`` (Triton loads bytes)."""
    flat = t.reshape(*t.shape[:lead], math.prod(t.shape[lead:]))
    return flat.view(torch.uint8) if flat.dtype == torch.bool else flat


def last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dim has stride 1 (what the kernels walk), else a contiguous copy (a backward's
    gradient may be expanded or transposed)."""
    return t if t.stride(-1) == 1 else t.contiguous()


# Elements a kernel loads at once from a row are at most 16 (Triton vectorizes up to 16 bytes, 8 16-bit elements).
MAX_ROW_ALIGN = 16


def row_align(n_cols: int, *row_strides: int) -> int:
    """The largest power of two, at most :data:`MAX_ROW_ALIGN`, dividing ``n_cols`` and each row stride (in elements):
    a kernel's ``ROW_ALIGN``, which it applies to those numbers through :func:`known_multiple`. Triton only learns
    that an integer argument is a multiple of 16; rows of 40 columns are 8 apart, which this lets a kernel use to
    load 8 of a row's elements at once (16 bytes in 16-bit) rather than one."""
    common = n_cols
    for stride in row_strides:
        common = math.gcd(common, stride)
    return min(MAX_ROW_ALIGN, common & -common) if common else MAX_ROW_ALIGN


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


# Rows of a copy-like tile at most. Narrow rows (1-2 columns) would otherwise take tiles of up to 8,192 rows, one
# program per sequence of thousands of rows. H200, 4,096-row sequences, % of copy, before / after: to_padded bf16
# 40 / 74 (1 column), 47 / 78 (2), float32 68 / 91; from_padded bf16 46 / 69; the broadcast rows of a sum's backward
# bf16 54 / 44, float32 74 / 76. Shorter sequences keep their tiles (bench/NOTES.md, "Kernel variants per batch").
# The cap also bounds the tile variants a stream of batches compiles (one per power of two of n_rows below it).
COPY_MAX_ROWS = 1024


def copy_tiles(n_rows: int, n_cols: int, elem_size: int, device: torch.device) -> tuple[int, int]:
    """(rows, columns) of the tile one program of a copy-like kernel moves.

    On a GPU: up to 512 contiguous bytes of a row (coalesced 16-byte vectors), ~16 KB per tile and at most
    :data:`COPY_MAX_ROWS` rows; fewer rows where ``n_rows`` (the longest sequence, or the batch) is shorter: a tile of
    mostly masked rows ran 2-4x slower at sequences of 16 rows. Under the interpreter the cost is per program, so tiles
    are as large as the input allows.
    """
    if device.type == "cuda":
        block_f = min(next_power_of_2(n_cols), max(1, 512 // elem_size))
        block_t = min(next_power_of_2(max(n_rows, 1)), max(1, 16384 // (block_f * elem_size)), COPY_MAX_ROWS)
    else:
        block_f = min(next_power_of_2(n_cols), 1024)
        block_t = min(next_power_of_2(max(n_rows, 1)), max(1, 65536 // block_f))
    return block_t, block_f


def chunk_rows_for(max_len: int, programs_per_chunk: int, block_t: int, device: torch.device, *,
                   waves: int = 4, min_tiles: int = 4, max_rows: int | None = None) -> int:
    """Rows of a sequence that one program reduces, a multiple of ``block_t``.

    Long sequences are split into chunks reduced by separate programs (partials combined afterwards),
    so that a batch of a few long sequences still gives ``waves`` programs per SM, and, with
    ``max_rows``, so that no program runs much longer than the others (a long tail leaves SMs idle).
    A chunk is at least ``min_tiles`` tiles long. Off the GPU a sequence is one chunk.
    """
    whole = max(block_t, cdiv(max_len, block_t) * block_t)
    if device.type != "cuda":
        return whole
    n_chunks = cdiv(waves * sm_count(device), max(programs_per_chunk, 1))
    rows = cdiv(cdiv(max_len, n_chunks), block_t) * block_t
    if max_rows is not None:
        rows = min(rows, max_rows // block_t * block_t)
    return min(whole, max(rows, min_tiles * block_t))


# ---------------------------------------------------------------------------------- jit helpers
@triton.jit
def known_multiple(n, ALIGN: tl.constexpr):
    """``n``, which the host says is a multiple of ``ALIGN`` (:func:`row_align`), written ``(n // ALIGN) * ALIGN``
    so that Triton's divisibility analysis knows it too and vectorizes the loads and stores of rows ``n`` elements
    apart (``tl.multiple_of`` is dropped on a kernel's arguments in Triton 3.6). At 16 Triton's own specialization of
    the argument already says so."""
    if ALIGN > 1 and ALIGN < 16:
        n = (n // ALIGN) * ALIGN
    return n


@triton.jit
def sequence_rows(offsets, b, total):
    """(first row, length) of sequence b, int64, clamped into the buffer's rows ``[0, total)``."""
    start = tl.minimum(tl.maximum(tl.load(offsets + b).to(tl.int64), 0), total)
    end = tl.minimum(tl.maximum(tl.load(offsets + b + 1).to(tl.int64), start), total)
    return start, end - start


@triton.jit
def tile_coords(pid, n_row_tiles, n_col_tiles, offsets, total):
    """Program ``pid`` of a (sequence, row tile, column tile) grid, column tiles fastest: the sequence
    b, the row and column tiles, and the sequence's first row and length (:func:`sequence_rows`)."""
    col_tile = pid % n_col_tiles
    b = pid // n_col_tiles // n_row_tiles
    row_tile = pid // n_col_tiles % n_row_tiles
    start, length = sequence_rows(offsets, b, total)
    return b, row_tile, col_tile, start, length


@triton.jit
def chunk_coords(pid, n_chunks, n_col_tiles, offsets, chunk_rows, total):
    """Program ``pid`` of a (sequence, chunk, column tile) grid, column tiles fastest.

    Returns the sequence b, the flat (b, chunk) index, the column tile, the sequence's first row and
    length (:func:`sequence_rows`), and the chunk's rows ``[lo, hi)`` inside the sequence (empty when
    ``lo >= length``).
    """
    col_tile = pid % n_col_tiles
    b_chunk = pid // n_col_tiles
    b = b_chunk // n_chunks
    start, length = sequence_rows(offsets, b, total)
    lo = (b_chunk % n_chunks).to(tl.int64) * chunk_rows
    hi = tl.minimum(lo + chunk_rows, length)
    return b, b_chunk, col_tile, start, length, lo, hi
