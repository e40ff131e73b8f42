"""Rotary position embeddings (RoPE) of jagged tensors, positions counted within each sequence.

Each row is rotated by its position: the pairs ``(x[i], x[i + D/2])`` of the last dim (the "half" layout of
GPT-NeoX and Hugging Face's Llama) turn by ``position * base ** (-2 i / D)``. The angles are computed as
transformers' Llama computes them (float32 frequencies times float32 positions) and their cosines and sines
rounded to ``x``'s dtype, so a model ported from it computes the same rotation; float64 inputs take float64
angles (varlen's choice, for float64 references and gradcheck; transformers stays in float32).

The Triton kernel reads each row once and writes it once (the pairs of every head of a block of rows, both
halves; any row and head strides, so q and k can be views of one projection) and takes its angles in
registers; its backward is the same kernel turning the other way. The PyTorch path (CPU) is the same math
in torch ops, rounding each product to ``x``'s dtype as transformers does (the kernel rounds once). The
positions come from the device offsets, with no host sync: the kernel finds each row's sequence itself (a binary
search over the offsets, a few cached loads per row), where the PyTorch path computes them with torch ops
(``offsets.row_positions``: about seven small kernels per call).

A second kernel takes the cosines and sines from tables instead (:func:`rotate_with_tables`: transformers' own,
whatever rope type made them), for ``varlen.integrations.transformers_kernels``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import capabilities
from .._backend import gradient_op, through_custom_op
from .._checks import FLOAT_DTYPES, accumulate_dtype, check_dtype, check_real
from .._launch import fast_launch
from .._triton import tl, triton
from ..jagged import JaggedTensor, as_jagged
from ..offsets import row_positions
from ..tiling import acc_type, cdiv, known_multiple, last_dim_contiguous, next_power_of_2, row_align


# ------------------------------------------------------------------------------------ kernels
@triton.jit
def _turn_rows(x, out, rows, cos, sin, n_rows, n_heads, stride_xr, stride_xh, stride_or, stride_oh,
               ACC: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Both halves of ``rows`` x the program's BLOCK_H heads turned by ``cos``, ``sin`` (``[rows, 1, pairs]``)."""
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    pairs = tl.arange(0, BLOCK_HALF)
    mask = (rows < n_rows)[:, None, None] & (heads < n_heads)[None, :, None] & (pairs < HALF)[None, None, :]
    first = rows[:, None, None] * stride_xr + heads[None, :, None].to(tl.int64) * stride_xh + pairs[None, None, :]
    x1 = tl.load(x + first, mask=mask, other=0.0).to(ACC)
    x2 = tl.load(x + first + HALF, mask=mask, other=0.0).to(ACC)
    first = rows[:, None, None] * stride_or + heads[None, :, None].to(tl.int64) * stride_oh + pairs[None, None, :]
    tl.store(out + first, (x1 * cos - x2 * sin).to(out.dtype.element_ty), mask=mask)
    tl.store(out + first + HALF, (x2 * cos + x1 * sin).to(out.dtype.element_ty), mask=mask)


@triton.jit
def _positions_from_offsets(offsets, rows, n_seqs, n_steps, width):
    """Each row's position in its sequence: the row minus the first row of the sequence whose end is the first
    greater than the row (``offsets.segment_ids``' rule, by a binary search of ``n_steps`` = bit length of ``n_seqs``
    steps over the ends; rows past the last end go to the last sequence), clamped to ``[0, width - 1]`` as
    ``offsets.row_positions`` clamps them. Every load lies within the ``n_seqs + 1`` offsets, whatever they say
    (``n_seqs`` < 2**31: int32 indices)."""
    lo = tl.zeros(rows.shape, tl.int32)
    hi = tl.full(rows.shape, 0, tl.int32) + n_seqs
    for _ in range(n_steps):
        mid = lo + (hi - lo) // 2  # (torch's probe; (lo + hi) // 2 would wrap past 2**30 sequences)
        open_ = lo < hi
        right = open_ & (tl.load(offsets + 1 + mid, mask=open_, other=0).to(tl.int64) <= rows)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(open_ & ~right, mid, hi)
    seq = tl.maximum(tl.minimum(lo, n_seqs - 1), 0)
    start = tl.load(offsets + seq).to(tl.int64)
    return tl.minimum(tl.maximum(rows - start, 0), width - 1)


