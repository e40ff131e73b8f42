"""Launch every ragged-dim softmax kernel variant an H100's plans select, on CPU tensors: a script for
``tools/compile_check.py``, which compiles each launch for sm_90 instead of running it.

    python tools/compile_check.py --verbose tools/jagged_variants.py

Covers bf16, fp16 and float32, forward and backward, at lengths of the ``single`` path (4 rows; 256, where the 16-bit
backward's tiles have rows of 64 bytes; 1024, float32's tiles of 16K elements), the
``cooperative`` path (tiles held in registers: float32 forward and every backward, the 16-bit one in tiles of 128
rows at 4096 and 256 at 12000; chunks held in shared memory by the Gluon kernels: the forward's 192 rows at 12000
and 512 at 33000, the backward's 128 rows at 4096 and 256 at 12000; the 16-bit forward's read twice where those
kernels don't take the input) and the ``split`` path, at 1024
columns as ``bench/jagged_ops.py`` and at 40, 3 and 1. The plans are those of a 132-SM GPU (``softmax_plan`` for a
CUDA device, its SM count stood in for). Then the ragged sum's kernels (one chunk per sequence and several) and the
padding copies' at the same widths, whose rows of 40 columns the kernels load 8 elements at a time (``ROW_ALIGN``), and
whose rows of 3 columns go as flat runs. Last, the softmax's narrow tiles (1-16 columns backward, one float32 column
forward) and the 32- and 64-bit forward's narrow chunks read twice (2-16 columns, one float64 column), in every float
dtype.
Outputs stay unwritten (nothing is run).
"""

import importlib

import torch

import varlen.tiling

softmax = importlib.import_module("varlen.ops.softmax")  # the module, not varlen.ops.softmax the function
softmax_gluon = importlib.import_module("varlen.ops._softmax_gluon")
reduce_ops = importlib.import_module("varlen.ops.reduce")
padding = importlib.import_module("varlen.padding")

# The plans are chosen for an H100; these tensors are CPU ones.
GPU = torch.device("cuda")
varlen.tiling.sm_count = softmax.sm_count = lambda device: 132
softmax_gluon.applies = lambda *xs: all(x.dtype in (torch.float16, torch.bfloat16, torch.float32)  # (CPU tensors)
                                        and x.shape[1] * x.element_size() % 16 == 0 for x in xs)
# The benchmark's width, and narrow ones (blocks of fewer than 64 columns, whose tiles scale their rows).
WIDTHS = (1024, 40, 3, 1)
# The softmax's narrow tiles (softmax.NARROW_BLOCK_T rows at most), and the 32- and 64-bit forward's narrow chunks
# read twice, in their first and second tiers (16 columns at 40,000 rows take the second; main() adds each width's
# first length past the first tier).
NARROW_WIDTHS = (1, 2, 4, 8, 16)
NARROW_LENGTHS = (12000, 40000)


def main():
    offsets = torch.tensor([0, 100, 4096])
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for n_cols in WIDTHS:
            x = torch.zeros(4096, n_cols, dtype=dtype)
            size = x.element_size()
            for max_len in (4, 256, 1024, 4096, 12000, 33000, 70000):
                aligned = softmax.rows_aligned(x)  # (as the launchers ask: 1024 columns are, 40, 3 and 1 aren't)
                fwd = softmax.softmax_plan(2, max_len, n_cols, size, GPU, aligned=aligned)
                fwd_shared = softmax.softmax_plan(2, max_len, n_cols, size, GPU, shared=softmax_gluon.applies(x),
                                                  aligned=aligned)
                bwd = softmax.softmax_plan(2, max_len, n_cols, size, GPU, inputs=2, aligned=aligned)
                bwd_shared = softmax.softmax_plan(2, max_len, n_cols, size, GPU, inputs=2,
                                                  shared=softmax_gluon.applies(x, x), aligned=aligned)
                print(f"{dtype} {n_cols} columns, max_len {max_len}: {fwd}, {fwd_shared}, {bwd}, {bwd_shared}",
                      flush=True)
                y = softmax.softmax_fwd_triton(x, offsets, max_len, fwd)
                if fwd_shared != fwd:
                    softmax.softmax_fwd_triton(x, offsets, max_len, fwd_shared)
                softmax.softmax_bwd_triton(y, x, offsets, max_len, bwd)
                if bwd_shared != bwd:
                    softmax.softmax_bwd_triton(y, x, offsets, max_len, bwd_shared)
            for max_len in (4, 4096, 70000):
                # (the launchers' tiles for a GPU: these tensors' own device would give the interpreter's)
                tiles = reduce_ops._sum_tiles(max_len, n_cols, size, GPU)
                n_col_tiles = -(-n_cols // tiles.block_f)
                rows = varlen.tiling.chunk_rows_for(max_len, 2 * n_col_tiles, tiles.block_t, GPU, waves=8,
                                                    max_rows=reduce_ops.MAX_CHUNK_ELEMS // tiles.block_f)
                width = min(max_len, 4096)
                copy_t, copy_f = varlen.tiling.copy_tiles(width, n_cols, size, GPU)
                print(f"{dtype} {n_cols} columns, max_len {max_len}: sum ({tiles}, {rows} rows per chunk), "
                      f"padding ({copy_t}, {copy_f})", flush=True)
                for mean in (False, True):
                    reduce_ops.segment_sum_triton(x, offsets, max_len, mean, block_t=tiles.block_t,
                                                  block_f=tiles.block_f, chunk_rows=rows, num_warps=tiles.num_warps,
                                                  stages=tiles.stages)
                    reduce_ops.broadcast_rows_triton(x[:2], offsets, 4096, max_len, mean, block_t=copy_t,
                                                     block_f=copy_f)
                # (rows of an odd number of elements take the flat runs, whose blocks don't depend on the device)
                tiles_or_flat = {} if padding._flat_rows(n_cols, n_cols) else dict(block_t=copy_t, block_f=copy_f)
                padded = padding._to_padded_triton(x, offsets, width, 0.0, **tiles_or_flat)
                padding._from_padded_triton(padded, offsets, 4096, width, **tiles_or_flat)
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        for n_cols in NARROW_WIDTHS:
            x = torch.zeros(4096, n_cols, dtype=dtype)
            # (and one row past the first tier's bound: the forward's narrow chunks read twice, doubled)
            first_tier = softmax.REREAD_NARROW_CHUNK_ELEMS // (1 << (n_cols - 1).bit_length())
            for max_len in (*NARROW_LENGTHS, softmax.cooperative_max_chunks(GPU) * first_tier + 1):
                fwd = softmax.softmax_plan(2, max_len, n_cols, x.element_size(), GPU, aligned=softmax.rows_aligned(x))
                bwd = softmax.softmax_plan(2, max_len, n_cols, x.element_size(), GPU, inputs=2,
                                           aligned=softmax.rows_aligned(x))
                print(f"{dtype} {n_cols} columns, max_len {max_len}: {fwd}, {bwd}", flush=True)
                y = softmax.softmax_fwd_triton(x, offsets, max_len, fwd)
                softmax.softmax_bwd_triton(y, x, offsets, max_len, bwd)


if __name__ == "__main__":
    main()
