"""The 16-bit ragged-dim softmax forward with each chunk held in shared memory: a Gluon kernel for Hopper.

The cooperative path (``softmax.py``) has each program reduce one chunk of one sequence's rows, publish its
statistics, wait for the sequence's other chunks and write. Held in registers, a 16-bit chunk ran at 61% of copy
bandwidth at best; read twice (statistics, then the write), 63%, the second read coming from DRAM
(``bench/NOTES.md``). Here a program:

- claims its chunk (``_cooperative.claim_chunk``) and issues the TMA loads of all its tiles at once, one mbarrier per
  tile, so the whole chunk is in flight;
- reduces each tile as it lands: the tile's column max, then one exponential per element;
- publishes, waits for its group and combines the group's statistics in chunk order (``_cooperative.share_max_sum``);
- writes the chunk from shared memory, one more exponential per element.

x is read from DRAM once and no register holds the chunk. The statistics and exponentials are the Triton kernels'
(``_kernel_math``: ``exp(x - max)``, accurate at any magnitude). ``exp2(x log2(e) - max log2(e))``, one FMA instead
of a subtraction and a multiply, ran 1-1.5 points of copy bandwidth faster but put the rounding of ``max log2(e)`` in
every exponent: a column of -1e9 summed to 1e-11, and bf16 values past 2.4e38 overflowed to NaN (bench/NOTES.md).

Applies (:func:`applies`) on an sm_90 GPU with Gluon, to fp16 / bf16 values whose rows are contiguous and TMA-aligned
(16-byte base and row stride): the descriptor spans all rows x columns of ``x``; a tile past a sequence's end reads
the next sequence's rows, which the statistics mask out and the stores skip. Gluon does not run in the interpreter:
the GPU tests run every plan it takes.
"""

from __future__ import annotations

import torch

from .._backend import interpreter_enabled
from .._kernel_math import exp, merge_max_sum, reduce_max_sum
from .._launch import fast_launch
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
from ._cooperative import claim_chunk, share_max_sum

COLS = 64  # columns per chunk (a block of 128 bytes: the TMA box's row, one swizzle span)
MAX_CHUNK_BYTES = 128 * 1024  # of input per program (an H100 SM has 227 KiB of shared memory)

if HAVE_GLUON:
    @fast_launch
    @gluon.jit(do_not_specialize=["total", "n_chunks"])
    def _softmax_shared_kernel(x_desc, y, offsets, total, part_max, part_sum, tickets, n_cols, n_chunks, n_col_tiles,
                               stride_yr, CHUNK_ROWS: gl.constexpr, BLOCK_T: gl.constexpr, BLOCK_F: gl.constexpr,
                               SLICE: gl.constexpr, NUM_WARPS: gl.constexpr, ROW_ALIGN: gl.constexpr):
        # (rows of 40 columns: stores of 8 elements, not 1; varlen.tiling.row_align)
        n_cols = known_multiple(n_cols, ROW_ALIGN)
        stride_yr = known_multiple(stride_yr, ROW_ALIGN)
        N_TILES: gl.constexpr = CHUNK_ROWS // BLOCK_T
        dtype: gl.constexpr = x_desc.dtype
        # 16 bytes per thread along a row; the warps side by side along the columns, so the reductions over rows
        # stay inside a warp (no shared memory, no barrier per tile).
        VEC: gl.constexpr = 8
        ACROSS: gl.constexpr = BLOCK_F // VEC // NUM_WARPS
        layout: gl.constexpr = gl.BlockedLayout([1, VEC], [32 // ACROSS, ACROSS], [1, NUM_WARPS], [1, 0])
        row_layout: gl.constexpr = gl.SliceLayout(1, layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, layout)

        tiles = gl.allocate_shared_memory(dtype, [N_TILES, BLOCK_T, BLOCK_F],
                                          gl.NVMMASharedLayout.get_default_for([BLOCK_T, BLOCK_F], dtype))
        landed = gl.allocate_shared_memory(gl.int64, [N_TILES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(N_TILES):
            mbarrier.init(landed.index(i), count=1)
        fence_async_shared()

        b, col_tile, group, chunk, start, length, n_live = claim_chunk(tickets, offsets, total, n_chunks,
                                                                        n_col_tiles, CHUNK_ROWS)
        if chunk < n_live:
            lo = chunk.to(gl.int64) * CHUNK_ROWS
            hi = gl.minimum(lo + CHUNK_ROWS, length)
            n_tiles = ((hi - lo + BLOCK_T - 1) // BLOCK_T).to(gl.int32)
            col0 = col_tile * BLOCK_F
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


def applies(x: torch.Tensor) -> bool:
    """Whether the kernel takes ``x`` ``(total, F)`` here: Gluon on an sm_90 NVIDIA GPU (not the interpreter, not
    ROCm), fp16 or bf16, rows contiguous and TMA-aligned (16-byte base and row stride), fewer than 2**31 rows (TMA's
    int32 coordinates)."""
    if not HAVE_GLUON or interpreter_enabled() or x.device.type != "cuda" or torch.version.hip is not None:
        return False
    if x.dtype not in (torch.float16, torch.bfloat16) or x.stride(1) != 1 or x.shape[0] >= 2**31:
        return False
    return compute_capability(x.device)[0] == 9 and tma_aligned(x)


def launch(x, y, offsets, part_max, part_sum, tickets, n_chunks, n_col_tiles, plan, combine_slice) -> None:
    """Run the kernel with ``plan`` (a :class:`softmax.SoftmaxPlan` with ``shared``) on ``x`` where :func:`applies`;
    the partials and tickets as the cooperative Triton kernels take them."""
    if (plan.block_f != COLS or plan.block_t not in (16, 32, 64, 128, 256)
            or plan.chunk_rows % plan.block_t or plan.chunk_rows * COLS * x.element_size() > MAX_CHUNK_BYTES
            or plan.num_warps not in (1, 2, 4, 8)):
        raise ValueError(f"plan: a chunk held in shared memory takes blocks of {COLS} columns, "
                         f"block_t a power of 2 from 16 to 256 (a TMA box), chunk_rows a multiple of it of at most "
                         f"{MAX_CHUNK_BYTES} bytes of input, and 1, 2, 4 or 8 warps; got {plan}")
    if not applies(x):
        raise ValueError(f"plan: a chunk held in shared memory needs fp16/bf16 values of fewer than 2**31 rows, "
                         f"contiguous and 16-byte aligned, on an sm_90 NVIDIA GPU with Gluon; got {x.dtype} of shape "
                         f"{tuple(x.shape)} and strides {tuple(x.stride())} on {x.device}")
    total, n_cols = x.shape
    desc = TensorDescriptor(x, [total, n_cols], [x.stride(0), 1], [plan.block_t, COLS],
                            shared_layout((plan.block_t, COLS), x.dtype))
    grid = ((offsets.shape[0] - 1) * n_chunks * n_col_tiles,)
    _softmax_shared_kernel[grid](
        desc, y, offsets, total, part_max, part_sum, tickets, n_cols, n_chunks, n_col_tiles, y.stride(0),
        CHUNK_ROWS=plan.chunk_rows, BLOCK_T=plan.block_t, BLOCK_F=COLS, SLICE=combine_slice, NUM_WARPS=plan.num_warps,
        ROW_ALIGN=row_align(n_cols, y.stride(0)), num_warps=plan.num_warps)
