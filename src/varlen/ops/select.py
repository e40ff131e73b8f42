"""Select one index along a dim of a jagged tensor: one sequence (batch dim), one position of every
sequence (ragged dim), or one inner index.

Along the ragged dim the Triton kernel gathers row ``offsets[b] + index`` (``offsets[b + 1] + index``
for a negative index) of every sequence b into a dense ``(B, F)`` tensor, one program per (block of
sequences, block of columns); its backward scatters the gradient rows back into zeros. The two are
each other's backward, so double backward works.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor
from torch.types import Number

from .._backend import gradient_op, through_custom_op
from .._checks import check_int, check_rows, normalize_dim
from .._launch import fast_launch
from .._triton import tl, triton
from ..jagged import JaggedTensor, as_jagged
from ..offsets import sequence_bounds
from ..padding import copy_backend
from ..tiling import as_columns, cdiv, copy_tiles, sequence_rows


# ------------------------------------------------------------------------------------ kernels
@triton.jit
def _positions(offsets, bs, batch, index, total, FROM_END: tl.constexpr):
    """For sequences ``bs``: the row of position ``index`` and whether that position exists (sequence
    bounds clamped into the ``total`` rows by ``tiling.sequence_rows``; ``bs`` past the batch read its last
    sequence's offsets and exist nowhere)."""
    b_ok = bs < batch
    start, length = sequence_rows(offsets, tl.minimum(bs, batch - 1), total)
    pos = length + index if FROM_END else tl.zeros_like(length) + index
    return start + pos, b_ok & (pos >= 0) & (pos < length)


@fast_launch
@triton.jit(do_not_specialize=["batch", "index", "total"])
def _gather_kernel(x, offsets, fill, out, batch, index, total, n_cols, n_col_tiles, stride_xr, stride_xc,
                   stride_ob, FROM_END: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_F: tl.constexpr):
    col_tile = tl.program_id(0) % n_col_tiles
    bs = (tl.program_id(0) // n_col_tiles).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    rows, ok = _positions(offsets, bs, batch, index, total, FROM_END)
    cols = (col_tile * BLOCK_F + tl.arange(0, BLOCK_F).to(tl.int64))[None, :]
    col_ok = cols < n_cols
    v = tl.load(x + rows[:, None] * stride_xr + cols * stride_xc, mask=ok[:, None] & col_ok)
    v = tl.where(ok[:, None], v, tl.load(fill))
    tl.store(out + bs[:, None] * stride_ob + cols, v, mask=(bs < batch)[:, None] & col_ok)


@fast_launch
@triton.jit(do_not_specialize=["batch", "index", "total"])
def _scatter_kernel(g, offsets, out, batch, index, total, n_cols, n_col_tiles, stride_gb, stride_gc, stride_or,
                    FROM_END: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_F: tl.constexpr):
    # out is zero-filled; only the selected rows are written (distinct rows: one per sequence).
    col_tile = tl.program_id(0) % n_col_tiles
    bs = (tl.program_id(0) // n_col_tiles).to(tl.int64) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    rows, ok = _positions(offsets, bs, batch, index, total, FROM_END)
    cols = (col_tile * BLOCK_F + tl.arange(0, BLOCK_F).to(tl.int64))[None, :]
    mask = ok[:, None] & (cols < n_cols)
    v = tl.load(g + bs[:, None] * stride_gb + cols * stride_gc, mask=mask)
    tl.store(out + rows[:, None] * stride_or + cols, v, mask=mask)


# ----------------------------------------------------------------------------------- launchers
def gather_triton(x: torch.Tensor, offsets: torch.Tensor, index: int, fill_value: float, *,
                  block_b: int | None = None, block_f: int | None = None) -> torch.Tensor:
    """``(B, F)``: row ``index`` of each sequence of ``x`` ``(total, F)``; ``fill_value`` where it has none.

    ``block_b``/``block_f`` override the tile (sequences x columns per program).
    """
    batch, n_cols = offsets.shape[0] - 1, x.shape[1]
    offsets = offsets.contiguous()  # (read at stride 1; a custom op's caller may pass a view)
    out = torch.empty((batch, n_cols), dtype=x.dtype, device=x.device)
    fill = torch.full((), fill_value, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    if x.shape[0] == 0:
        return out.fill_(fill_value)
    xs, o, fill = as_columns(x, 1), as_columns(out, 1), as_columns(fill, 0)
    bb, bf = copy_tiles(batch, n_cols, x.element_size(), x.device)
    bb, bf = block_b or bb, block_f or bf
    n_col_tiles = cdiv(n_cols, bf)
    _gather_kernel[(cdiv(batch, bb) * n_col_tiles,)](
        xs, offsets, fill, o, batch, index, xs.shape[0], n_cols, n_col_tiles, xs.stride(0), xs.stride(1),
        o.stride(0), FROM_END=index < 0, BLOCK_B=bb, BLOCK_F=bf)
    return out


def scatter_triton(g: torch.Tensor, offsets: torch.Tensor, total: int, index: int, *,
                   block_b: int | None = None, block_f: int | None = None) -> torch.Tensor:
    """``(total, F)`` zeros except row ``index`` of each sequence, which holds ``g[b]``."""
    batch, n_cols = g.shape
    check_rows("g", g, offsets.shape[0] - 1, "one per sequence of offsets")
    offsets = offsets.contiguous()  # (read at stride 1)
    out = torch.zeros((total, n_cols), dtype=g.dtype, device=g.device)
    if out.numel() == 0:
        return out
    gs, o = as_columns(g, 1), as_columns(out, 1)
    bb, bf = copy_tiles(batch, n_cols, g.element_size(), g.device)
    bb, bf = block_b or bb, block_f or bf
    n_col_tiles = cdiv(n_cols, bf)
    _scatter_kernel[(cdiv(batch, bb) * n_col_tiles,)](
        gs, offsets, o, batch, index, total, n_cols, n_col_tiles, gs.stride(0), gs.stride(1), o.stride(0),
        FROM_END=index < 0, BLOCK_B=bb, BLOCK_F=bf)
    return out


def _positions_torch(offsets: torch.Tensor, total: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of position ``index`` of every sequence (clamped into range) and whether each exists."""
    start, length = sequence_bounds(offsets, total, total)
    pos = length + index if index < 0 else torch.full_like(start, index)
    ok = (pos >= 0) & (pos < length)
    return (start + pos).clamp(0, max(total - 1, 0)), ok


def gather_torch(x: torch.Tensor, offsets: torch.Tensor, index: int, fill_value: float) -> torch.Tensor:
    batch, n_cols = offsets.shape[0] - 1, x.shape[1]
    if x.shape[0] == 0:
        return x.new_full((batch, n_cols), fill_value)
    rows, ok = _positions_torch(offsets, x.shape[0], index)
    return torch.where(ok[:, None], x[rows], x.new_full((), fill_value))


def scatter_torch(g: torch.Tensor, offsets: torch.Tensor, total: int, index: int) -> torch.Tensor:
    out = g.new_zeros((total, g.shape[1]))
    if total == 0:
        return out
    rows, ok = _positions_torch(offsets, total, index)
    # A missing position's clamped row may belong to another sequence: it receives an exact 0.
    return out.index_add_(0, rows, torch.where(ok[:, None], g, 0))


# ------------------------------------------------------------------------------------ custom ops
# torch.compile sees each step as one opaque op (whatever the backend launches inside), with its output
# shape from the fake implementation; the host ints stay symbolic, so new lengths don't recompile. Eager calls
# run the implementations directly (varlen._backend.through_custom_op).
def _gather(x: Tensor, offsets: Tensor, index: int, fill_value: Number, backend: str) -> Tensor:
    gather = gather_triton if backend == "triton" else gather_torch
    return gather(x, offsets, index, fill_value)


def _scatter(g: Tensor, offsets: Tensor, total: int, index: int, backend: str) -> Tensor:
    scatter = scatter_triton if backend == "triton" else scatter_torch
    return scatter(g, offsets, total, index)


_gather_op = torch.library.custom_op("varlen::gather_position", _gather, mutates_args=())
_scatter_op = torch.library.custom_op("varlen::scatter_position", _scatter, mutates_args=())


@_gather_op.register_fake
def _(x, offsets, index, fill_value, backend):
    return x.new_empty((offsets.shape[0] - 1, x.shape[1]))


@_scatter_op.register_fake
def _(g, offsets, total, index, backend):
    return g.new_empty((total, g.shape[1]))


def _run_gather(values: Tensor, offsets: Tensor, index: int, fill_value: float, backend: str) -> Tensor:
    gather = _gather_op if through_custom_op() else _gather
    out = gather(as_columns(values, 1), offsets, index, fill_value, backend)
    return out.view(offsets.shape[0] - 1, *values.shape[1:])


def _run_scatter(g: Tensor, offsets: Tensor, total: int, index: int, backend: str) -> Tensor:
    scatter = _scatter_op if through_custom_op() else _scatter
    return scatter(as_columns(g, 1), offsets, total, index, backend).view(total, *g.shape[1:])


# -------------------------------------------------------------------------------------- autograd
class _GatherPosition(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, offsets, index, fill_value, backend):
        ctx.save_for_backward(offsets)
        ctx.total, ctx.index, ctx.backend = values.shape[0], index, backend
        return _run_gather(values, offsets, index, fill_value, backend)

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        dx = gradient_op(_ScatterPosition, _run_scatter, grad, offsets, ctx.total, ctx.index, ctx.backend)
        return dx, None, None, None, None


class _ScatterPosition(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, offsets, total, index, backend):
        ctx.save_for_backward(offsets)
        ctx.index, ctx.backend = index, backend
        return _run_scatter(g, offsets, total, index, backend)

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        dg = gradient_op(_GatherPosition, _run_gather, grad, offsets, ctx.index, 0.0, ctx.backend)
        return dg, None, None, None, None


# ---------------------------------------------------------------------------------------- public
def _check_position(x: JaggedTensor, index: int) -> None:
    """Raise ValueError unless every sequence has position ``index`` (uses the host offsets)."""
    host = x.host_offsets()
    lengths = host[1:] - host[:-1]
    bad = (index >= lengths) if index >= 0 else (-index > lengths)
    if bool(bad.any()):
        b = int(bad.nonzero()[0, 0])
        raise ValueError(f"index: {index} is out of range for sequence {b} of length {int(lengths[b])} "
                         f"(the shortest sequence has length {int(lengths.min())}); pass fill_value=... "
                         "to fill the positions that don't exist instead")


def select(x: JaggedTensor | torch.Tensor, dim: int, index: int, *, fill_value: float | None = None,
           backend: str | None = None) -> torch.Tensor | JaggedTensor:
    """Select ``index`` along ``dim`` of a jagged ``(B, j, *inner)`` tensor, as ``Tensor.select``.

    Args:
        x: a JaggedTensor (or a ``torch.nested`` jagged tensor); any dtype (gradients for floats).
        dim: 0: sequence ``index`` as a dense ``(L_index, *inner)`` tensor, a view of ``x.values``.
            1 (the ragged dim): position ``index`` of every sequence as a dense ``(B, *inner)``
            tensor; a negative index counts from each sequence's own end (-1 is its last element).
            >= 2 (or negative): an inner index, giving a JaggedTensor with ``x``'s offsets.
        index: an int; for dim 0 and the inner dims in ``[-size, size)``.
        fill_value: dim 1 only. None (default): every sequence must have position ``index``, else
            ValueError naming the first one that doesn't. The check reads the host copy of the
            offsets: free when ``x`` carries it (tensors from ``varlen.jagged``, ``from_padded`` with
            host lengths, and ops derived from them), else one device-to-host copy, cached on ``x``.
            A number: no check and no host sync ever (for graphs and hot loops): sequences without
            position ``index`` get ``fill_value`` in the output, and no gradient.
        backend: ``"auto"``, ``"triton"`` or ``"torch"``; None (default): the enclosing
            ``varlen.use_backend``'s choice (see ``varlen.capabilities.JAGGED_KERNELS``).

    Dim 0 reads the host offsets too (the slice bounds are a shape): free when cached, else one
    device-to-host copy, cached on ``x``.

    Raises ValueError for ``dim`` or ``index`` out of range, ``fill_value`` with a dim other than 1;
    TypeError for a non-jagged ``x``, a non-int ``dim``/``index`` or a non-number ``fill_value``.
    """
    x = as_jagged(x, "x")
    d = normalize_dim("dim", dim, x.dim())
    index = check_int("index", index)
    if fill_value is not None:
        if isinstance(fill_value, bool) or not isinstance(fill_value, numbers.Real):
            raise TypeError(f"fill_value: expected a real number or None, got {type(fill_value).__name__} "
                            f"{fill_value!r}")
        if d != 1:
            raise ValueError(f"fill_value: only applies to dim=1 (the ragged dim), got dim={dim}")
    if d == 0:
        if not -x.batch_size <= index < x.batch_size:
            raise ValueError(f"index: {index} is out of range for the batch dim of size {x.batch_size} "
                             f"(allowed: {-x.batch_size} to {x.batch_size - 1})")
        host = x.host_offsets()
        b = index % x.batch_size
        return x.values[int(host[b]):int(host[b + 1])]
    if d >= 2:
        size = x.values.shape[d - 1]
        if not -size <= index < size:
            raise ValueError(f"index: {index} is out of range for dim {dim} of size {size} "
                             f"(allowed: {-size} to {size - 1})")
        return x.with_values(x.values.select(d - 1, index))
    if fill_value is None:
        _check_position(x, index)
    fill = 0 if fill_value is None else fill_value
    return _GatherPosition.apply(x.values, x.offsets, index, fill, copy_backend(x.values, backend))
