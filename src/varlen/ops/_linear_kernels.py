"""Triton kernels and launchers for the per-sequence products of ``varlen.ops.linear``.

Two kernels, each the other's backward building block (``linear.py`` glues them into autograd):

* grouped matmul: ``out[r] = x[r] @ w[seq(r)]`` for jagged ``x (total, K)`` and ``w (B, K, N)``;
* transposed matmul: ``out[b] = x_bᵀ y_b`` (a sum over sequence b's rows) for jagged ``x (total, K)``,
  ``y (total, N)`` sharing offsets, into dense ``(B, K, N)``.

Both take strides (no ``.contiguous()``), accumulate in fp32, use int64 pointer arithmetic, launch
once for the whole batch and size their grids from host ints only (``total``, ``B``, ``max_len``).
This module imports Triton: ``linear.py`` imports it only when the Triton path runs.

float32 precision follows PyTorch's own switch (``_amp.dot_precision``): TF32 when torch allows it for its
matmuls, else three-pass TF32 with about float32's accuracy. So the per-sequence path rounds like the dense
``values @ w`` path in the same process.
"""

from __future__ import annotations

import torch

from .._amp import dot_precision
from .._checks import check_ndim, check_rows
from .._launch import fast_launch
from .._triton import tl, triton
from ..offsets import sequence_bounds
from ..tiling import cdiv, chunk_rows_for, sequence_rows

# Grouped matmul tiles: BLOCK_M rows of one sequence x BLOCK_N output columns, K in BLOCK_K steps.
# A sequence of length L wastes at most BLOCK_M - 1 rows of its last tile.
GROUPED_BLOCK_M = 64
# Transposed matmul: a (BLOCK_K x BLOCK_N) tile of out[b], summed over BLOCK_R rows at a time.
TRANSPOSED_BLOCK_R = 64
TRANSPOSED_BLOCK_K = 64
TRANSPOSED_BLOCK_N = 64
# When the transposed matmul has too few programs to fill the GPU, long sequences are split into
# chunks of rows reduced by separate programs; a chunk gets at least this many rows, so that reading
# them outweighs writing and re-reading its fp32 partial tile.
MIN_ROWS_PER_CHUNK = 512


