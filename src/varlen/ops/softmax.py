"""Softmax of a jagged tensor over its ragged dim (each sequence's positions) or over an inner dim.

Over the ragged dim, for each sequence b and each inner index f independently:
``y[t, f] = exp(x[t, f] - max_t x) / sum_t exp(x[t, f] - max_t x)`` over the positions t of b; the
backward is ``dx = y * (dy - sum_t dy * y)``. Empty sequences produce nothing.

Triton plan (one launch per step for the whole batch; inner dims flattened to F columns):

* ``single``: when the longest sequence fits one tile (on a GPU, of at most :data:`SINGLE_MAX_ROWS` rows), one
  program per (sequence, column block) loads its whole column block once, reduces and writes: x is read once
  (forward), y and dy once (backward): the minimal traffic.
* ``split``: otherwise each sequence is cut into chunks of rows. A first kernel reduces each
  (sequence, chunk, column block) to partial statistics (online max and sum of exponentials;
  ``sum dy * y`` in backward); a second combines the partials of its sequence and writes its chunk.
  The input is read twice, so this path can reach at most 2/3 (forward) or 3/5 (backward) of copy
  bandwidth; the second kernel runs its programs in reverse order so its first reads hit the chunks
  still in L2. Chunks are sized so that a few long sequences still fill every SM.
* ``cooperative`` (GPU only, sequences of at most :func:`cooperative_max_chunks` chunks): one program
  per (sequence, chunk of rows, column block) reduces its chunk, publishes the chunk's statistics, waits
  until every chunk of its (sequence, column block) has published, combines them in chunk order and
  writes its chunk. On sm_90, fp16, bf16 and float32 inputs of more than 32 columns (contiguous rows, TMA-aligned;
  the 16-bit backward from 64 columns) hold the chunk in shared memory, forward and backward, in blocks of 128 or 256
  bytes of a row (``_softmax_gluon``: TMA loads, Gluon kernels; :data:`SHARED_TIERS`). Elsewhere every backward, and
  the 32- and 64-bit forward of 32 or more columns or of one float32 column, hold the chunk in registers (one tile;
  16-bit inputs as their own 16-bit values), so each input is read once, as ``single``; the 16-bit forward reads its
  chunk again for the write, moments after the first read (held in registers, it ran slower than split), as does the
  32- and 64-bit forward of 2-16 columns (one float64 column): see :func:`_cooperative_plan`.
  Programs take their chunks in the order they start (a claim counter), a sequence's chunks one after
  another, so the chunks a program waits for are held by programs already running or about to start; it
  never waits for one that can't start while the GPU holds at least as many programs as a sequence has
  chunks (the bound). The interpreter runs programs one at a time, where a wait never ends: it takes
  ``split`` instead.

Over an inner dim, each row of ``values`` is independent: ``torch.softmax`` on ``values``, with its
own fused backward.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .. import _amp, capabilities
from .._backend import interpreter_enabled, refuse_double_backward, through_custom_op
from .._checks import FLOAT_DTYPES, accumulate_dtype, check_dtype, normalize_dim
from .._kernel_math import add_to_max_sum, exp, lowest_like, merge_max_sum, reduce_max_sum
from .._launch import fast_launch
from .._triton import tl, triton
from ..jagged import JaggedTensor, as_jagged
from ..offsets import segment_ids
from ..tiling import (
    acc_type,
    as_columns,
    cdiv,
    chunk_coords,
    chunk_rows_for,
    known_multiple,
    last_dim_contiguous,
    next_power_of_2,
    row_align,
    sequence_rows,
    sm_count,
)
from . import _softmax_gluon
from ._cooperative import claim_chunk, share_max_sum, wait_for_group


# ------------------------------------------------------------------------------------ kernels
@fast_launch
@triton.jit(do_not_specialize=["total"])
def _softmax_single_kernel(x, y, offsets, total, n_cols, n_col_tiles, stride_xr, stride_xc, stride_yr,
                           ACC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, ROW_ALIGN: tl.constexpr):
    # The whole sequence (length <= BLOCK_T) in one tile: one read of x, one write of y.
    n_cols = known_multiple(n_cols, ROW_ALIGN)
    stride_xr = known_multiple(stride_xr, ROW_ALIGN)
    stride_yr = known_multiple(stride_yr, ROW_ALIGN)
    col_tile = tl.program_id(0) % n_col_tiles
    b = tl.program_id(0) // n_col_tiles
    start, length = sequence_rows(offsets, b, total)
    rows = tl.arange(0, BLOCK_T).to(tl.int64)
    cols = col_tile * BLOCK_F + tl.arange(0, BLOCK_F).to(tl.int64)
    mask = (rows < length)[:, None] & (cols < n_cols)[None, :]
    v = tl.load(x + (start + rows)[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask,
                other=float("-inf")).to(ACC)
    m = tl.max(v, 0)
    # A column with no finite max (empty, or all -inf) shifts by 0 so exp never sees -inf - -inf.
    m = tl.where(m == float("-inf"), 0.0, m)
    e = exp(v - m[None, :])
    out = e * (1.0 / tl.sum(e, 0))[None, :]  # one division per column, not per element
    tl.store(y + (start + rows)[:, None] * stride_yr + cols[None, :], out.to(y.dtype.element_ty), mask=mask)


@triton.jit
def _chunk_stats(x, start, lo, hi, cols, col_ok, stride_xr, stride_xc,
                 ACC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, STAGES: tl.constexpr = None):
    """Per column, the max and the sum of exp(x - max) over rows ``[lo, hi)`` of the sequence starting at row
    ``start``, by online max and sum. Each (row, column) slot of the tile keeps its own running max and sum,
    so the loop does no cross-thread reduction (a reduction over rows crosses warps: shared memory and a
    barrier per tile); the rows are combined once, after it. ``STAGES``: tiles loaded ahead by Triton's software
    pipelining (None: the loop isn't pipelined)."""
    s_slot = tl.zeros([BLOCK_T, BLOCK_F], ACC)
    m_slot = lowest_like(s_slot)
    for t0 in tl.range(lo, hi, BLOCK_T, num_stages=STAGES):
        rows = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        mask = (rows < hi)[:, None] & col_ok[None, :]
        v = tl.load(x + (start + rows)[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask,
                    other=float("-inf")).to(ACC)
        m_slot, s_slot = add_to_max_sum(m_slot, s_slot, v)
    return reduce_max_sum(m_slot, s_slot)


@triton.jit
def _write_tile(x, y, start, t0, hi, cols, col_ok, shift, inv_s, stride_xr, stride_xc, stride_yr,
                ACC: tl.constexpr, BLOCK_T: tl.constexpr):
    """y = exp(x - shift) * inv_s over rows ``[t0, t0 + BLOCK_T)`` (below ``hi``) of the sequence at ``start``."""
    rows = t0 + tl.arange(0, BLOCK_T).to(tl.int64)
    mask = (rows < hi)[:, None] & col_ok[None, :]
    v = tl.load(x + (start + rows)[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask,
                other=float("-inf")).to(ACC)
    out = exp(v - shift[None, :]) * inv_s[None, :]
    tl.store(y + (start + rows)[:, None] * stride_yr + cols[None, :], out.to(y.dtype.element_ty), mask=mask)


@triton.jit
def _write_chunk(x, y, start, lo, hi, cols, col_ok, m, s, stride_xr, stride_xc, stride_yr,
                 ACC: tl.constexpr, BLOCK_T: tl.constexpr, STAGES: tl.constexpr = None,
                 REVERSE: tl.constexpr = False):
    """y = exp(x - m) / s over rows ``[lo, hi)`` of the sequence starting at row ``start``, from the
    sequence's max ``m`` and sum ``s`` per column; ``STAGES`` as :func:`_chunk_stats`'s. ``REVERSE``: the last
    tile first (a chunk read moments ago: its last tiles are the likeliest still in L2)."""
    shift = tl.where(m == float("-inf"), 0.0, m)
    inv_s = 1.0 / s  # one division per column, not per element
    if REVERSE:
        n_tiles = tl.cdiv(hi - lo, BLOCK_T)
        for i in tl.range(0, n_tiles, num_stages=STAGES):
            _write_tile(x, y, start, lo + (n_tiles - 1 - i) * BLOCK_T, hi, cols, col_ok, shift, inv_s, stride_xr,
                        stride_xc, stride_yr, ACC, BLOCK_T)
    else:
        for t0 in tl.range(lo, hi, BLOCK_T, num_stages=STAGES):
            _write_tile(x, y, start, t0, hi, cols, col_ok, shift, inv_s, stride_xr, stride_xc, stride_yr, ACC,
                        BLOCK_T)


@fast_launch
@triton.jit(do_not_specialize=["total", "n_chunks", "chunk_rows"])
def _softmax_stats_kernel(x, offsets, total, part_max, part_sum, n_cols, n_chunks, chunk_rows, n_col_tiles,
                          stride_xr, stride_xc,
                          ACC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, ROW_ALIGN: tl.constexpr):
    # The statistics of one chunk of one sequence, per column.
    n_cols = known_multiple(n_cols, ROW_ALIGN)
    stride_xr = known_multiple(stride_xr, ROW_ALIGN)
    b, b_chunk, col_tile, start, length, lo, hi = chunk_coords(
        tl.program_id(0), n_chunks, n_col_tiles, offsets, chunk_rows, total)
    if lo >= length:
        return
    cols = col_tile * BLOCK_F + tl.arange(0, BLOCK_F).to(tl.int64)
    col_ok = cols < n_cols
    m, s = _chunk_stats(x, start, lo, hi, cols, col_ok, stride_xr, stride_xc, ACC, BLOCK_T, BLOCK_F)
    idx = b_chunk.to(tl.int64) * n_cols + cols
    tl.store(part_max + idx, m, mask=col_ok)
    tl.store(part_sum + idx, s, mask=col_ok)


@fast_launch
@triton.jit(do_not_specialize=["total", "n_chunks", "chunk_rows", "n_programs"])
def _softmax_write_kernel(x, y, offsets, total, part_max, part_sum, n_cols, n_chunks, chunk_rows, n_col_tiles,
                          n_programs, stride_xr, stride_xc, stride_yr,
                          ACC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, ROW_ALIGN: tl.constexpr):
    # Reverse order: the stats kernel's last chunks are the ones still in L2.
    n_cols = known_multiple(n_cols, ROW_ALIGN)
    stride_xr = known_multiple(stride_xr, ROW_ALIGN)
    stride_yr = known_multiple(stride_yr, ROW_ALIGN)
    pid = n_programs - 1 - tl.program_id(0)
    b, b_chunk, col_tile, start, length, lo, hi = chunk_coords(
        pid, n_chunks, n_col_tiles, offsets, chunk_rows, total)
    if lo >= length:
        return
    cols = col_tile * BLOCK_F + tl.arange(0, BLOCK_F).to(tl.int64)
    col_ok = cols < n_cols
    m = tl.full([BLOCK_F], float("-inf"), ACC)
    s = tl.zeros([BLOCK_F], ACC)
    first = b.to(tl.int64) * n_chunks
    # A sequence longer than the host's max_len (wrong offsets) has no partials past its n_chunks.
    for c in range(0, tl.minimum(tl.cdiv(length, chunk_rows), n_chunks)):
        idx = (first + c) * n_cols + cols
        m_c = tl.load(part_max + idx, mask=col_ok, other=float("-inf"))
        s_c = tl.load(part_sum + idx, mask=col_ok, other=0.0)
        m, s = merge_max_sum(m, s, m_c, s_c)
    _write_chunk(x, y, start, lo, hi, cols, col_ok, m, s, stride_xr, stride_xc, stride_yr, ACC, BLOCK_T)


@fast_launch
@triton.jit(do_not_specialize=["total", "n_chunks"])
def _softmax_cooperative_kernel(x, y, offsets, total, part_max, part_sum, tickets, n_cols, n_chunks, n_col_tiles,
                                stride_xr, stride_xc, stride_yr,
                                ACC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
                                ROW_ALIGN: tl.constexpr, SLICE: tl.constexpr):
    # One tile of rows in registers, as exponentials from the tile's own max: their sum per column and that max
    # go to the partials, the sequence's are combined from all of them (in tile order: every tile gets the
    # same), then the tile is rescaled per column and written. x is read once and each element takes one exp
    # (taking exp(x - max) again after the wait made the 16-bit tile bound by the exp unit).
    n_cols = known_multiple(n_cols, ROW_ALIGN)
    stride_xr = known_multiple(stride_xr, ROW_ALIGN)
    stride_yr = known_multiple(stride_yr, ROW_ALIGN)
    b, col_tile, group, chunk, start, length, n_live = claim_chunk(tickets, offsets, total, n_chunks,
                                                                   n_col_tiles, BLOCK_T)
    if chunk >= n_live:
        return
    rows = chunk.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    cols = col_tile * BLOCK_F + tl.arange(0, BLOCK_F).to(tl.int64)
    col_ok = cols < n_cols
    mask = (rows < length)[:, None] & col_ok[None, :]
    v = tl.load(x + (start + rows)[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask,
                other=float("-inf")).to(ACC)
    m = tl.max(v, 0)
    # A column with no finite max (all -inf) shifts by 0 so exp never sees -inf - -inf.
    shift = tl.where(m == float("-inf"), 0.0, m)
    p = exp(v - shift[None, :])
    m_all, s = share_max_sum(m, tl.sum(p, 0), part_max, part_sum, tickets, b, chunk, group, n_chunks, n_live, n_cols,
                             cols, col_ok, tl.arange(0, SLICE))
    # exp(x - max) = p * exp(shift - max), one exp and one division per column. A column all -inf in this tile
    # (p = 0) but finite elsewhere gets 0: its factor could overflow. All -inf everywhere keeps 0 * (1 / 0)
    # = NaN, as torch.softmax gives.
    factor = exp(shift - tl.where(m_all == float("-inf"), 0.0, m_all)) / s
    factor = tl.where((m == float("-inf")) & (m_all != float("-inf")), 0.0, factor)
    out = p * factor[None, :]
    tl.store(y + (start + rows)[:, None] * stride_yr + cols[None, :], out.to(y.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit(do_not_specialize=["total", "n_chunks"])
def _softmax_cooperative_reread_kernel(x, y, offsets, total, part_max, part_sum, tickets, n_cols, n_chunks,
                                       n_col_tiles, stride_xr, stride_xc, stride_yr, ACC: tl.constexpr,
                                       CHUNK_ROWS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
                                       ROW_ALIGN: tl.constexpr, SLICE: tl.constexpr, STAGES: tl.constexpr):
    # As _softmax_cooperative_kernel, but the chunk (CHUNK_ROWS rows, in tiles of BLOCK_T) is read twice instead of
    # held: statistics, publish, wait, combine, then the write, which reads the chunk again, last tile first. Meant
    # to find the chunk in L2, it mostly doesn't (H100, ncu: DRAM reads 2.06x the input in order, 1.99x reversed;
    # 256-row chunks 1.1x but slower: bench/NOTES.md). The 16-bit forward: every way of holding its tile ran
    # slower than the split path.
    n_cols = known_multiple(n_cols, ROW_ALIGN)
    stride_xr = known_multiple(stride_xr, ROW_ALIGN)
    stride_yr = known_multiple(stride_yr, ROW_ALIGN)
    b, col_tile, group, chunk, start, length, n_live = claim_chunk(tickets, offsets, total, n_chunks,
                                                                   n_col_tiles, CHUNK_ROWS)
    if chunk >= n_live:
        return
    lo = chunk.to(tl.int64) * CHUNK_ROWS
    hi = tl.minimum(lo + CHUNK_ROWS, length)
    cols = col_tile * BLOCK_F + tl.arange(0, BLOCK_F).to(tl.int64)
    col_ok = cols < n_cols
    m, s = _chunk_stats(x, start, lo, hi, cols, col_ok, stride_xr, stride_xc, ACC, BLOCK_T, BLOCK_F, STAGES)
    m_all, s_all = share_max_sum(m, s, part_max, part_sum, tickets, b, chunk, group, n_chunks, n_live, n_cols, cols,
                                 col_ok, tl.arange(0, SLICE))
    _write_chunk(x, y, start, lo, hi, cols, col_ok, m_all, s_all, stride_xr, stride_xc, stride_yr, ACC, BLOCK_T,
                 STAGES, True)


@fast_launch
@triton.jit(do_not_specialize=["total"])
def _softmax_bwd_single_kernel(y, dy, dx, offsets, total, n_cols, n_col_tiles, stride_yr, stride_dyr, stride_dyc,
                               stride_dxr, ACC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
                               ROW_ALIGN: tl.constexpr):
    n_cols = known_multiple(n_cols, ROW_ALIGN)
    stride_yr = known_multiple(stride_yr, ROW_ALIGN)
    stride_dyr = known_multiple(stride_dyr, ROW_ALIGN)
    stride_dxr = known_multiple(stride_dxr, ROW_ALIGN)
    col_tile = tl.program_id(0) % n_col_tiles
    b = tl.program_id(0) // n_col_tiles
    start, length = sequence_rows(offsets, b, total)
    rows = (start + tl.arange(0, BLOCK_T).to(tl.int64))[:, None]
    cols = (col_tile * BLOCK_F + tl.arange(0, BLOCK_F).to(tl.int64))[None, :]
    mask = (rows < start + length) & (cols < n_cols)
    yv = tl.load(y + rows * stride_yr + cols, mask=mask, other=0.0).to(ACC)
    g = tl.load(dy + rows * stride_dyr + cols * stride_dyc, mask=mask, other=0.0).to(ACC)
    dot = tl.sum(yv * g, 0)
    tl.store(dx + rows * stride_dxr + cols, (yv * (g - dot[None, :])).to(dx.dtype.element_ty), mask=mask)


@fast_launch
@triton.jit(do_not_specialize=["total", "n_chunks", "chunk_rows"])
def _softmax_bwd_dot_kernel(y, dy, offsets, total, part_dot, n_cols, n_chunks, chunk_rows, n_col_tiles,
                            stride_yr, stride_dyr, stride_dyc,
                            ACC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, ROW_ALIGN: tl.constexpr):
    # sum_t y * dy over one chunk of one sequence, per column.
    n_cols = known_multiple(n_cols, ROW_ALIGN)
    stride_yr = known_multiple(stride_yr, ROW_ALIGN)
    stride_dyr = known_multiple(stride_dyr, ROW_ALIGN)
    b, b_chunk, col_tile, start, length, lo, hi = chunk_coords(
        tl.program_id(0), n_chunks, n_col_tiles, offsets, chunk_rows, total)
    if lo >= length:
        return
    cols = (col_tile * BLOCK_F + tl.arange(0, BLOCK_F).to(tl.int64))[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_F], ACC)
    for t0 in range(lo, hi, BLOCK_T):
        rows = (start + t0 + tl.arange(0, BLOCK_T).to(tl.int64))[:, None]
        mask = (rows < start + hi) & (cols < n_cols)
        yv = tl.load(y + rows * stride_yr + cols, mask=mask, other=0.0).to(ACC)
        g = tl.load(dy + rows * stride_dyr + cols * stride_dyc, mask=mask, other=0.0).to(ACC)
        acc += yv * g
    idx = b_chunk.to(tl.int64) * n_cols + cols
    tl.store(part_dot + idx, tl.sum(acc, 0)[None, :], mask=cols < n_cols)


@fast_launch
@triton.jit(do_not_specialize=["total", "n_chunks", "chunk_rows", "n_programs"])
def _softmax_bwd_write_kernel(y, dy, dx, offsets, total, part_dot, n_cols, n_chunks, chunk_rows, n_col_tiles,
                              n_programs, stride_yr, stride_dyr, stride_dyc, stride_dxr,
                              ACC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr, ROW_ALIGN: tl.constexpr):
    n_cols = known_multiple(n_cols, ROW_ALIGN)
    stride_yr = known_multiple(stride_yr, ROW_ALIGN)
    stride_dyr = known_multiple(stride_dyr, ROW_ALIGN)
    stride_dxr = known_multiple(stride_dxr, ROW_ALIGN)
    pid = n_programs - 1 - tl.program_id(0)
    b, b_chunk, col_tile, start, length, lo, hi = chunk_coords(
        pid, n_chunks, n_col_tiles, offsets, chunk_rows, total)
    if lo >= length:
        return
    cols = (col_tile * BLOCK_F + tl.arange(0, BLOCK_F).to(tl.int64))[None, :]
    col_ok = cols < n_cols
    dot = tl.zeros([1, BLOCK_F], ACC)
    first = b.to(tl.int64) * n_chunks
    # A sequence longer than the host's max_len (wrong offsets) has no partials past its n_chunks.
    for c in range(0, tl.minimum(tl.cdiv(length, chunk_rows), n_chunks)):
        dot += tl.load(part_dot + (first + c) * n_cols + cols, mask=col_ok, other=0.0)
    for t0 in range(lo, hi, BLOCK_T):
        rows = (start + t0 + tl.arange(0, BLOCK_T).to(tl.int64))[:, None]
        mask = (rows < start + hi) & col_ok
        yv = tl.load(y + rows * stride_yr + cols, mask=mask, other=0.0).to(ACC)
        g = tl.load(dy + rows * stride_dyr + cols * stride_dyc, mask=mask, other=0.0).to(ACC)
        tl.store(dx + rows * stride_dxr + cols, (yv * (g - dot)).to(dx.dtype.element_ty), mask=mask)


@triton.jit
def _opaque(v):
    """``v`` unchanged, through an instruction the compiler can't see through (a ``mov`` per two 16-bit values): a
    value computed from it later can't be replaced by the same value computed earlier and kept alive. 16-bit values
    only, an even number of them in the tile (PTX: NVIDIA GPUs only)."""
    tl.static_assert(v.dtype.primitive_bitwidth == 16, "_opaque takes 16-bit values")
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [v], dtype=v.dtype, is_pure=False, pack=2)


@fast_launch
@triton.jit(do_not_specialize=["total", "n_chunks"])
def _softmax_bwd_cooperative_kernel(y, dy, dx, offsets, total, part_dot, tickets, n_cols, n_chunks, n_col_tiles,
                                    stride_yr, stride_dyr, stride_dyc, stride_dxr,
                                    ACC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr,
                                    ROW_ALIGN: tl.constexpr, SLICE: tl.constexpr, HOLD_16: tl.constexpr):
    # As _softmax_cooperative_kernel: y and dy of one tile in registers, sum y * dy shared by the sequence's tiles.
    # HOLD_16: 16-bit inputs are held across the wait as their own 16-bit values and converted again after it
    # (through _opaque, else the compiler keeps the float32 values of the first conversion: twice the registers,
    # which spilled 300 bytes at 256-row tiles; H100: 68% -> 78% of copy with 128-row tiles, bench/NOTES.md).
    n_cols = known_multiple(n_cols, ROW_ALIGN)
    stride_yr = known_multiple(stride_yr, ROW_ALIGN)
    stride_dyr = known_multiple(stride_dyr, ROW_ALIGN)
    stride_dxr = known_multiple(stride_dxr, ROW_ALIGN)
    b, col_tile, group, chunk, start, length, n_live = claim_chunk(tickets, offsets, total, n_chunks,
                                                                   n_col_tiles, BLOCK_T)
    if chunk >= n_live:
        return
    rows = (start + chunk.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64))[:, None]
    cols = (col_tile * BLOCK_F + tl.arange(0, BLOCK_F).to(tl.int64))[None, :]
    col_ok = cols < n_cols
    mask = (rows < start + length) & col_ok
    y_held = tl.load(y + rows * stride_yr + cols, mask=mask, other=0.0)
    g_held = tl.load(dy + rows * stride_dyr + cols * stride_dyc, mask=mask, other=0.0)
    first = b.to(tl.int64) * n_chunks
    tl.store(part_dot + (first + chunk) * n_cols + cols, tl.sum(y_held.to(ACC) * g_held.to(ACC), 0)[None, :],
             mask=col_ok)
    wait_for_group(tickets, group, n_live)
    # The partials of SLICE tiles at once, added in tile order (as _cooperative.share_max_sum; the Gluon backward's
    # _cooperative.share_sum in 1-D: this 2-D form, in the tile's own layout, keeps the narrow tiles' registers).
    dot = tl.zeros([1, BLOCK_F], ACC)
    for c0 in range(0, n_live, SLICE):
        c = (c0 + tl.arange(0, SLICE))[:, None]
        dot += tl.sum(tl.load(part_dot + (first + c) * n_cols + cols, mask=(c < n_live) & col_ok, other=0.0,
                              cache_modifier=".cg"), 0)[None, :]
    if HOLD_16:
        y_held = _opaque(y_held)
        g_held = _opaque(g_held)
    yv = y_held.to(ACC)
    tl.store(dx + rows * stride_dxr + cols, (yv * (g_held.to(ACC) - dot)).to(dx.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------------- launchers
# The single path on a GPU: a whole sequence's column block per tile, of SINGLE_TILE_ELEMS elements (float32: 16K
# where 8K leave rows under SINGLE_MIN_ROW_BYTES), taken where the tile holds every column (one contiguous span) or
# its rows are at least SINGLE_MIN_ROW_BYTES wide per input; else cooperative. Not the 16-bit forward whose chunks
# the Gluon kernel holds in shared memory, unless the tile holds every column. H200 (bench/NOTES.md, "The single
# plan's narrow rows"), % of copy, single / cooperative: bf16 backward at max_len 1024, 16-byte rows, 39 / 70;
# float32 backward at 2048, 16-byte rows, 36 / 77; float32 at 1024: 32-byte rows of 8K tiles 67 / 71 forward,
# 69 / 78 backward, 64-byte rows of 16K tiles 86 / 71, 86 / 78; bf16 at 512, 32-byte rows, 54 / 65 forward, 63 / 69
# backward; the bf16 forward at 128 and 256 rows (128- and 64-byte rows) 43 / 55 and 55 / 59, its backward 67 / 61
# and 68 / 65; float32 at 128-256 rows 74-84 / 40-62 forward, 96-97 / 71-73 backward. 16K tiles lose elsewhere: bf16
# 58 / 66 forward at 512, float64 backward 6-8% of copy (spills).
# Rows not 16 elements apart keep the rule before, as the interpreter does (with its 64K-element tiles): tiles of 8K
# elements whose rows reach UNALIGNED_MIN_ROW_BYTES over the inputs. Measured when Triton loaded such rows one element
# at a time, the 16K tiles and the 16-bit cooperative backward spilled there: H200, 20-200 columns, max_len 300-2048,
# that rule / this one: float32 backward 31-47 / 10-18, bf16 backward 11-25 / 8-15 (small inputs). With ROW_ALIGN
# (the kernels load 8 elements of 40-column rows at once) neither spills, and this rule measured mixed there (H200,
# 48M elements, max_len 1024, % of copy, the rule before / this one: float32 at 40-100 columns 58-69 / 69-78, at 20-24
# columns 63-82 / 60-75; bf16 backward at 20-40 columns 49-58 / 39-51, at 72-100 35-38 / 44-49; bench/NOTES.md, "Rows
# not 16 elements apart").
SINGLE_TILE_ELEMS = 8192
SINGLE_WIDE_TILE_ELEMS = 16384
SINGLE_MIN_ROW_BYTES = 64
UNALIGNED_MIN_ROW_BYTES = 32
# Elements one program of the split path reduces at most (more, shorter programs balance better).
MAX_CHUNK_ELEMS = 1 << 17


@dataclasses.dataclass(frozen=True)
class SoftmaxPlan:
    """How the Triton path tiles one ragged-dim softmax (forward or backward).

    ``chunk_rows`` None means the ``single`` path (``block_t`` >= the longest length); otherwise the
    ``split`` path with chunks of ``chunk_rows`` rows (a multiple of ``block_t``), or with ``cooperative``
    the ``cooperative`` path, one chunk per program: held in registers where ``chunk_rows == block_t``,
    read twice in tiles of ``block_t`` rows where it is a larger multiple (the forward only), or with ``shared``
    held in shared memory in tiles of ``block_t`` rows (the Gluon kernels, ``_softmax_gluon``).
    """

    block_t: int
    block_f: int
    chunk_rows: int | None
    num_warps: int = 4
    cooperative: bool = False
    shared: bool = False

    @property
    def rereads(self) -> bool:
        """Whether a cooperative plan reads its chunks twice (``chunk_rows > block_t``) rather than holding them."""
        return self.cooperative and self.chunk_rows != self.block_t and not self.shared


# Bytes of input one float32 cooperative program holds in registers (its tile of each input), its columns (every
# cooperative plan's), and how many tiles' partials the forward loads at once to combine them: the best of an H100
# sweep (bench/NOTES.md) over tiles of 4K-16K elements, 32-256 columns, 4 or 8 warps and 8-32 tiles per load.
COOPERATIVE_TILE_BYTES = 65536
COOPERATIVE_COLS = 64
# A float32 sequence of more tiles than this takes tiles of half the columns and twice the rows (the same bytes): its
# tiles wait for each other and combine their partials, which costs more the more tiles a sequence has. Sweep, % of
# copy, GPU only, 64-column tiles / 32-column (bench/NOTES.md, "Float32 softmax tiles for long sequences"): at
# bench/jagged_ops.py's shape (16 forward tiles, 32 backward) forward H100 83.0 / 81.9, H200 69.2 / 67.8, backward
# 87.2 / 86.9, 74.0 / 74.4; 16 sequences of 4K-16K rows (64 forward tiles, 127 backward: past the bound, so the split
# path) forward H100 75.0 / 80.3, H200 61.4 / 67.5, backward 59.9 / 83.3, 60.3 / 71.6.
FLOAT32_WIDE_TILES = 32
COMBINE_SLICE = 16
# The backward's combine loads twice as many: one load for up to 32 tiles (4,096 rows of 128) instead of a loop.
# H100 at bench/jagged_ops.py's shape: bf16 78% -> 80% of copy, float32 84% -> 86%; 64 is lower (72%), and 32 costs
# the forward 1-2 points (bench/NOTES.md).
BWD_COMBINE_SLICE = 32
# The 16-bit forward's cooperative chunks, read twice (statistics, then the write) in tiles of 32 rows: the best
# of an H200 sweep over 128-1024 rows, 16-64-row tiles of 64-128 columns and 4 or 8 warps (bench/NOTES.md).
REREAD_CHUNK_ROWS = 512
REREAD_BLOCK_T = 32
# Both of its loops pipelined by Triton, 4 tiles deep: H100, 56.7% -> 58.2% of copy against 1 (unpipelined);
# 3 deep 56.1%, 2 deep lower (bench/NOTES.md). Triton pipelines 64-column blocks of 16-byte-aligned rows only
# (cp.async copies 4 to 16 bytes): narrower blocks load one tile at a time.
REREAD_STAGES = 4
# Chunks held in shared memory (_softmax_gluon, sm_90), per (inputs, element size): tiers of (rows, rows per tile,
# columns per block, warps), the first whose chunks of a sequence fit the bound; past the last, the other plans.
# The 16-bit forward: H100 sweep (bench/NOTES.md; exponents then in an FMA form 1-1.5 points faster, since dropped for
# its rounding), % of copy at bench/jagged_ops.py's shape / sequences of 4K-16K rows: 192 x 64 at 2 warps 81.0 / (past
# the bound), 256 x 64 x 2 80.7 / 76.4, 512 x 128 x 4 80.0 / 78.6, 1024 rows 39-41 (one program per SM), against the
# re-read chunks' 63.2 / 61.8; on an H200 no block of 128 columns beat it (44-65 against 59-68). The float32 forward and
# both backwards: H200 sweep (bench/NOTES.md, "The softmax backward held in shared memory"), % of copy at that shape /
# 16 sequences of 4K-8K rows / 128 of 128-2048, against the registers' tiles: float32 forward 192 x 64 in blocks of 32
# columns, 2 warps, 78.2 / 77.2 / 80.6 against 68.9 / 67.6 / 70.2; 16-bit backward 128 x 64 x 2, 64 columns, 74.8 /
# 75.1 / 77.1 (bf16) against 67.4 / 67.9 / 68.9; float32 backward 128 x 32 x 2, 64 columns, 82.7 / 81.2 / 85.1
# against 74.0 / 77.3 / 76.0. Their second tiers, past the first's bound (8 sequences up to 16,896 rows backward,
# 25,000 forward), against the registers' tiles there: bf16 backward 256 x 64 x 2 69.5 against 59.1, float32 backward
# 256 x 64 x 2 in blocks of 32 columns 75.1 against 69.2, float32 forward 512 x 128 x 4 68.1 against 61.6.
SHARED_TIERS = {(1, 2): ((192, 64, 64, 2), (512, 128, 64, 4)), (1, 4): ((192, 64, 32, 2), (512, 128, 32, 4)),
                (2, 2): ((128, 64, 64, 2), (256, 64, 64, 2)), (2, 4): ((128, 32, 64, 2), (256, 64, 32, 2))}
# The fewest columns for which a block is held in shared memory (else 33: a block of 64 columns): the 16-bit backward
# at 40 columns ran at 34% of copy there against the registers' 38% (H200, 64 sequences of 128-4096 rows; at 64 and
# 128 columns 54.7 / 61.6 against 53.4 / 57.6; float32 at 40 columns 49 against 45).
SHARED_MIN_COLS = {(2, 2): 64}
# The 16-bit backward holds its tile as the inputs' 16-bit values: 128 rows (32 KiB of input) where a sequence's
# tiles of 128 rows fit the bound, else 256 (H100 sweep, bench/jagged_ops.py's shape: 128 x 64 78%, 256 x 64 76%,
# 64 x 64 60% at 4 warps, 71% at 2; sequences of 4K-16K rows, 256 x 64: 73.5%; bench/NOTES.md).
HELD_16_BLOCK_T = 128
# Narrow blocks (a score per head, or one per row): 1-16 columns in the backward, one float32 column in the forward.
# They hold tiles of NARROW_TILE_ELEMS elements (16-bit backward) or NARROW_TILE_ELEMS_32 (the others), at most
# NARROW_BLOCK_T rows, 8 warps from 4,096 elements: the tiles above, sized for 64 columns, leave a narrow tile 128-2,048
# elements, bound by its program's fixed costs. (The 16-bit forward's chunks, read twice, scale their rows up
# already.) H200, 2K-40K rows where the plan changed, % of copy, before / after (bench/NOTES.md, "The softmax's narrow
# rows"): bf16 backward at 1, 2, 4, 8, 16 columns 13-19 / 36-37, 13-41 / 47, 23-50 / 54-56, 36-52 / 64-68, 50-62 /
# 63-68; float32 forward at one column 15-44 / 47-52, backward at 1-16 columns 25-76 / 61-77. Measured and left: the
# bf16 backward at 32 columns (512 rows: 65 against 61-66).
NARROW_TILE_ELEMS = 16384
NARROW_TILE_ELEMS_32 = 4096
NARROW_BACKWARD_COLS = 16
NARROW_BLOCK_T = 1024
# The 32- and 64-bit forward's blocks of 2-16 columns (one float64 column too: rows of at least 8 bytes) read their
# chunks twice, in tiles of REREAD_NARROW_TILE_ELEMS elements, chunks of REREAD_NARROW_CHUNK_ELEMS, doubled where a
# sequence's chunks would pass the bound. H200, % of copy at 2K-40K rows, the plans before (held tiles, or split past
# the bound) / these: float32 at 2 columns 53-55 / 57-61, 4: 49-54 / 58-61, 8: 51-59 / 62-67, 16: 50-64 / 58-65;
# float64 at 1-16 columns 19-43 / 43-58. Measured and left: one float32 column read twice (27-43 against 47-53 held),
# 32 float32 columns (4K rows: 64 against 67 held); tiles of 2,048 elements were within 3 points (bench/NOTES.md,
# "The 32- and 64-bit softmax forward's narrow chunks read twice, and the single tile's last rows").
REREAD_NARROW_COLS = 16
REREAD_NARROW_TILE_ELEMS = 1024
REREAD_NARROW_CHUNK_ELEMS = 8192
# The single tile's most rows on the GPU: one program per sequence of 8K-16K rows (one or two columns) ran slower than
# the cooperative plans. H200, one column at 8,192 rows, % of copy, the single tile / the cooperative plan
# (bench/NOTES.md, "The 32- and 64-bit softmax forward's narrow chunks read twice, and the single tile's last rows"):
# bf16 forward 24.2 / 37.5, backward 34.8 / 38.5, float32 44.9 / 53.1 and 62.9 / 64.7, float64 forward 20.6 / 48.0;
# one loss, the float64 backward (87.2 / 80.9). At 4,096 rows the single tile wins (bf16 forward 39.2 against 37.4).
# (On a GPU of fewer than 16 SMs a one-column backward of up to 8,192 rows can pass the narrow tiles' bound too: it
# takes the split path there, which reads its inputs twice; not measured on such a GPU.)
SINGLE_MAX_ROWS = 4096


def cooperative_max_chunks(device: torch.device) -> int:
    """The most chunks one sequence may have on the cooperative path: they wait for each other, so all must run
    at once. Half the SMs (each holds at least one program), so that two such launches on different streams
    still can't hold every SM with waiting programs."""
    return sm_count(device) // 2


def _cooperative_plan(max_len: int, n_cols: int, elem_size: int, inputs: int, device: torch.device,
                      shared: bool) -> SoftmaxPlan | None:
    """Where ``shared`` (the inputs suit ``_softmax_gluon``) and a block has 64 columns (and there are at least
    :data:`SHARED_MIN_COLS`), chunks held in shared memory (:data:`SHARED_TIERS`, in blocks of the tier's columns)
    where a sequence's fit :func:`cooperative_max_chunks`.
    Else blocks of 64 columns, 4 warps, where a sequence's tiles fit the bound: float32 tiles holding 64 KiB of input
    (32 columns and twice the rows past :data:`FLOAT32_WIDE_TILES` tiles of a sequence); the 16-bit backward's of
    ``HELD_16_BLOCK_T`` rows (twice that where those would pass the bound); the 16-bit forward's chunks of
    ``REREAD_CHUNK_ROWS`` rows read twice in tiles of ``REREAD_BLOCK_T`` (both scaled up where fewer than 64 columns
    keep the elements per tile). Narrow blocks (1-16 columns backward, one float32 column forward) hold tiles of
    :data:`NARROW_TILE_ELEMS` or :data:`NARROW_TILE_ELEMS_32` elements instead, at most :data:`NARROW_BLOCK_T` rows,
    8 warps from 4,096 elements; the 32- and 64-bit forward's blocks of 2-16 columns (or one float64 column) read
    chunks of :data:`REREAD_NARROW_CHUNK_ELEMS` elements twice in tiles of :data:`REREAD_NARROW_TILE_ELEMS` (the
    chunks doubled where a sequence's would pass the bound). None off the GPU or under the
    interpreter (whose programs run one at a time: a wait would never end). H100, % of copy bandwidth against the
    split path: float32 forward 83% vs 62%, backward bf16 78% vs 58%, float32 86% vs 60%. The 16-bit forward held in
    registers ran at 53% at best (16K elements per tile), below split's 56%; read twice, 63% (its loops pipelined, the
    re-read last tile first); held in shared memory, 78-79%. H200, held in shared memory against registers: the
    float32 forward 78% vs 69%, backward bf16 75% vs 67%, float32 83% vs 74% (bench/NOTES.md)."""
    if device.type != "cuda" or interpreter_enabled():
        return None
    block_f = min(next_power_of_2(n_cols), COOPERATIVE_COLS)
    if shared and block_f == COOPERATIVE_COLS and n_cols >= SHARED_MIN_COLS.get((inputs, elem_size), 0):
        for chunk_rows, block_t, cols, warps in SHARED_TIERS.get((inputs, elem_size), ()):
            if cdiv(max_len, chunk_rows) <= cooperative_max_chunks(device):
                return SoftmaxPlan(block_t, cols, chunk_rows, warps, cooperative=True, shared=True)
    narrow = False
    if inputs == 1 and elem_size < 4:
        wider = COOPERATIVE_COLS // block_f
        block_t, chunk_rows = REREAD_BLOCK_T * wider, REREAD_CHUNK_ROWS * wider
    elif inputs == 1 and block_f <= REREAD_NARROW_COLS and block_f * elem_size >= 8:
        block_t, chunk_rows = REREAD_NARROW_TILE_ELEMS // block_f, REREAD_NARROW_CHUNK_ELEMS // block_f
        if cdiv(max_len, chunk_rows) > cooperative_max_chunks(device):
            chunk_rows *= 2  # (a second tier: at most two variants of the kernel per width, as the held tiles')
    elif block_f <= (NARROW_BACKWARD_COLS if inputs == 2 else 1):
        narrow = True
        elems = NARROW_TILE_ELEMS if elem_size < 4 else NARROW_TILE_ELEMS_32
        block_t = chunk_rows = min(NARROW_BLOCK_T, elems // block_f)
    elif elem_size < 4:
        fits = cdiv(max_len, HELD_16_BLOCK_T) <= cooperative_max_chunks(device)
        block_t = chunk_rows = HELD_16_BLOCK_T if fits else 2 * HELD_16_BLOCK_T
    else:
        block_t = chunk_rows = COOPERATIVE_TILE_BYTES // (COOPERATIVE_COLS * elem_size * inputs)
        if block_f == COOPERATIVE_COLS and cdiv(max_len, chunk_rows) > FLOAT32_WIDE_TILES:
            block_f //= 2
            block_t = chunk_rows = 2 * chunk_rows
    if cdiv(max_len, chunk_rows) > cooperative_max_chunks(device):
        return None
    warps = 8 if narrow and block_t * block_f >= 4096 else 4
    return SoftmaxPlan(block_t, block_f, chunk_rows, warps, cooperative=True)


def softmax_plan(batch: int, max_len: int, n_cols: int, elem_size: int, device: torch.device,
                 inputs: int = 1, shared: bool = False, aligned: bool = True) -> SoftmaxPlan:
    """The plan for these sizes (``inputs``: tensors read per element, 1 forward, 2 backward; ``shared``: whether
    ``_softmax_gluon`` takes the inputs, :func:`_softmax_gluon.applies`; ``aligned``: whether every row of
    the inputs and output starts a multiple of 16 elements from the last, :func:`rows_aligned`): ``single`` when a
    sequence fits one tile with every column or with rows of at least :data:`SINGLE_MIN_ROW_BYTES` per input (on a
    GPU: a tile of :data:`SINGLE_TILE_ELEMS`, or for float32 :data:`SINGLE_WIDE_TILE_ELEMS`, of at most
    :data:`SINGLE_MAX_ROWS` rows; rows not ``aligned``:
    8K elements and :data:`UNALIGNED_MIN_ROW_BYTES` over the inputs; not for the 16-bit forward's rows where
    ``shared``, unless the tile holds every column; under the interpreter, whose cost is per program, 64K elements
    and rows of one 32-byte sector over the inputs), else ``cooperative`` where it applies
    (:func:`_cooperative_plan`), else ``split``.

    Split tiles on the GPU: 256 contiguous bytes of a row, 8K elements per input (16 to 32 KiB in flight per
    program) and 8 warps: the best of a sweep over 64-256 columns, 4K-16K elements and 4 or 8 warps on an
    H100 (bench/NOTES.md: 51-58% of copy bandwidth in bf16, against 30-51% with 4K elements and 4 warps).
    """
    on_gpu = device.type == "cuda"
    full_t = next_power_of_2(max(max_len, 1))
    if not on_gpu:
        budgets = (65536,)
    elif full_t > SINGLE_MAX_ROWS:
        budgets = ()
    elif elem_size == 4 and aligned:
        budgets = (SINGLE_TILE_ELEMS, SINGLE_WIDE_TILE_ELEMS)
    else:
        budgets = (SINGLE_TILE_ELEMS,)
    # (the 16-bit forward's chunks held in shared memory beat a tile of strided rows at any length)
    strided_rows_pay = not (on_gpu and shared and inputs == 1 and elem_size == 2)
    for budget in budgets:
        block_f = min(next_power_of_2(n_cols), budget // full_t)
        wide_enough = (block_f * elem_size >= SINGLE_MIN_ROW_BYTES if on_gpu and aligned
                       else block_f * elem_size * inputs >= UNALIGNED_MIN_ROW_BYTES)
        if block_f >= 1 and (block_f >= n_cols or strided_rows_pay and wide_enough):
            return SoftmaxPlan(full_t, block_f, None, 8 if on_gpu and full_t * block_f >= 4096 else 4)
    cooperative = _cooperative_plan(max_len, n_cols, elem_size, inputs, device, shared)
    if cooperative is not None:
        return cooperative
    block_f = min(next_power_of_2(n_cols), max(1, 256 // elem_size) if on_gpu else 256)
    block_t = min(full_t, max(1, (8192 * inputs if on_gpu else 16384) // block_f))
    n_col_tiles = cdiv(n_cols, block_f)
    chunk_rows = chunk_rows_for(max_len, batch * n_col_tiles, block_t, device, max_rows=MAX_CHUNK_ELEMS // block_f)
    return SoftmaxPlan(block_t, block_f, chunk_rows, 8 if on_gpu else 4)


def rows_aligned(*tensors: torch.Tensor) -> bool:
    """Whether each ``(total, F)`` tensor starts at a 16-byte boundary, with unit column stride and a row stride that
    is a multiple of 16 elements: what Triton's own specialization sees (narrower rows reach vectorized loads and
    stores through the kernels' ``ROW_ALIGN``, :func:`varlen.tiling.row_align`, but take the plan rule before)."""
    return all(t.data_ptr() % 16 == 0 and t.stride(1) == 1 and t.stride(0) % 16 == 0 for t in tensors)


def _launch_shape(plan: SoftmaxPlan, batch: int, max_len: int, n_cols: int,
                  device: torch.device) -> tuple[int, int, int]:
    n_col_tiles = cdiv(n_cols, plan.block_f)
    n_chunks = 1 if plan.chunk_rows is None else max(1, cdiv(max_len, plan.chunk_rows))
    if plan.shared and not (plan.cooperative and plan.chunk_rows):
        raise ValueError(f"plan: shared=True holds a cooperative plan's chunks in shared memory; got {plan}")
    if plan.cooperative and device.type == "cuda" and n_chunks > cooperative_max_chunks(device):
        raise ValueError(f"plan: the cooperative path's {n_chunks} chunks per sequence (max_len {max_len}, "
                         f"chunk_rows {plan.chunk_rows}) could wait for chunks that never start; at most "
                         f"{cooperative_max_chunks(device)} on this GPU")
    if plan.cooperative and n_chunks > 1 and interpreter_enabled():
        raise ValueError(f"plan: the cooperative path's {n_chunks} chunks per sequence would wait for each other "
                         "forever under Triton's interpreter (it runs one program at a time); use one chunk per "
                         f"sequence (chunk_rows >= max_len {max_len}) or the split path")
    return n_col_tiles, n_chunks, batch * n_chunks * n_col_tiles


def _tickets(batch: int, n_col_tiles: int, device: torch.device) -> torch.Tensor:
    """The cooperative path's counters: the claim counter, then one per (sequence, column block)."""
    return torch.zeros(1 + batch * n_col_tiles, dtype=torch.int32, device=device)


def softmax_fwd_triton(x: torch.Tensor, offsets: torch.Tensor, max_len: int,
                       plan: SoftmaxPlan | None = None) -> torch.Tensor:
    """Ragged-dim softmax of ``x`` ``(total, F)`` (inner stride free); returns a contiguous ``(total, F)``."""
    total, n_cols = x.shape
    batch = offsets.shape[0] - 1
    offsets = offsets.contiguous()  # (the kernels read offsets[b] at stride 1; a custom op's caller may pass a view)
    y = torch.empty((total, n_cols), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    plan = plan or softmax_plan(batch, max_len, n_cols, x.element_size(), x.device, shared=_softmax_gluon.applies(x),
                                aligned=rows_aligned(x, y))
    n_col_tiles, n_chunks, n_programs = _launch_shape(plan, batch, max_len, n_cols, x.device)
    acc = acc_type(x.dtype)
    tiles = dict(ACC=acc, BLOCK_T=plan.block_t, BLOCK_F=plan.block_f, num_warps=plan.num_warps,
                 ROW_ALIGN=row_align(n_cols, x.stride(0), y.stride(0)))
    if plan.chunk_rows is None:
        _softmax_single_kernel[(n_programs,)](x, y, offsets, total, n_cols, n_col_tiles, x.stride(0), x.stride(1),
                                              y.stride(0), **tiles)
        return y
    part_dtype = accumulate_dtype(x.dtype)
    part_max = torch.empty((batch, n_chunks, n_cols), dtype=part_dtype, device=x.device)
    part_sum = torch.empty_like(part_max)
    if plan.shared:
        _softmax_gluon.launch(x, y, offsets, part_max, part_sum, _tickets(batch, n_col_tiles, x.device), n_chunks,
                              n_col_tiles, plan, COMBINE_SLICE)
        return y
    if plan.cooperative:
        reread = dict(CHUNK_ROWS=plan.chunk_rows, STAGES=REREAD_STAGES)
        kernel, chunk = ((_softmax_cooperative_reread_kernel, reread) if plan.rereads
                         else (_softmax_cooperative_kernel, {}))
        kernel[(n_programs,)](x, y, offsets, total, part_max, part_sum, _tickets(batch, n_col_tiles, x.device), n_cols,
                              n_chunks, n_col_tiles, x.stride(0), x.stride(1), y.stride(0), SLICE=COMBINE_SLICE,
                              **chunk, **tiles)
        return y
    _softmax_stats_kernel[(n_programs,)](x, offsets, total, part_max, part_sum, n_cols, n_chunks, plan.chunk_rows,
                                         n_col_tiles, x.stride(0), x.stride(1), **tiles)
    _softmax_write_kernel[(n_programs,)](x, y, offsets, total, part_max, part_sum, n_cols, n_chunks, plan.chunk_rows,
                                         n_col_tiles, n_programs, x.stride(0), x.stride(1), y.stride(0),
                                         **tiles)
    return y


def softmax_bwd_triton(y: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, max_len: int,
                       plan: SoftmaxPlan | None = None) -> torch.Tensor:
    """``dx = y * (dy - sum_t dy * y)`` per sequence and column, ``y`` and ``dy`` ``(total, F)``."""
    if dy.shape != y.shape:
        raise ValueError(f"dy: expected y's shape {tuple(y.shape)}, got {tuple(dy.shape)}")
    total, n_cols = y.shape
    batch = offsets.shape[0] - 1
    y, offsets = last_dim_contiguous(y), offsets.contiguous()  # (both read at unit stride)
    dx = torch.empty((total, n_cols), dtype=y.dtype, device=y.device)
    if dx.numel() == 0:
        return dx
    plan = plan or softmax_plan(batch, max_len, n_cols, y.element_size(), y.device, inputs=2,
                                shared=_softmax_gluon.applies(y, dy), aligned=rows_aligned(y, dy, dx))
    if plan.rereads:
        raise ValueError(f"plan: the cooperative backward holds its chunk in one tile of registers (chunk_rows == "
                         f"block_t) or in shared memory (shared=True), not read twice; got chunk_rows "
                         f"{plan.chunk_rows}, block_t {plan.block_t}")
    n_col_tiles, n_chunks, n_programs = _launch_shape(plan, batch, max_len, n_cols, y.device)
    acc = acc_type(y.dtype)
    tiles = dict(ACC=acc, BLOCK_T=plan.block_t, BLOCK_F=plan.block_f, num_warps=plan.num_warps,
                 ROW_ALIGN=row_align(n_cols, y.stride(0), dy.stride(0), dx.stride(0)))
    if plan.chunk_rows is None:
        _softmax_bwd_single_kernel[(n_programs,)](y, dy, dx, offsets, total, n_cols, n_col_tiles, y.stride(0),
                                                  dy.stride(0), dy.stride(1), dx.stride(0), **tiles)
        return dx
    part_dtype = accumulate_dtype(y.dtype)
    part_dot = torch.empty((batch, n_chunks, n_cols), dtype=part_dtype, device=y.device)
    if plan.shared:
        _softmax_gluon.launch_backward(y, dy, dx, offsets, part_dot, _tickets(batch, n_col_tiles, y.device), n_chunks,
                                       n_col_tiles, plan, BWD_COMBINE_SLICE)
        return dx
    if plan.cooperative:
        # (_opaque is PTX, absent from the interpreter, which runs one-tile cooperative plans only, and from ROCm;
        # it takes an even number of values.)
        holds_16_bit = (y.element_size() == dy.element_size() == 2 and plan.block_t * plan.block_f % 2 == 0
                        and not interpreter_enabled() and torch.version.hip is None)
        _softmax_bwd_cooperative_kernel[(n_programs,)](y, dy, dx, offsets, total, part_dot,
                                                       _tickets(batch, n_col_tiles, y.device), n_cols, n_chunks,
                                                       n_col_tiles, y.stride(0), dy.stride(0), dy.stride(1),
                                                       dx.stride(0), SLICE=BWD_COMBINE_SLICE, HOLD_16=holds_16_bit,
                                                       **tiles)
        return dx
    _softmax_bwd_dot_kernel[(n_programs,)](y, dy, offsets, total, part_dot, n_cols, n_chunks, plan.chunk_rows,
                                           n_col_tiles, y.stride(0), dy.stride(0), dy.stride(1), **tiles)
    _softmax_bwd_write_kernel[(n_programs,)](y, dy, dx, offsets, total, part_dot, n_cols, n_chunks, plan.chunk_rows,
                                             n_col_tiles, n_programs, y.stride(0), dy.stride(0), dy.stride(1),
                                             dx.stride(0), **tiles)
    return dx


def softmax_fwd_torch(x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The same as :func:`softmax_fwd_triton` with PyTorch scatter/gather ops (no host sync)."""
    total, n_cols = x.shape
    batch = offsets.shape[0] - 1
    seq = segment_ids(offsets, total)
    v = x.to(accumulate_dtype(x.dtype))
    m = v.new_full((batch, n_cols), float("-inf"))
    m.scatter_reduce_(0, seq[:, None].expand(total, n_cols), v, "amax")
    m = torch.where(m == float("-inf"), 0.0, m)
    e = torch.exp(v - m[seq])
    s = v.new_zeros((batch, n_cols)).index_add_(0, seq, e)
    return (e / s[seq]).to(x.dtype)


def softmax_bwd_torch(y: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    total, n_cols = y.shape
    seq = segment_ids(offsets, total)
    acc = accumulate_dtype(y.dtype)
    yv, g = y.to(acc), dy.to(acc)
    dot = yv.new_zeros((offsets.shape[0] - 1, n_cols)).index_add_(0, seq, yv * g)
    return (yv * (g - dot[seq])).to(y.dtype)


DOUBLE_BACKWARD = "varlen.softmax over the ragged dim: no double backward (create_graph=True through it)"


# ------------------------------------------------------------------------------------ custom ops
# torch.compile sees each step as one opaque op (whatever the backend launches inside), with its output
# shape from the fake implementation; the host ints stay symbolic, so new lengths don't recompile. Eager
# calls run the implementations directly (varlen._backend.through_custom_op).
def _softmax_fwd(x: Tensor, offsets: Tensor, max_len: int, backend: str) -> Tensor:
    return softmax_fwd_triton(x, offsets, max_len) if backend == "triton" else softmax_fwd_torch(x, offsets)


def _softmax_bwd(y: Tensor, dy: Tensor, offsets: Tensor, max_len: int, backend: str) -> Tensor:
    return softmax_bwd_triton(y, dy, offsets, max_len) if backend == "triton" else softmax_bwd_torch(y, dy, offsets)


_softmax_fwd_op = torch.library.custom_op("varlen::ragged_softmax_forward", _softmax_fwd, mutates_args=())
_softmax_bwd_op = torch.library.custom_op("varlen::ragged_softmax_backward", _softmax_bwd, mutates_args=())


@_softmax_fwd_op.register_fake
def _(x, offsets, max_len, backend):
    return x.new_empty(x.shape)


@_softmax_bwd_op.register_fake
def _(y, dy, offsets, max_len, backend):
    return y.new_empty(y.shape)


# -------------------------------------------------------------------------------------- autograd
class _RaggedSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, offsets, max_len, backend):
        fwd = _softmax_fwd_op if through_custom_op() else _softmax_fwd
        out = fwd(as_columns(values, 1), offsets, max_len, backend).view(values.shape)
        if ctx.needs_input_grad[0]:
            # (the output itself: under create_graph it carries the gradient's guard, refuse_double_backward)
            ctx.save_for_backward(out, offsets)
        ctx.max_len, ctx.backend = max_len, backend
        return out

    @staticmethod
    def backward(ctx, grad):
        out, offsets = ctx.saved_tensors
        bwd = _softmax_bwd_op if through_custom_op() else _softmax_bwd
        dx = bwd(as_columns(out, 1), as_columns(grad, 1), offsets, ctx.max_len, ctx.backend)
        return (*refuse_double_backward(DOUBLE_BACKWARD, (dx.view(grad.shape),), out, grad), None, None, None)


# ---------------------------------------------------------------------------------------- public
def softmax(x: JaggedTensor | torch.Tensor, dim: int, *, backend: str | None = None) -> JaggedTensor:
    """Softmax of a jagged ``(B, j, *inner)`` tensor along ``dim``.

    Args:
        x: a JaggedTensor (or a ``torch.nested`` jagged tensor), floating point.
        dim: 1 (or ``1 - x.dim()``): the ragged dim: for each sequence, softmax over its positions,
            independently for each inner index. An empty sequence gives an empty result. ``>= 2`` or
            negative: an inner dim (``-1`` is the last; with no inner dims it is the ragged dim).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``; None (default): the enclosing
            ``varlen.use_backend``'s choice (see ``varlen.capabilities.JAGGED_KERNELS``).

    Returns a JaggedTensor with ``x``'s offsets and dtype; differentiable. Computed in float32
    (float64 for float64 inputs). A column that is all ``-inf`` gives NaN, as ``torch.softmax``. Under
    ``torch.autocast`` on CUDA it takes and returns float32, as ``torch.softmax`` does.

    Raises ValueError for ``dim`` 0 (the batch: sequences are normalized separately) or out of range,
    TypeError for a non-jagged ``x``, a non-integer ``dim`` or a non-float dtype.
    """
    x = as_jagged(x, "x")
    check_dtype("x.values", x.values, FLOAT_DTYPES)
    d = normalize_dim("dim", dim, x.dim())
    if d == 0:
        raise ValueError(f"dim: got {dim}, the batch dim; softmax over it would mix sequences. Allowed: "
                         f"1 (the ragged dim) or an inner dim 2..{x.dim() - 1} (negative counts from the end)")
    if d >= 2:
        return x.with_values(torch.softmax(x.values, d - 1))
    (values,) = _amp.cast(_amp.FLOAT32, x.device, x.values)
    backend = capabilities.resolve(x.device, values.dtype, "ragged", backend)
    return x.with_values(_RaggedSoftmax.apply(values, x.offsets, x.max_len, backend))
