"""Sum and mean of a jagged tensor over its ragged dim (to a dense tensor) or over inner dims.

Over the ragged dim the result is dense ``(B, *inner)``: a segmented column reduction of ``values``.
The Triton kernel gives each (sequence, chunk of rows, block of columns) to one program that
accumulates a ``BLOCK_T x BLOCK_F`` tile in float32 (float64 for float64) and reduces it once at the
end. When the batch alone can't fill the GPU, long sequences are cut into chunks: each chunk stores its
partial sum (a ``(B, chunks, F)`` buffer, tiny next to the input) and the last of a sequence's chunks to
finish adds them in chunk order and writes the result, mean included, in the same launch (a sequence
in one chunk writes it directly). The backward broadcasts each sequence's gradient over its rows
(divided by the length for mean), one program per (sequence, block of rows, block of columns). Both
are linear and each is the other's backward, so double backward works.

Over inner dims each row of ``values`` is reduced on its own with ``torch.sum``/``torch.mean``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .. import _amp, capabilities
from .._backend import gradient_op, through_custom_op
from .._checks import (
    FLOAT_DTYPES,
    accumulate_dtype,
    check_bool,
    check_dtype,
    check_int,
    check_rows,
    is_int,
    normalize_dim,
)
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
    copy_tiles,
    known_multiple,
    next_power_of_2,
    row_align,
    tile_coords,
)


# ------------------------------------------------------------------------------------ kernels
@fast_launch
@triton.jit(do_not_specialize=["total", "n_chunks", "chunk_rows"])
def _segment_sum_kernel(x, offsets, out, partials, chunks_done, total, n_cols, n_chunks, chunk_rows, n_col_tiles,
                        stride_xr, stride_xc, MEAN: tl.constexpr, ACC: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_F: tl.constexpr, STAGES: tl.constexpr, ROW_ALIGN: tl.constexpr):
    # One (sequence, chunk, column block) per program; out is (B, n_cols) contiguous.
    n_cols = known_multiple(n_cols, ROW_ALIGN)
    stride_xr = known_multiple(stride_xr, ROW_ALIGN)
    b, b_chunk, col_tile, start, length, lo, hi = chunk_coords(
        tl.program_id(0), n_chunks, n_col_tiles, offsets, chunk_rows, total)
    # The chunks that hold rows; at least one, so that an empty sequence writes its 0 (NaN for mean).
    n_live = tl.maximum(tl.minimum(tl.cdiv(length, chunk_rows), n_chunks), 1)
    if b_chunk % n_chunks >= n_live:
        return
    cols = col_tile * BLOCK_F + tl.arange(0, BLOCK_F).to(tl.int64)
    col_ok = cols < n_cols
    acc = tl.zeros([BLOCK_T, BLOCK_F], ACC)
    for t0 in tl.range(lo, hi, BLOCK_T, num_stages=STAGES):
        rows = start + t0 + tl.arange(0, BLOCK_T).to(tl.int64)
        mask = (rows < start + hi)[:, None] & col_ok[None, :]
        acc += tl.load(x + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0).to(ACC)
    result = tl.sum(acc, 0)
    finished = n_live - 1
    if n_live > 1:
        # Several chunks: each stores its partial sum and takes a ticket; the last to finish adds the partials in
        # chunk order, so the result doesn't depend on which one that is (deterministic), and nobody waits. The
        # barrier puts every thread's partial before the ticket's release; the partials of the other chunks
        # are read from L2 (.cg), never from this SM's L1.
        tl.store(partials + b_chunk.to(tl.int64) * n_cols + cols, result, mask=col_ok)
        tl.debug_barrier()
        finished = tl.atomic_add(chunks_done + b.to(tl.int64) * n_col_tiles + col_tile, 1).to(n_live.dtype)
        if finished == n_live - 1:
            result = tl.zeros([BLOCK_F], ACC)
            first = b.to(tl.int64) * n_chunks
            for c in range(0, n_live):
                result += tl.load(partials + (first + c) * n_cols + cols, mask=col_ok, other=0.0, cache_modifier=".cg")
    if finished == n_live - 1:
        if MEAN:
            result = result / length.to(ACC)  # 0 / 0 = NaN for an empty sequence, as torch.mean
        tl.store(out + b.to(tl.int64) * n_cols + cols, result.to(out.dtype.element_ty), mask=col_ok)


@fast_launch
@triton.jit(do_not_specialize=["total", "n_row_tiles"])
def _broadcast_rows_kernel(g, offsets, out, total, n_cols, n_row_tiles, n_col_tiles, stride_gb, stride_gc,
                           stride_or, MEAN: tl.constexpr, ACC: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_F: tl.constexpr, ROW_ALIGN: tl.constexpr):
    # out[row] = g[b] (/ L_b for mean) for every row of sequence b; blocks past the end return.
    n_cols = known_multiple(n_cols, ROW_ALIGN)
    stride_gb = known_multiple(stride_gb, ROW_ALIGN)
    stride_or = known_multiple(stride_or, ROW_ALIGN)
    b, row_tile, col_tile, start, length = tile_coords(tl.program_id(0), n_row_tiles, n_col_tiles, offsets,
                                                       total)
    if row_tile * BLOCK_T >= length:
        return
    rows = (row_tile * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64))[:, None]
    cols = (col_tile * BLOCK_F + tl.arange(0, BLOCK_F).to(tl.int64))[None, :]
    col_ok = cols < n_cols
    v = tl.load(g + b.to(tl.int64) * stride_gb + cols * stride_gc, mask=col_ok, other=0.0).to(ACC)
    if MEAN:
        v = v / length.to(ACC)
    # Converted once per column, then broadcast (not converted per element of the tile).
    tile = tl.broadcast_to(v.to(out.dtype.element_ty), [BLOCK_T, BLOCK_F])
    tl.store(out + (start + rows) * stride_or + cols, tile, mask=(rows < length) & col_ok)


# ----------------------------------------------------------------------------------- launchers
# Elements one program reduces at most: longer sequences are split (more, shorter programs balance better).
MAX_CHUNK_ELEMS = 1 << 17


def segment_sum_triton(x: torch.Tensor, offsets: torch.Tensor, max_len: int, mean: bool, *,
                       block_t: int | None = None, block_f: int | None = None, chunk_rows: int | None = None,
                       num_warps: int | None = None, stages: int | None = None) -> torch.Tensor:
    """``(B, F)`` per-sequence sums (or means) of ``x`` ``(total, F)``, in ``x``'s dtype; one launch (and
    a memset of the chunks' tickets when a sequence spans several chunks).

    The keywords override the tiling (tests and bench sweeps use them to reach every path): rows and
    columns of a tile, rows per chunk, warps, and tiles in flight (Triton's software pipelining; 1: none).
    """
    total, n_cols = x.shape
    batch = offsets.shape[0] - 1
    offsets = offsets.contiguous()  # (read at stride 1; a custom op's caller may pass a view)
    if n_cols == 0:
        return x.new_empty((batch, 0))
    tiles = _sum_tiles(max_len, n_cols, x.element_size(), x.device)
    bt, bf = block_t or tiles.block_t, block_f or tiles.block_f
    n_col_tiles = cdiv(n_cols, bf)
    rows = chunk_rows or chunk_rows_for(max_len, batch * n_col_tiles, bt, x.device, waves=8,
                                        max_rows=MAX_CHUNK_ELEMS // bf)
    n_chunks = max(1, cdiv(max_len, rows))
    out = torch.empty((batch, n_cols), dtype=x.dtype, device=x.device)
    # One-element stand-ins when no sequence spans two chunks (never touched; same dtypes, so the same kernel).
    acc_dtype = accumulate_dtype(x.dtype)
    if n_chunks > 1:
        partials = torch.empty((batch * n_chunks, n_cols), dtype=acc_dtype, device=x.device)
        chunks_done = torch.zeros(batch * n_col_tiles, dtype=torch.int32, device=x.device)
    else:
        partials = torch.empty(1, dtype=acc_dtype, device=x.device)
        chunks_done = torch.empty(1, dtype=torch.int32, device=x.device)
    _segment_sum_kernel[(batch * n_chunks * n_col_tiles,)](
        x, offsets, out, partials, chunks_done, total, n_cols, n_chunks, rows, n_col_tiles, x.stride(0), x.stride(1),
        MEAN=mean, ACC=acc_type(x.dtype), BLOCK_T=bt, BLOCK_F=bf, STAGES=stages or tiles.stages,
        ROW_ALIGN=row_align(n_cols, x.stride(0)), num_warps=num_warps or tiles.num_warps)
    return out


def broadcast_rows_triton(g: torch.Tensor, offsets: torch.Tensor, total: int, max_len: int, mean: bool, *,
                          block_t: int | None = None, block_f: int | None = None,
                          num_warps: int | None = None) -> torch.Tensor:
    """``(total, F)``: row r of sequence b is ``g[b]`` (``g[b] / L_b`` for mean); ``g`` is ``(B, F)``. The
    keywords override the tiles (:func:`varlen.tiling.copy_tiles`) and warps (4)."""
    batch, n_cols = g.shape
    check_rows("g", g, offsets.shape[0] - 1, "one per sequence of offsets")
    offsets = offsets.contiguous()  # (read at stride 1)
    out = torch.empty((total, n_cols), dtype=g.dtype, device=g.device)
    if out.numel() == 0:
        return out
    bt, bf = copy_tiles(max_len, n_cols, g.element_size(), g.device)
    bt, bf = block_t or bt, block_f or bf
    n_row_tiles, n_col_tiles = cdiv(max_len, bt), cdiv(n_cols, bf)
    _broadcast_rows_kernel[(batch * n_row_tiles * n_col_tiles,)](
        g, offsets, out, total, n_cols, n_row_tiles, n_col_tiles, g.stride(0), g.stride(1), out.stride(0),
        MEAN=mean, ACC=acc_type(g.dtype), BLOCK_T=bt, BLOCK_F=bf, num_warps=num_warps or 4,
        ROW_ALIGN=row_align(n_cols, g.stride(0), out.stride(0)))
    return out


class _SumTiles(NamedTuple):
    block_t: int
    block_f: int
    num_warps: int
    stages: int


# Rows of a sum's tile at most: one or two columns would otherwise take tiles of up to 8,192 rows. H200, sequences of
# 1K-4K rows, % of copy, before / after: bf16 29 / 61 (1 column), 21 / 49 (2); float32 60 / 93, 58 / 91
# (bench/NOTES.md, "Kernel variants per batch"). Rows of 16 columns or more reach 8K accumulators in fewer rows.
SUM_MAX_ROWS = 512


def _sum_tiles(max_len: int, n_cols: int, elem_size: int, device: torch.device) -> _SumTiles:
    """GPU: 256 contiguous bytes of a row and 8K accumulators per program (an H100 sweep at bench/jagged_ops.py's
    shape: 78% of copy in bf16 and 93% in float32, against 58% and 86% with 4K), at most :data:`SUM_MAX_ROWS` rows, 4
    warps. 16-bit tiles are half the bytes of float32 ones at the same accumulator count (registers), so they load two
    tiles ahead (Triton's pipelining) to keep as many bytes in flight. Interpreter: large tiles."""
    if device.type == "cuda":
        block_f = min(next_power_of_2(n_cols), max(1, 256 // elem_size))
        block_t = min(next_power_of_2(max(max_len, 1)), max(1, 8192 // block_f), SUM_MAX_ROWS)
        return _SumTiles(block_t, block_f, 4, 3 if elem_size <= 2 else 1)
    block_f = min(next_power_of_2(n_cols), 1024)
    return _SumTiles(min(next_power_of_2(max(max_len, 1)), max(1, 65536 // block_f)), block_f, 4, 1)


def segment_sum_torch(x: torch.Tensor, offsets: torch.Tensor, mean: bool) -> torch.Tensor:
    """The same as :func:`segment_sum_triton` with ``index_add`` (no host sync)."""
    total, n_cols = x.shape
    seq = segment_ids(offsets, total)
    out = x.new_zeros((offsets.shape[0] - 1, n_cols), dtype=accumulate_dtype(x.dtype))
    out.index_add_(0, seq, x.to(out.dtype))
    if mean:
        out = out / (offsets[1:] - offsets[:-1]).to(out.dtype)[:, None]
    return out.to(x.dtype)


def broadcast_rows_torch(g: torch.Tensor, offsets: torch.Tensor, total: int, mean: bool) -> torch.Tensor:
    seq = segment_ids(offsets, total)
    if not mean:
        return g[seq]
    lengths = (offsets[1:] - offsets[:-1]).to(accumulate_dtype(g.dtype))
    return (g.to(lengths.dtype) / lengths[:, None])[seq].to(g.dtype)


# ------------------------------------------------------------------------------------ custom ops
# torch.compile sees each step as one opaque op (whatever the backend launches inside), with its output
# shape from the fake implementation; the host ints stay symbolic, so new lengths don't recompile. Eager
# calls run the implementations directly (varlen._backend.through_custom_op).
def _segment_sum(x: Tensor, offsets: Tensor, max_len: int, mean: bool, backend: str) -> Tensor:
    if backend == "triton":
        return segment_sum_triton(x, offsets, max_len, mean)
    return segment_sum_torch(x, offsets, mean)


def _broadcast_rows(g: Tensor, offsets: Tensor, total: int, max_len: int, mean: bool, backend: str) -> Tensor:
    if backend == "triton":
        return broadcast_rows_triton(g, offsets, total, max_len, mean)
    return broadcast_rows_torch(g, offsets, total, mean)


_segment_sum_op = torch.library.custom_op("varlen::segment_sum", _segment_sum, mutates_args=())
_broadcast_rows_op = torch.library.custom_op("varlen::broadcast_rows", _broadcast_rows, mutates_args=())


@_segment_sum_op.register_fake
def _(x, offsets, max_len, mean, backend):
    return x.new_empty((offsets.shape[0] - 1, x.shape[1]))


@_broadcast_rows_op.register_fake
def _(g, offsets, total, max_len, mean, backend):
    return g.new_empty((total, g.shape[1]))


def _run_segment_sum(values: Tensor, offsets: Tensor, max_len: int, mean: bool, backend: str) -> Tensor:
    segment_sum = _segment_sum_op if through_custom_op() else _segment_sum
    out = segment_sum(as_columns(values, 1), offsets, max_len, mean, backend)
    return out.view(offsets.shape[0] - 1, *values.shape[1:])


def _run_broadcast_rows(g: Tensor, offsets: Tensor, total: int, max_len: int, mean: bool, backend: str) -> Tensor:
    broadcast_rows = _broadcast_rows_op if through_custom_op() else _broadcast_rows
    return broadcast_rows(as_columns(g, 1), offsets, total, max_len, mean, backend).view(total, *g.shape[1:])


# -------------------------------------------------------------------------------------- autograd
class _SegmentSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, offsets, max_len, mean, backend):
        ctx.save_for_backward(offsets)
        ctx.total, ctx.max_len, ctx.mean, ctx.backend = values.shape[0], max_len, mean, backend
        return _run_segment_sum(values, offsets, max_len, mean, backend)

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        dx = gradient_op(_BroadcastRows, _run_broadcast_rows, grad, offsets, ctx.total, ctx.max_len, ctx.mean,
                         ctx.backend)
        return dx, None, None, None, None


class _BroadcastRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, offsets, total, max_len, mean, backend):
        ctx.save_for_backward(offsets)
        ctx.max_len, ctx.mean, ctx.backend = max_len, mean, backend
        return _run_broadcast_rows(g, offsets, total, max_len, mean, backend)

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        dg = gradient_op(_SegmentSum, _run_segment_sum, grad, offsets, ctx.max_len, ctx.mean, ctx.backend)
        return dg, None, None, None, None, None


# ---------------------------------------------------------------------------------------- public
def _reduce_dims(x: JaggedTensor, dim) -> tuple[bool, list[int]]:
    """(whether the ragged dim is reduced, the inner dims reduced as dims of ``values``)."""
    dims = (dim,) if is_int(dim) else dim
    if not isinstance(dims, (tuple, list)) or len(dims) == 0:
        raise TypeError(f"dim: expected an int or a non-empty tuple of ints, got {dim!r}")
    normalized = [normalize_dim("dim", check_int("dim", d), x.dim()) for d in dims]
    if len(set(normalized)) != len(normalized):
        raise ValueError(f"dim: {dim!r} names a dim more than once")
    if 0 in normalized:
        raise ValueError(f"dim: {dim!r} includes the batch dim 0, which a jagged reduction doesn't cover "
                         f"(reduce over 1, the ragged dim, and/or inner dims 2..{x.dim() - 1}, then over the "
                         "batch of the dense result)")
    return 1 in normalized, sorted(d - 1 for d in normalized if d >= 2)


def _reduce(x, dim, keepdim: bool, mean: bool, backend: str | None):
    x = as_jagged(x, "x")
    check_dtype("x.values", x.values, FLOAT_DTYPES)
    check_bool("keepdim", keepdim)
    ragged, inner = _reduce_dims(x, dim)
    values = x.values
    if not ragged:
        return x.with_values((values.mean if mean else values.sum)(dim=inner, keepdim=keepdim))
    # torch.sum's autocast rule (float32 on CUDA; mean has none)
    out_dtype = values.dtype if mean else _amp.cast_dtype(_amp.FLOAT32, x.device, values.dtype)
    if inner:
        # The inner dims reduced in the dtype the ragged sum accumulates in (float32 for 16-bit values): rounded to
        # 16 bits first, the partial sums lost precision and could overflow (fp16 rows of +-40000 summed to NaN).
        values = (values.mean if mean else values.sum)(dim=inner, keepdim=keepdim,
                                                       dtype=accumulate_dtype(values.dtype))
    else:
        values = values.to(out_dtype)
    backend = capabilities.resolve(x.device, values.dtype, "ragged", backend)
    out = _SegmentSum.apply(values, x.offsets, x.max_len, mean, backend)
    return (out.unsqueeze(1) if keepdim else out).to(out_dtype)


def sum(x: JaggedTensor | torch.Tensor, dim: int | tuple[int, ...], keepdim: bool = False, *,
        backend: str | None = None):
    """Sum of a jagged ``(B, j, *inner)`` tensor over ``dim``.

    Args:
        x: a JaggedTensor (or a ``torch.nested`` jagged tensor), floating point.
        dim: an int or a tuple of ints (negative counts from the end). With 1 (the ragged dim) among
            them, each sequence is summed over its positions: the result is a dense tensor
            ``(B, *inner)`` with the other listed inner dims reduced too; an empty sequence sums to 0.
            Inner dims only (>= 2): a JaggedTensor with ``x``'s offsets.
        keepdim: keep each reduced dim with size 1 (``(B, 1, *inner)`` for the ragged dim).
        backend: ``"auto"``, ``"triton"`` or ``"torch"``; None (default): the enclosing
            ``varlen.use_backend``'s choice (see ``varlen.capabilities.JAGGED_KERNELS``).

    Accumulates in float32 (float64 for float64) and returns ``x``'s dtype (float32 under ``torch.autocast``
    on CUDA, as ``torch.sum``); differentiable, twice.

    Raises ValueError when ``dim`` includes 0 (the batch dim), repeats a dim or is out of range;
    TypeError for a non-jagged ``x``, a non-float dtype or a ``dim`` that is not an int / tuple of ints.
    """
    return _reduce(x, dim, keepdim, mean=False, backend=backend)


def mean(x: JaggedTensor | torch.Tensor, dim: int | tuple[int, ...], keepdim: bool = False, *,
         backend: str | None = None):
    """Mean of a jagged ``(B, j, *inner)`` tensor over ``dim``; arguments and errors as :func:`sum`.

    Over the ragged dim the mean of an empty sequence is NaN (0 / 0), as ``torch.mean`` of an empty
    tensor; its gradient is then NaN too, but reaches no element, since the sequence has none.
    """
    return _reduce(x, dim, keepdim, mean=True, backend=backend)
