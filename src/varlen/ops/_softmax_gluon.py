"""The ragged-dim softmax with each chunk held in shared memory: Gluon kernels for Hopper, forward and backward.

The cooperative path (``softmax.py``) has each program reduce one chunk of one sequence's rows, publish its
statistics, wait for the sequence's other chunks and write. Held in registers, a 16-bit forward chunk ran at 61% of
copy bandwidth at best; read twice (statistics, then the write), 63%, the second read coming from DRAM
(``bench/NOTES.md``). The backward held y and dy in registers: 68% on an H200 (bf16), whose bandwidth wants more
bytes in flight per SM than registers hold. Here a program:

- claims its chunk (``_cooperative.claim_chunk``) and issues the TMA loads of all its tiles at once (the backward's of
  y and dy together), one mbarrier per tile, so the whole chunk is in flight;
- reduces each tile as it lands: forward, the tile's column max, then one exponential per element; backward, the
  column sums of ``y * dy``;
- publishes, waits for its group and combines the group's statistics in chunk order (``_cooperative.share_max_sum``,
  ``share_sum``);
- writes the chunk from shared memory: ``exp(x - max) / sum`` (one more exponential per element), or
  ``y * (dy - sum)``.

The inputs are read from DRAM once and no register holds the chunk. The statistics and exponentials are the Triton
kernels' (``_kernel_math``: ``exp(x - max)``, accurate at any magnitude). ``exp2(x log2(e) - max log2(e))``, one FMA
instead of a subtraction and a multiply, ran 1-1.5 points of copy bandwidth faster but put the rounding of
``max log2(e)`` in every exponent: a column of -1e9 summed to 1e-11, and bf16 values past 2.4e38 overflowed to NaN
(bench/NOTES.md).

Applies (:func:`applies`) on an sm_90 GPU with Gluon, to fp16 / bf16 / float32 values whose rows are contiguous and
TMA-aligned (16-byte base and row stride): the descriptors span all rows x columns of each input; a tile past a
sequence's end reads the next sequence's rows, which the statistics mask out and the stores skip. Gluon does not run in
the interpreter: the GPU tests run every plan it takes.
"""

from __future__ import annotations

import torch

from .._backend import interpreter_enabled
from .._kernel_math import exp, merge_max_sum, reduce_max_sum
from .._launch import fast_launch
from .._triton import triton
from ..attn.gluon.common import (
    HAVE_GLUON,
    TensorDescriptor,
    fence_async_shared,
    gl,
    gluon,
    mbarrier,
    shared_layout,
    tma,
)
from ..attn.triton.configs import compute_capability
from ..attn.triton.launch import tma_aligned
from ..tiling import known_multiple, row_align
from ._cooperative import claim_chunk, share_max_sum, share_sum

ROW_BYTES = (128, 256)  # of a block's row: the TMA box's (one or two 128-byte swizzle spans)
MAX_CHUNK_BYTES = 128 * 1024  # of input per program, over its inputs (an H100 SM has 227 KiB of shared memory)
VECTOR_BYTES = 16  # per thread along a row: one 16-byte shared-memory load