@fast_launch
@triton.jit(do_not_specialize=["n_rows", "n_seqs", "n_steps", "width"])
def _rotary_kernel(x, out, positions, inv_freq, n_rows, n_heads, stride_xr, stride_xh, stride_or, stride_oh,
                   n_seqs, n_steps, width, TURN: tl.constexpr, ACC: tl.constexpr, HALF: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   FROM_OFFSETS: tl.constexpr, ROW_ALIGN: tl.constexpr):
    # out[r, h] = x[r, h] turned by TURN (+1, or -1 for the backward) * position(r) * inv_freq: both halves
    # of BLOCK_R rows x BLOCK_H heads per program. position(r): positions[r], or with FROM_OFFSETS counted from
    # its sequence's first row (``positions`` then holds the n_seqs + 1 offsets).
    stride_xr = known_multiple(stride_xr, ROW_ALIGN)
    stride_xh = known_multiple(stride_xh, ROW_ALIGN)
    stride_or = known_multiple(stride_or, ROW_ALIGN)
    stride_oh = known_multiple(stride_oh, ROW_ALIGN)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    pairs = tl.arange(0, BLOCK_HALF)
    if FROM_OFFSETS:
        position = _positions_from_offsets(positions, rows, n_seqs, n_steps, width)
    else:
        position = tl.load(positions + rows, mask=rows < n_rows, other=0)
    angles = (position.to(ACC)[:, None] * tl.load(inv_freq + pairs, mask=pairs < HALF, other=0.0)[None, :])
    # Rounded to x's dtype, as transformers rounds its cos and sin tables.
    cos = tl.cos(angles).to(x.dtype.element_ty).to(ACC)[:, None, :]
    sin = (TURN * tl.sin(angles)).to(x.dtype.element_ty).to(ACC)[:, None, :]
    _turn_rows(x, out, rows, cos, sin, n_rows, n_heads, stride_xr, stride_xh, stride_or, stride_oh, ACC, HALF,
               BLOCK_H, BLOCK_HALF)


@fast_launch
@triton.jit(do_not_specialize=["n_rows"])
def _rotary_tables_kernel(x, out, cos_table, sin_table, n_rows, n_heads, stride_xr, stride_xh, stride_or, stride_oh,
                          stride_cr, stride_sr, TURN: tl.constexpr, ACC: tl.constexpr, HALF: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                          ROW_ALIGN: tl.constexpr):
    # As _rotary_kernel, the cosines and sines read from a row's first HALF entries of the tables (transformers'
    # tables: both halves of a row hold the same values).
    stride_xr = known_multiple(stride_xr, ROW_ALIGN)
    stride_xh = known_multiple(stride_xh, ROW_ALIGN)
    stride_or = known_multiple(stride_or, ROW_ALIGN)
    stride_oh = known_multiple(stride_oh, ROW_ALIGN)
    stride_cr = known_multiple(stride_cr, ROW_ALIGN)
    stride_sr = known_multiple(stride_sr, ROW_ALIGN)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)
    pairs = tl.arange(0, BLOCK_HALF)
    ok = (rows < n_rows)[:, None] & (pairs < HALF)[None, :]
    cos = tl.load(cos_table + rows[:, None] * stride_cr + pairs[None, :], mask=ok, other=0.0).to(ACC)[:, None, :]
    sin = (TURN * tl.load(sin_table + rows[:, None] * stride_sr + pairs[None, :], mask=ok, other=0.0).to(ACC))
    sin = sin[:, None, :]
    _turn_rows(x, out, rows, cos, sin, n_rows, n_heads, stride_xr, stride_xh, stride_or, stride_oh, ACC, HALF,
               BLOCK_H, BLOCK_HALF)


