"""Sum and mean of a jagged tensor over its ragged dim (to a dense tensor) or over inner dims.

Over the ragged dim the result is dense ``(B, *inner)``: a segmented column reduction of ``values``.
The Triton kernel gives each (sequence, chunk of rows, block of columns) to one program that
accumulates a ``BLOCK_T x BLOCK_F`` tile in float32 (float64 for float64) and reduces it once at the
end. When the batch alone can't fill the GPU, long sequences are cut into chunks whose partial sums
(a ``(B, chunks, F)`` buffer, tiny next to the input) are added afterwards; else the kernel writes
the result directly, mean included. The backward broadcasts each sequence's gradient over its rows
(divided by the length for mean), one program per (sequence, block of rows, block of columns). Both
are linear and each is the other's backward, so double backward works.

Over inner dims each row of ``values`` is reduced on its own with ``torch.sum``/``torch.mean``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _amp, capabilities
from .._checks import FLOAT_DTYPES, accumulate_dtype, check_dtype, check_int, normalize_dim
from .._triton import tl, triton
from ..jagged import JaggedTensor, as_jagged
from ..offsets import segment_ids
from ..tiling import acc_type, as_columns, chunk_coords, chunk_rows_for, copy_tiles, tile_coords


# ------------------------------------------------------------------------------------ kernels
@triton.jit(do_not_specialize=["total", "n_chunks", "chunk_rows"])
def _segment_sum_kernel(x, offsets, out, total, n_cols, n_chunks, chunk_rows, n_col_tiles, stride_xr, stride_xc,
                        MEAN: tl.constexpr, ACC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr):
    # out is (B * n_chunks, n_cols) contiguous; every row is written (0 for a chunk past the end).
    b, b_chunk, col_tile, start, length, lo, hi = chunk_coords(
        tl.program_id(0), n_chunks, n_col_tiles, offsets, chunk_rows, total)
    cols = (col_tile * BLOCK_F + tl.arange(0, BLOCK_F).to(tl.int64))[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_F], ACC)
    for t0 in range(lo, hi, BLOCK_T):
        rows = (start + t0 + tl.arange(0, BLOCK_T).to(tl.int64))[:, None]
        mask = (rows < start + hi) & (cols < n_cols)
        acc += tl.load(x + rows * stride_xr + cols * stride_xc, mask=mask, other=0.0).to(ACC)
    total = tl.sum(acc, 0)[None, :]
    if MEAN:
        total = total / length.to(ACC)  # 0 / 0 = NaN for an empty sequence, as torch.mean
    tl.store(out + b_chunk.to(tl.int64) * n_cols + cols, total.to(out.dtype.element_ty), mask=cols < n_cols)


@triton.jit(do_not_specialize=["total", "n_row_tiles"])
def _broadcast_rows_kernel(g, offsets, out, total, n_cols, n_row_tiles, n_col_tiles, stride_gb, stride_gc,
                           stride_or, MEAN: tl.constexpr, ACC: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_F: tl.constexpr):
    # out[row] = g[b] (/ L_b for mean) for every row of sequence b; blocks past the end return.
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
    tile = tl.broadcast_to(v, [BLOCK_T, BLOCK_F]).to(out.dtype.element_ty)
    tl.store(out + (start + rows) * stride_or + cols, tile, mask=(rows < length) & col_ok)


# ----------------------------------------------------------------------------------- launchers
# Elements one program reduces at most: longer sequences are split (more, shorter programs balance better).
MAX_CHUNK_ELEMS = 1 << 17


def segment_sum_triton(x: torch.Tensor, offsets: torch.Tensor, max_len: int, mean: bool, *,
                       block_t: int | None = None, block_f: int | None = None,
                       chunk_rows: int | None = None) -> torch.Tensor:
    """``(B, F)`` per-sequence sums (or means) of ``x`` ``(total, F)``, in ``x``'s dtype.

    ``block_t``/``block_f``/``chunk_rows`` override the tiling (tests use them to reach every path).
    """
    total, n_cols = x.shape
    batch = offsets.shape[0] - 1
    if n_cols == 0:
        return x.new_empty((batch, 0))
    bt, bf = _sum_tiles(max_len, n_cols, x.element_size(), x.device)
    bt, bf = block_t or bt, block_f or bf
    n_col_tiles = triton.cdiv(n_cols, bf)
    rows = chunk_rows or chunk_rows_for(max_len, batch * n_col_tiles, bt, x.device, waves=8,
                                        max_rows=MAX_CHUNK_ELEMS // bf)
    n_chunks = max(1, triton.cdiv(max_len, rows))
    acc = acc_type(x.dtype)
    if n_chunks == 1:
        out = torch.empty((batch, n_cols), dtype=x.dtype, device=x.device)
    else:
        out = torch.empty((batch * n_chunks, n_cols), dtype=accumulate_dtype(x.dtype), device=x.device)
    _segment_sum_kernel[(batch * n_chunks * n_col_tiles,)](
        x, offsets, out, total, n_cols, n_chunks, rows, n_col_tiles, x.stride(0), x.stride(1),
        MEAN=mean and n_chunks == 1, ACC=acc, BLOCK_T=bt, BLOCK_F=bf)
    if n_chunks == 1:
        return out
    out = out.view(batch, n_chunks, n_cols).sum(1)
    if mean:
        out = out / (offsets[1:] - offsets[:-1]).to(out.dtype)[:, None]
    return out.to(x.dtype)


def broadcast_rows_triton(g: torch.Tensor, offsets: torch.Tensor, total: int, max_len: int, mean: bool, *,
                          block_t: int | None = None, block_f: int | None = None) -> torch.Tensor:
    """``(total, F)``: row r of sequence b is ``g[b]`` (``g[b] / L_b`` for mean); ``g`` is ``(B, F)``."""
    batch, n_cols = g.shape
    out = torch.empty((total, n_cols), dtype=g.dtype, device=g.device)
    if out.numel() == 0:
        return out
    bt, bf = copy_tiles(max_len, n_cols, g.element_size(), g.device)
    bt, bf = block_t or bt, block_f or bf
    n_row_tiles, n_col_tiles = triton.cdiv(max_len, bt), triton.cdiv(n_cols, bf)
    _broadcast_rows_kernel[(batch * n_row_tiles * n_col_tiles,)](
        g, offsets, out, total, n_cols, n_row_tiles, n_col_tiles, g.stride(0), g.stride(1), out.stride(0),
        MEAN=mean, ACC=acc_type(g.dtype), BLOCK_T=bt, BLOCK_F=bf)
    return out


def _sum_tiles(max_len: int, n_cols: int, elem_size: int, device: torch.device) -> tuple[int, int]:
    """GPU: 256 contiguous bytes of a row and 8K accumulators per program (an H100 sweep at bench/jagged_ops.py's
    shape: 78% of copy in bf16 and 93% in float32, against 58% and 86% with 4K). Interpreter: large tiles."""
    if device.type == "cuda":
        block_f = min(triton.next_power_of_2(n_cols), max(1, 256 // elem_size))
        return min(triton.next_power_of_2(max(max_len, 1)), max(1, 8192 // block_f)), block_f
    block_f = min(triton.next_power_of_2(n_cols), 1024)
    return min(triton.next_power_of_2(max(max_len, 1)), max(1, 65536 // block_f)), block_f


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
# shape from the fake implementation; the host ints stay symbolic, so new lengths don't recompile.
@torch.library.custom_op("varlen::segment_sum", mutates_args=())
def _segment_sum_op(x: Tensor, offsets: Tensor, max_len: int, mean: bool, backend: str) -> Tensor:
    if backend == "triton":
        return segment_sum_triton(x, offsets, max_len, mean)
    return segment_sum_torch(x, offsets, mean)


@_segment_sum_op.register_fake
def _(x, offsets, max_len, mean, backend):
    return x.new_empty((offsets.shape[0] - 1, x.shape[1]))


@torch.library.custom_op("varlen::broadcast_rows", mutates_args=())
def _broadcast_rows_op(g: Tensor, offsets: Tensor, total: int, max_len: int, mean: bool, backend: str) -> Tensor:
    if backend == "triton":
        return broadcast_rows_triton(g, offsets, total, max_len, mean)
    return broadcast_rows_torch(g, offsets, total, mean)


@_broadcast_rows_op.register_fake
def _(g, offsets, total, max_len, mean, backend):
    return g.new_empty((total, g.shape[1]))


# -------------------------------------------------------------------------------------- autograd
class _SegmentSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, offsets, max_len, mean, backend):
        out = _segment_sum_op(as_columns(values, 1), offsets, max_len, mean, backend)
        ctx.save_for_backward(offsets)
        ctx.total, ctx.max_len, ctx.mean, ctx.backend = values.shape[0], max_len, mean, backend
        return out.view(offsets.shape[0] - 1, *values.shape[1:])

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        dx = _BroadcastRows.apply(grad, offsets, ctx.total, ctx.max_len, ctx.mean, ctx.backend)
        return dx, None, None, None, None


class _BroadcastRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, offsets, total, max_len, mean, backend):
        out = _broadcast_rows_op(as_columns(g, 1), offsets, total, max_len, mean, backend)
        ctx.save_for_backward(offsets)
        ctx.max_len, ctx.mean, ctx.backend = max_len, mean, backend
        return out.view(total, *g.shape[1:])

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        return _SegmentSum.apply(grad, offsets, ctx.max_len, ctx.mean, ctx.backend), None, None, None, None, None


# ---------------------------------------------------------------------------------------- public
def _reduce_dims(x: JaggedTensor, dim) -> tuple[bool, list[int]]:
    """(whether the ragged dim is reduced, the inner dims reduced as dims of ``values``)."""
    dims = (dim,) if isinstance(dim, int) and not isinstance(dim, bool) else dim
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
    if not isinstance(keepdim, bool):
        raise TypeError(f"keepdim: expected a bool, got {type(keepdim).__name__} {keepdim!r}")
    ragged, inner = _reduce_dims(x, dim)
    values = x.values
    if inner:
        values = (values.mean if mean else values.sum)(dim=inner, keepdim=keepdim)
    if not ragged:
        return x.with_values(values)
    if not mean:
        (values,) = _amp.cast(_amp.FLOAT32, x.device, values)  # torch.sum's autocast rule (mean has none)
    backend = capabilities.resolve(x.device, values.dtype, "ragged", backend)
    out = _SegmentSum.apply(values, x.offsets, x.max_len, mean, backend)
    return out.unsqueeze(1) if keepdim else out


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