if HAVE_GLUON:
    @triton.constexpr_function
    def _tile_layout(block_f, vec, num_warps):
        # vec elements (16 bytes) per thread along a row; the warps side by side along the columns, so the reductions
        # over rows stay inside a warp (no shared memory, no barrier per tile).
        across = block_f // vec // num_warps
        return gl.BlockedLayout([1, vec], [32 // across, across], [1, num_warps], [1, 0])

    @gluon.jit
    def _init_landed(N_TILES: gl.constexpr):
        landed = gl.allocate_shared_memory(gl.int64, [N_TILES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(N_TILES):
            mbarrier.init(landed.index(i), count=1)
        fence_async_shared()
        return landed

    @gluon.jit
    def _claim_rows(tickets, offsets, total, n_chunks, n_col_tiles, CHUNK_ROWS: gl.constexpr, BLOCK_T: gl.constexpr,
                    BLOCK_F: gl.constexpr):
        # The claimed chunk (_cooperative.claim_chunk), its rows [lo, hi) of its sequence in n_tiles tiles, and its
        # block's first column (a chunk past its sequence's end, chunk >= n_live, has none).
        b, col_tile, group, chunk, start, length, n_live = claim_chunk(tickets, offsets, total, n_chunks, n_col_tiles,
                                                                        CHUNK_ROWS)
        lo = chunk.to(gl.int64) * CHUNK_ROWS
        hi = gl.minimum(lo + CHUNK_ROWS, length)
        n_tiles = ((hi - lo + BLOCK_T - 1) // BLOCK_T).to(gl.int32)
        return b, group, chunk, start, n_live, lo, hi, n_tiles, col_tile * BLOCK_F

    @fast_launch
    @gluon.jit(do_not_specialize=["total", "n_chunks"])
    def _softmax_shared_kernel(x_desc, y, offsets, total, part_max, part_sum, tickets, n_cols, n_chunks, n_col_tiles,
                               stride_yr, CHUNK_ROWS: gl.constexpr, BLOCK_T: gl.constexpr, BLOCK_F: gl.constexpr,
                               SLICE: gl.constexpr, NUM_WARPS: gl.constexpr, ROW_ALIGN: gl.constexpr,
                               VEC: gl.constexpr):
        # (rows of 40 columns: stores of 8 elements, not 1; varlen.tiling.row_align)
        n_cols = known_multiple(n_cols, ROW_ALIGN)
        stride_yr = known_multiple(stride_yr, ROW_ALIGN)
        N_TILES: gl.constexpr = CHUNK_ROWS // BLOCK_T
        dtype: gl.constexpr = x_desc.dtype
        layout: gl.constexpr = _tile_layout(BLOCK_F, VEC, NUM_WARPS)
        row_layout: gl.constexpr = gl.SliceLayout(1, layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, layout)

        tiles = gl.allocate_shared_memory(dtype, [N_TILES, BLOCK_T, BLOCK_F],
                                          gl.NVMMASharedLayout.get_default_for([BLOCK_T, BLOCK_F], dtype))
        landed = _init_landed(N_TILES)

        b, group, chunk, start, n_live, lo, hi, n_tiles, col0 = _claim_rows(tickets, offsets, total, n_chunks,
                                                                             n_col_tiles, CHUNK_ROWS, BLOCK_T, BLOCK_F)
        if chunk < n_live:
            for t in range(n_tiles):
                mbarrier.expect(landed.index(t), BLOCK_T * BLOCK_F * dtype.primitive_bitwidth // 8)
                tma.async_copy_global_to_shared(x_desc, [(start + lo + t * BLOCK_T).to(gl.int32), col0],
                                                landed.index(t), tiles.index(t))
            cols = col0 + gl.arange(0, BLOCK_F, layout=col_layout)
            col_ok = cols < n_cols
            m = gl.full([BLOCK_F], float("-inf"), gl.float32, col_layout)
            s = gl.zeros([BLOCK_F], gl.float32, col_layout)
            for t in range(n_tiles):
                mbarrier.wait(landed.index(t), 0)
                rows = lo + t * BLOCK_T + gl.arange(0, BLOCK_T, layout=row_layout).to(gl.int64)
                # (past the chunk: rows of the next sequence, or zeros)
                v = gl.where((rows < hi)[:, None], tiles.index(t).load(layout).to(gl.float32), float("-inf"))
                m, s = merge_max_sum(m, s, *reduce_max_sum(v, 1.0))
            m, s = share_max_sum(m, s, part_max, part_sum, tickets, b, chunk, group, n_chunks, n_live, n_cols, cols,
                                 col_ok, gl.arange(0, SLICE, layout=row_layout))
            shift = gl.where(m == float("-inf"), 0.0, m)
            inv_s = 1.0 / s  # one division per column (a column all -inf: 1 / 0, and 0 * inf = NaN, as torch)
            for t in range(n_tiles):
                rows = lo + t * BLOCK_T + gl.arange(0, BLOCK_T, layout=row_layout).to(gl.int64)
                out = exp(tiles.index(t).load(layout).to(gl.float32) - shift[None, :]) * inv_s[None, :]
                gl.store(y + (start + rows)[:, None] * stride_yr + cols[None, :], out.to(dtype),
                         mask=(rows < hi)[:, None] & col_ok[None, :])
        for i in gl.static_range(N_TILES):
            mbarrier.invalidate(landed.index(i))

    @fast_launch
    @gluon.jit(do_not_specialize=["total", "n_chunks"])
    def _softmax_bwd_shared_kernel(y_desc, dy_desc, dx, offsets, total, part_dot, tickets, n_cols, n_chunks,
                                   n_col_tiles, stride_dxr, CHUNK_ROWS: gl.constexpr, BLOCK_T: gl.constexpr,
                                   BLOCK_F: gl.constexpr, SLICE: gl.constexpr, NUM_WARPS: gl.constexpr,
                                   ROW_ALIGN: gl.constexpr, VEC: gl.constexpr):
        # dx = y * (dy - sum_t y * dy): a chunk of y and dy in shared memory, each tile's products summed as it lands.
        n_cols = known_multiple(n_cols, ROW_ALIGN)
        stride_dxr = known_multiple(stride_dxr, ROW_ALIGN)
        N_TILES: gl.constexpr = CHUNK_ROWS // BLOCK_T
        dtype: gl.constexpr = y_desc.dtype
        layout: gl.constexpr = _tile_layout(BLOCK_F, VEC, NUM_WARPS)
        row_layout: gl.constexpr = gl.SliceLayout(1, layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, layout)

        smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_T, BLOCK_F], dtype)
        y_tiles = gl.allocate_shared_memory(dtype, [N_TILES, BLOCK_T, BLOCK_F], smem_layout)
        dy_tiles = gl.allocate_shared_memory(dtype, [N_TILES, BLOCK_T, BLOCK_F], smem_layout)
        landed = _init_landed(N_TILES)

        b, group, chunk, start, n_live, lo, hi, n_tiles, col0 = _claim_rows(tickets, offsets, total, n_chunks,
                                                                             n_col_tiles, CHUNK_ROWS, BLOCK_T, BLOCK_F)
        if chunk < n_live:
            for t in range(n_tiles):
                mbarrier.expect(landed.index(t), 2 * BLOCK_T * BLOCK_F * dtype.primitive_bitwidth // 8)
                row0 = (start + lo + t * BLOCK_T).to(gl.int32)
                tma.async_copy_global_to_shared(y_desc, [row0, col0], landed.index(t), y_tiles.index(t))
                tma.async_copy_global_to_shared(dy_desc, [row0, col0], landed.index(t), dy_tiles.index(t))
            cols = col0 + gl.arange(0, BLOCK_F, layout=col_layout)
            col_ok = cols < n_cols
            dot = gl.zeros([BLOCK_F], gl.float32, col_layout)
            for t in range(n_tiles):
                mbarrier.wait(landed.index(t), 0)
                rows = lo + t * BLOCK_T + gl.arange(0, BLOCK_T, layout=row_layout).to(gl.int64)
                # (past the chunk: rows of the next sequence, or zeros; a select, so their inf or NaN stays out)
                prod = y_tiles.index(t).load(layout).to(gl.float32) * dy_tiles.index(t).load(layout).to(gl.float32)
                dot += gl.sum(gl.where((rows < hi)[:, None], prod, 0.0), 0)
            dot = share_sum(dot, part_dot, tickets, b, chunk, group, n_chunks, n_live, n_cols, cols, col_ok,
                            gl.arange(0, SLICE, layout=row_layout))
            for t in range(n_tiles):
                rows = lo + t * BLOCK_T + gl.arange(0, BLOCK_T, layout=row_layout).to(gl.int64)
                out = y_tiles.index(t).load(layout).to(gl.float32) * (
                    dy_tiles.index(t).load(layout).to(gl.float32) - dot[None, :])
                gl.store(dx + (start + rows)[:, None] * stride_dxr + cols[None, :], out.to(dtype),
                         mask=(rows < hi)[:, None] & col_ok[None, :])
        for i in gl.static_range(N_TILES):
            mbarrier.invalidate(landed.index(i))


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these ``(total, F)`` tensors here (``x``; or ``y`` and ``dy``): Gluon on an sm_90
    NVIDIA GPU (not the interpreter, not ROCm), fp16, bf16 or float32 values of one dtype, rows contiguous and
    TMA-aligned (16-byte base and row stride), fewer than 2**31 rows (TMA's int32 coordinates)."""
    first = tensors[0]
    if not HAVE_GLUON or interpreter_enabled() or first.device.type != "cuda" or torch.version.hip is not None:
        return False
    for t in tensors:
        if (t.dtype not in (torch.float16, torch.bfloat16, torch.float32) or t.dtype != first.dtype
                or t.stride(1) != 1 or t.shape[0] >= 2**31):
            return False
    return compute_capability(first.device)[0] == 9 and tma_aligned(*tensors)


def _check(plan, inputs: tuple, elem_size: int) -> None:
    """ValueError unless the kernels take ``plan`` (a :class:`softmax.SoftmaxPlan` with ``shared``) for ``inputs``."""
    vec = VECTOR_BYTES // elem_size
    if (plan.block_f * elem_size not in ROW_BYTES or plan.block_t not in (16, 32, 64, 128, 256)
            or plan.chunk_rows % plan.block_t or len(inputs) * plan.chunk_rows * plan.block_f * elem_size
            > MAX_CHUNK_BYTES or plan.num_warps not in (1, 2, 4, 8) or plan.block_f // vec < plan.num_warps):
        raise ValueError(f"plan: a chunk held in shared memory takes blocks of {' or '.join(map(str, ROW_BYTES))} "
                         f"bytes of a row (block_f x the element size), block_t a power of 2 from 16 to 256 (a TMA "
                         f"box), chunk_rows a multiple of it of at most {MAX_CHUNK_BYTES} bytes over the inputs, and "
                         f"1, 2, 4 or 8 warps, each with {VECTOR_BYTES} bytes of a row per thread at least; got {plan} "
                         f"for {elem_size}-byte values")
    if not applies(*inputs):
        raise ValueError("plan: a chunk held in shared memory needs fp16/bf16/float32 values (one dtype) of fewer than "
                         "2**31 rows, contiguous and 16-byte aligned, on an sm_90 NVIDIA GPU with Gluon; got "
                         + ", ".join(f"{t.dtype} of shape {tuple(t.shape)} and strides {tuple(t.stride())}"
                                     for t in inputs) + f" on {inputs[0].device}")


def _descriptor(t: torch.Tensor, plan) -> TensorDescriptor:
    box = (plan.block_t, plan.block_f)
    return TensorDescriptor(t, list(t.shape), [t.stride(0), 1], list(box), shared_layout(box, t.dtype))


def launch(x, y, offsets, part_max, part_sum, tickets, n_chunks, n_col_tiles, plan, combine_slice) -> None:
    """Run the forward kernel with ``plan`` (a :class:`softmax.SoftmaxPlan` with ``shared``) on ``x`` where
    :func:`applies`; the partials and tickets as the cooperative Triton kernels take them."""
    _check(plan, (x,), x.element_size())
    grid = ((offsets.shape[0] - 1) * n_chunks * n_col_tiles,)
    _softmax_shared_kernel[grid](
        _descriptor(x, plan), y, offsets, x.shape[0], part_max, part_sum, tickets, x.shape[1], n_chunks, n_col_tiles,
        y.stride(0), CHUNK_ROWS=plan.chunk_rows, BLOCK_T=plan.block_t, BLOCK_F=plan.block_f, SLICE=combine_slice,
        NUM_WARPS=plan.num_warps, ROW_ALIGN=row_align(x.shape[1], y.stride(0)),
        VEC=VECTOR_BYTES // x.element_size(), num_warps=plan.num_warps)


def launch_backward(y, dy, dx, offsets, part_dot, tickets, n_chunks, n_col_tiles, plan, combine_slice) -> None:
    """Run the backward kernel with ``plan`` on ``y`` and ``dy`` where :func:`applies` (``dx``: the output); the
    partials (``part_dot``) and tickets as the cooperative Triton backward takes them."""
    _check(plan, (y, dy), y.element_size())
    grid = ((offsets.shape[0] - 1) * n_chunks * n_col_tiles,)
    _softmax_bwd_shared_kernel[grid](
        _descriptor(y, plan), _descriptor(dy, plan), dx, offsets, y.shape[0], part_dot, tickets, y.shape[1], n_chunks,
        n_col_tiles, dx.stride(0), CHUNK_ROWS=plan.chunk_rows, BLOCK_T=plan.block_t, BLOCK_F=plan.block_f,
        SLICE=combine_slice, NUM_WARPS=plan.num_warps, ROW_ALIGN=row_align(y.shape[1], dx.stride(0)),
        VEC=VECTOR_BYTES // y.element_size(), num_warps=plan.num_warps)