# ----------------------------------------------------------------------------------- launchers
# Elements (of both halves) one program turns: 4K (8K spilled at one head, where every element takes its own
# cosine and sine), 1K in float64 (libdevice's float64 cosine and sine take many registers).
_TILE_ELEMS = 4096
_TILE_ELEMS_FLOAT64 = 1024


def _launch(x: Tensor, turn: int, *table_strides: int) -> tuple[Tensor, Tensor, tuple[int, int], dict]:
    """``x`` with a unit last stride, its output, the grid and the tiles of a rotation of ``x`` ``(N, H, D)`` (whose
    ``ROW_ALIGN`` counts the tables' row strides too)."""
    n_rows, n_heads, dim = x.shape
    if dim % 2:
        raise ValueError(f"x: rotary embeddings turn pairs of the last dim, which must be even; got shape "
                         f"{tuple(x.shape)}")
    out = torch.empty((n_rows, n_heads, dim), dtype=x.dtype, device=x.device)
    x = last_dim_contiguous(x)
    half = dim // 2
    elems = _TILE_ELEMS_FLOAT64 if x.dtype == torch.float64 else _TILE_ELEMS
    block_half = next_power_of_2(half)
    block_h = min(next_power_of_2(n_heads), max(1, elems // (2 * block_half)))
    block_r = max(1, elems // (2 * block_half * block_h))
    tiles = dict(TURN=turn, ACC=acc_type(x.dtype), HALF=half, BLOCK_R=block_r, BLOCK_H=block_h, BLOCK_HALF=block_half,
                 ROW_ALIGN=row_align(half, *x.stride()[:2], *out.stride()[:2], *table_strides), num_warps=4)
    return x, out, (cdiv(n_rows, block_r), cdiv(n_heads, block_h)), tiles


def rotary_triton(x: Tensor, positions: Tensor, inv_freq: Tensor, turn: int, width: int = 0) -> Tensor:
    """``x`` ``(N, H, D)`` (any strides) turned by ``turn * position * inv_freq``: a new contiguous tensor. The
    positions as :func:`rotate` takes them (``width`` 0: ``positions[r]``; else offsets)."""
    if positions.dim() != 1 or (positions.shape[0] != x.shape[0] if width == 0 else positions.shape[0] == 0):
        what = "one position per row of x" if width == 0 else "offsets (width > 0): B + 1 >= 1 entries"
        raise ValueError(f"positions: expected a 1-D tensor of {what}; got shape {tuple(positions.shape)} for x of "
                         f"shape {tuple(x.shape)}")
    if inv_freq.dim() != 1 or inv_freq.shape[0] < x.shape[-1] // 2:
        raise ValueError(f"inv_freq: expected one frequency per pair of the last dim, at least {x.shape[-1] // 2}; "
                         f"got shape {tuple(inv_freq.shape)}")
    x, out, grid, tiles = _launch(x, turn)
    inv_freq = inv_freq.contiguous()  # (read at stride 1)
    if out.numel():
        n_seqs = positions.shape[0] - 1 if width > 0 else 0
        _rotary_kernel[grid](x, out, positions.contiguous(), inv_freq, x.shape[0], x.shape[1], x.stride(0), x.stride(1),
                             out.stride(0), out.stride(1), n_seqs, n_seqs.bit_length(), width,
                             FROM_OFFSETS=width > 0, **tiles)
    return out


def _check_tables(x: Tensor, cos: Tensor, sin: Tensor) -> None:
    """Tables of one row per row of ``x`` and at least ``D / 2`` entries, in ``x``'s dtype and on its device (what the
    tables kernel reads; the custom op can also be called directly)."""
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 2 or table.shape[0] != x.shape[0] or table.shape[1] < x.shape[-1] // 2:
            raise ValueError(f"{name}: expected a table of shape ({x.shape[0]}, >= {x.shape[-1] // 2}) for x of "
                             f"shape {tuple(x.shape)}; got {tuple(table.shape)}")
        if table.dtype != x.dtype or table.device != x.device:
            raise ValueError(f"{name}: expected x's dtype and device ({x.dtype}, {x.device}); got {table.dtype}, "
                             f"{table.device}")


def rotary_tables_triton(x: Tensor, cos: Tensor, sin: Tensor, turn: int) -> Tensor:
    """``x`` ``(N, H, D)`` (any strides) turned by the angles whose cosines and sines are the first ``D / 2`` entries
    of ``cos[r]`` and ``sin[r]`` (``(N, >= D / 2)``, unit last stride; ``turn`` -1: the other way): a new
    contiguous tensor."""
    if x.dim() != 3:
        raise ValueError(f"x: expected (N, H, D) rows, got shape {tuple(x.shape)}")
    _check_tables(x, cos, sin)
    cos, sin = last_dim_contiguous(cos), last_dim_contiguous(sin)  # (each row's entries read at stride 1)
    x, out, grid, tiles = _launch(x, turn, cos.stride(0), sin.stride(0))
    if out.numel():
        _rotary_tables_kernel[grid](x, out, cos, sin, x.shape[0], x.shape[1], x.stride(0), x.stride(1),
                                    out.stride(0), out.stride(1), cos.stride(0), sin.stride(0), **tiles)
    return out


def rotary_torch(x: Tensor, positions: Tensor, inv_freq: Tensor, turn: int) -> Tensor:
    """The same rotation in torch ops, each product rounded to ``x``'s dtype (as transformers' Llama); contiguous,
    as the kernel's (and the custom op's fake) result, whatever ``x``'s layout."""
    half = x.shape[-1] // 2
    angles = turn * positions.to(inv_freq.dtype)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    return (x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin).contiguous()


# ------------------------------------------------------------------------------------ custom op
# torch.compile sees the rotation as one opaque op with its output shape from the fake implementation. Eager
# calls run the implementation directly (varlen._backend.through_custom_op).
def _rotate(x: Tensor, positions: Tensor, inv_freq: Tensor, turn: int, backend: str, width: int) -> Tensor:
    if width < 0:
        raise ValueError(f"width: expected 0 (positions given per row) or the longest length (> 0, positions from the "
                         f"offsets); got {width}")
    if backend == "triton":
        return rotary_triton(x, positions, inv_freq, turn, width)
    if width > 0:
        positions = row_positions(positions, x.shape[0], width)[1]
    return rotary_torch(x, positions, inv_freq, turn)


_rotate_op = torch.library.custom_op("varlen::rotary", _rotate, mutates_args=())


@_rotate_op.register_fake
def _(x, positions, inv_freq, turn, backend, width):
    return x.new_empty(x.shape)


def _run_rotate(x: Tensor, positions: Tensor, inv_freq: Tensor, turn: int, backend: str, width: int) -> Tensor:
    return (_rotate_op if through_custom_op() else _rotate)(x, positions, inv_freq, turn, backend, width)


_rotate_tables_op = torch.library.custom_op("varlen::rotary_tables", rotary_tables_triton, mutates_args=())


@_rotate_tables_op.register_fake
def _(x, cos, sin, turn):
    return x.new_empty(x.shape)


def _run_rotate_tables(x: Tensor, cos: Tensor, sin: Tensor, turn: int) -> Tensor:
    return (_rotate_tables_op if through_custom_op() else rotary_tables_triton)(x, cos, sin, turn)


class _RotaryTables(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, turn):
        ctx.save_for_backward(cos, sin)
        ctx.turn = turn
        return _run_rotate_tables(x, cos, sin, turn)

    @staticmethod
    def backward(ctx, grad):
        # The transpose of a rotation turns the other way; no gradient for the tables (transformers makes them
        # without one).
        cos, sin = ctx.saved_tensors
        return gradient_op(_RotaryTables, _run_rotate_tables, grad, cos, sin, -ctx.turn), None, None, None


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, positions, inv_freq, turn, backend, width):
        ctx.save_for_backward(positions, inv_freq)
        ctx.turn, ctx.backend, ctx.width = turn, backend, width
        return _run_rotate(x, positions, inv_freq, turn, backend, width)

    @staticmethod
    def backward(ctx, grad):
        # The transpose of a rotation turns the other way.
        positions, inv_freq = ctx.saved_tensors
        dx = gradient_op(_Rotary, _run_rotate, grad, positions, inv_freq, -ctx.turn, ctx.backend, ctx.width)
        return dx, None, None, None, None, None


# ---------------------------------------------------------------------------------------- public
def rotate_with_tables(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x`` ``(N, ..., D)`` (``D`` even) rotated by the angles whose cosines and sines are in the first ``D / 2``
    entries of each row of ``cos``, ``sin`` ``(N, >= D / 2)`` in ``x``'s dtype (transformers' tables, whose halves
    are equal for every rope type: ``cat(freqs, freqs)``; without a gradient): the Triton kernel, for transformers'
    ``apply_rotary_pos_emb`` (``varlen.integrations.transformers_kernels``). Raises ValueError for an odd ``D`` or
    tables of another shape, dtype or device."""
    if x.dim() < 2 or x.shape[-1] % 2:
        raise ValueError(f"x: rotary embeddings turn pairs of the last dim, which must be even; got shape "
                         f"{tuple(x.shape)}")
    _check_tables(x, cos, sin)
    rows = x.reshape(x.shape[0], math.prod(x.shape[1:-1]), x.shape[-1])
    return _RotaryTables.apply(rows, last_dim_contiguous(cos), last_dim_contiguous(sin), 1).view(x.shape)


def check_rotary_base(base, name: str = "base") -> float:
    if not check_real(name, base) > 0:
        raise ValueError(f"{name}: expected a real number > 0 (the wavelength scale, e.g. 10000.0), got {base!r}")
    return float(base)


def rotate(x: Tensor, positions: Tensor, base: float, backend: str | None = None, width: int = 0) -> Tensor:
    """``x`` ``(N, ..., D)`` (``D`` even) rotated by each row's position: the op behind :func:`rotary` and the
    ``varlen.nn`` modules' dense inputs. ``width`` 0: ``positions`` ``(N,)`` (integers) holds them; ``width`` > 0:
    ``positions`` holds the ``B + 1`` offsets of the sequences the rows belong to, and each row's position is
    counted from its sequence's first row, clamped to ``width - 1`` (the longest length:
    ``offsets.row_positions``' rule)."""
    half = x.shape[-1] // 2
    exact = accumulate_dtype(x.dtype)
    inv_freq = 1.0 / base ** (torch.arange(0, half, device=x.device, dtype=exact) / half)
    backend = capabilities.resolve(x.device, x.dtype, "ragged", backend)
    # (N, heads, D): a view wherever the heads are one stride apart
    rows = x.reshape(x.shape[0], math.prod(x.shape[1:-1]), x.shape[-1])
    return _Rotary.apply(rows, positions, inv_freq, 1, backend, width).view(x.shape)


def rotary(x: JaggedTensor | Tensor, base: float = 10000.0, *, backend: str | None = None) -> JaggedTensor:
    """Rotary position embedding of a jagged ``(B, j, *inner, D)`` tensor, each row by its position inside
    its sequence (0 for each sequence's first row).

    Args:
        x: a JaggedTensor or a ``torch.nested`` jagged tensor, floating point, with at least one inner dim
            (typically ``(B, j, heads, head_dim)``); its last dim ``D`` even.
        base: the wavelength scale (``rope_theta`` in transformers' configs), > 0.
        backend: ``"auto"``, ``"triton"`` or ``"torch"`` (default: :func:`varlen.use_backend`'s).

    Returns a JaggedTensor with ``x``'s offsets, differentiable w.r.t. x. Raises TypeError for a non-jagged
    or non-float ``x`` or a non-real ``base``, ValueError for an odd or missing last dim or a ``base`` <= 0.
    """
    x = as_jagged(x, "x")
    check_dtype("x.values", x.values, FLOAT_DTYPES)
    base = check_rotary_base(base)
    if x.values.dim() < 2 or x.values.shape[-1] % 2:
        raise ValueError(f"x: rotary embeddings turn pairs of the last dim, which must be even; got inner shape "
                         f"{tuple(x.inner_shape)}")
    return x.with_values(rotate(x.values, x.offsets, base, backend, width=max(x.max_len, 1)))