@fast_launch
@triton.jit(do_not_specialize=["B", "total"])
def _grouped_matmul_kernel(
    x_ptr, w_ptr, out_ptr, offsets_ptr, block_seq_ptr, block_row_ptr,
    B, total, K, N,
    stride_xm, stride_xk, stride_wb, stride_wk, stride_wn, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    # Program (i, j): rows [block_row[i], +BLOCK_M) of sequence block_seq[i], clipped to the
    # sequence's end, times columns [j*BLOCK_N, +BLOCK_N) of w[block_seq[i]].
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    seq = tl.load(block_seq_ptr + pid_m)
    if seq >= B:  # the grid is an upper bound on the number of row tiles; the rest are idle
        return
    row_start = tl.load(block_row_ptr + pid_m)
    seq_start, seq_len = sequence_rows(offsets_ptr, seq, total)
    row_end = seq_start + seq_len
    rows = row_start + tl.arange(0, BLOCK_M).to(tl.int64)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < row_end  # row_start lies in the (clamped) sequence: _row_blocks clamps as sequence_rows
    col_ok = cols < N
    x_rows = x_ptr + rows[:, None] * stride_xm
    w_cols = w_ptr + seq.to(tl.int64) * stride_wb + cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        ks = k_start + tl.arange(0, BLOCK_K).to(tl.int64)
        k_ok = ks < K
        a = tl.load(x_rows + ks[None, :] * stride_xk, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols + ks[:, None] * stride_wk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    out = out_ptr + rows[:, None] * stride_om + cols[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@fast_launch
@triton.jit(do_not_specialize=["total", "CHUNKS", "rows_per_chunk"])
def _transposed_matmul_kernel(
    x_ptr, y_ptr, out_ptr, offsets_ptr,
    total, K, N, CHUNKS, rows_per_chunk,
    stride_xm, stride_xk, stride_ym, stride_yn, stride_os, stride_ob, stride_ok, stride_on,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, INPUT_PRECISION: tl.constexpr,
):
    # Program (b * CHUNKS + c, i, j): out[c, b, i-th K tile, j-th N tile] = the sum of x[r]ᵀ y[r]
    # over rows r of chunk c of sequence b, i.e. [start + c*rows_per_chunk, +rows_per_chunk).
    # A chunk past the sequence's end writes zeros (so does an empty sequence).
    pid = tl.program_id(0)
    seq = pid // CHUNKS
    chunk = (pid % CHUNKS).to(tl.int64)
    seq_start, seq_len = sequence_rows(offsets_ptr, seq, total)
    seq_end = seq_start + seq_len
    lo = seq_start + chunk * rows_per_chunk
    hi = tl.minimum(seq_end, lo + rows_per_chunk)
    ks = tl.program_id(1).to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    cols = tl.program_id(2).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_ok = ks < K
    col_ok = cols < N
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for r_start in range(lo, hi, BLOCK_R):
        rows = r_start + tl.arange(0, BLOCK_R).to(tl.int64)
        row_ok = rows < hi
        # x's tile is loaded transposed, (BLOCK_K, BLOCK_R), straight from its strides.
        a = tl.load(x_ptr + rows[None, :] * stride_xm + ks[:, None] * stride_xk,
                    mask=k_ok[:, None] & row_ok[None, :], other=0.0)
        b = tl.load(y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn,
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    out = (out_ptr + chunk * stride_os + seq.to(tl.int64) * stride_ob
           + ks[:, None] * stride_ok + cols[None, :] * stride_on)
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=k_ok[:, None] & col_ok[None, :])


def _grouped_config(dtype: torch.dtype) -> dict:
    wide = dtype.itemsize == 2  # 16-bit tiles take half the shared memory of float32 ones
    return dict(BLOCK_M=GROUPED_BLOCK_M, BLOCK_N=128 if wide else 64, BLOCK_K=64 if wide else 32,
                num_warps=4, num_stages=3)


def _row_blocks(offsets: torch.Tensor, total: int, block_m: int,
                num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of ``num_blocks`` row tiles: its sequence (B when idle) and its first row. No sync.

    Sequence b (bounds clamped into the ``total`` rows, as the kernel clamps them) has ``cdiv(L_b, block_m)``
    tiles, numbered consecutively in sequence order; the host bound ``num_blocks = cdiv(total, block_m) + B``
    is >= their sum for valid offsets, and the rest are idle.
    """
    starts, lengths = sequence_bounds(offsets, total, total)
    tiles = (lengths + (block_m - 1)) // block_m
    tile_ends = torch.cumsum(tiles, 0)
    ids = torch.arange(num_blocks, device=offsets.device)
    seq = torch.searchsorted(tile_ends, ids, right=True)  # in [0, B]: B past the last tile
    first_tile = torch.cat([tile_ends - tiles, tile_ends[-1:]])  # (B + 1,), so idle ids index it too
    first_row = torch.cat([starts, starts[-1:]])[seq] + (ids - first_tile[seq]) * block_m
    return seq.to(torch.int32), first_row


def grouped_matmul(x: torch.Tensor, offsets: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``(total, N)``: row r of ``x (total, K)`` times ``w[b] (K, N)`` for its sequence b.

    One kernel launch over row tiles that each lie within one sequence (plus a few tiny torch ops on
    ``(B,)``/``(num_blocks,)`` tensors that map tiles to sequences on the device).
    """
    check_ndim("x", x, 2, "(total, K)")
    check_ndim("w", w, 3, "(B, K, N)")
    total, K = x.shape
    B, _, N = w.shape
    check_rows("w", w, offsets.shape[0] - 1, "one (K, N) matrix per sequence of offsets")
    if w.shape[1] != K:
        raise ValueError(f"w: expected (B, K, N) matrices with K = {K}, x's columns; got shape {tuple(w.shape)}")
    offsets = offsets.contiguous()  # (read at stride 1; a custom op's caller may pass a view)
    out = torch.empty((total, N), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    cfg = _grouped_config(x.dtype)
    num_blocks = cdiv(total, cfg["BLOCK_M"]) + B
    block_seq, block_row = _row_blocks(offsets, total, cfg["BLOCK_M"], num_blocks)
    grid = (num_blocks, cdiv(N, cfg["BLOCK_N"]))
    _grouped_matmul_kernel[grid](
        x, w, out, offsets, block_seq, block_row, B, total, K, N,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), w.stride(2), out.stride(0), out.stride(1),
        INPUT_PRECISION=dot_precision(x.dtype), **cfg,
    )
    return out


def transposed_matmul(x: torch.Tensor, y: torch.Tensor, offsets: torch.Tensor, max_len: int,
                      rows_per_chunk: int | None = None) -> torch.Tensor:
    """``(B, K, N)``: ``out[b] = x_bᵀ y_b`` for ``x (total, K)``, ``y (total, N)``. One main launch.

    A program per (sequence, K tile, N tile) loops over the sequence's rows. When that gives too few
    programs to fill the GPU (B, K and N small) and sequences are long (B = 1, K = N = 64 and a
    million rows would run on one SM), each sequence is cut into chunks of ``rows_per_chunk`` rows
    (a multiple of the row block; default from ``padded.chunk_rows_for``: whole sequences off the
    GPU) whose fp32 partial tiles are summed afterwards in a fixed order: deterministic, no atomics.
    Tests pass ``rows_per_chunk`` to cover the chunked path on the CPU.
    """
    check_ndim("x", x, 2, "(total, K)")
    check_ndim("y", y, 2, "(total, N)")
    K, N = x.shape[1], y.shape[1]
    B = offsets.shape[0] - 1
    check_rows("y", y, x.shape[0], "one per row of x")
    offsets = offsets.contiguous()  # (read at stride 1; a custom op's caller may pass a view)
    BR, BK, BN = TRANSPOSED_BLOCK_R, TRANSPOSED_BLOCK_K, TRANSPOSED_BLOCK_N
    grid_kn = (cdiv(K, BK), cdiv(N, BN))
    if rows_per_chunk is None:
        rows_per_chunk = chunk_rows_for(max_len, B * grid_kn[0] * grid_kn[1], BR, x.device, waves=2,
                                        min_tiles=MIN_ROWS_PER_CHUNK // BR)
    chunks = max(1, cdiv(max_len, rows_per_chunk))
    if chunks == 1:
        out = torch.empty((B, K, N), dtype=x.dtype, device=x.device)
        partial = out.unsqueeze(0)
    else:
        partial = torch.empty((chunks, B, K, N), dtype=torch.float32, device=x.device)
    if partial.numel() > 0:
        _transposed_matmul_kernel[(B * chunks, *grid_kn)](
            x, y, partial, offsets, x.shape[0], K, N, chunks, rows_per_chunk,
            x.stride(0), x.stride(1), y.stride(0), y.stride(1),
            partial.stride(0), partial.stride(1), partial.stride(2), partial.stride(3),
            BLOCK_R=BR, BLOCK_K=BK, BLOCK_N=BN, INPUT_PRECISION=dot_precision(x.dtype),
            num_warps=4, num_stages=3,
        )
    if chunks == 1:
        return out
    return partial.sum(0).to(x.dtype)
