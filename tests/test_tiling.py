"""The launchers' host helpers (varlen.tiling)."""

import importlib

import torch
import triton

from varlen.tiling import COPY_MAX_ROWS, cdiv, copy_tiles, next_power_of_2, row_align

reduce_ops = importlib.import_module("varlen.ops.reduce")
GPU = torch.device("cuda")  # (a device object only: the tile rules read its type, nothing runs on it)
# Longest sequences (or batch sizes) a stream of batches may bring: every power of two and its neighbours up to 2**17,
# every length below 300, and a few far past.
STREAM_LENGTHS = sorted({n for p in range(18) for n in (2**p - 1, 2**p, 2**p + 1)} | set(range(300))
                        | {70_000, 250_000})


def test_launch_integer_helpers_match_triton():
    # The launchers' plain-Python cdiv and next_power_of_2 (varlen.tiling) stand in for Triton's host wrappers.
    for n in range(0, 1100):
        assert next_power_of_2(n) == max(1, triton.next_power_of_2(n)), n  # (Triton's gives 0 for 0: no tile)
        for d in (1, 3, 16, 64, 1000):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
    assert next_power_of_2(2**40 + 1) == 2**41


def test_row_align_is_the_power_of_two_every_row_shares():
    # ROW_ALIGN divides the column count and every row stride (so (n // ROW_ALIGN) * ROW_ALIGN is n itself), at most
    # 16 (Triton already knows multiples of 16); strides of 0 (broadcast rows) constrain nothing.
    assert row_align(40, 40) == 8
    assert row_align(40, 44) == 4  # 40 columns of rows 44 apart
    assert row_align(40, 40, 60) == 4
    assert row_align(20, 20) == 4
    assert row_align(3, 3) == 1
    assert row_align(40, 0) == 8
    assert row_align(1024, 1024, 2048) == 16
    assert row_align(96, 96) == 16  # 32 divides 96: capped
    for n in range(1, 200):
        for stride in (n, n + 1, 2 * n, 0):
            align = row_align(n, stride)
            assert n % align == 0 and stride % align == 0 and align <= 16
            assert align == 16 or n % (2 * align) or stride % (2 * align), (n, stride)


def test_gpu_tiles_of_narrow_rows_stop_at_a_fixed_row_count():
    # One or two columns used to take a tile of up to 8,192 rows, a power of two of the longest sequence: one program
    # per long sequence, and a kernel variant per power of two of max_len up to there. Now the rows stop at
    # COPY_MAX_ROWS (copies) and SUM_MAX_ROWS (sums); shorter sequences keep tiles that fit them (a tile of mostly
    # masked rows ran 2-4x slower), and wide rows keep their ~16 KB tiles.
    for size in (2, 4):
        for n_cols in (1, 2):
            for n_rows in (4096, 5000, 100_000):
                assert copy_tiles(n_rows, n_cols, size, GPU) == (COPY_MAX_ROWS, n_cols)
                assert reduce_ops._sum_tiles(n_rows, n_cols, size, GPU).block_t == reduce_ops.SUM_MAX_ROWS
            assert copy_tiles(300, n_cols, size, GPU) == (512, n_cols)
            assert reduce_ops._sum_tiles(300, n_cols, size, GPU).block_t == 512
            assert copy_tiles(17, n_cols, size, GPU)[0] == reduce_ops._sum_tiles(17, n_cols, size, GPU).block_t == 32
    assert copy_tiles(100_000, 1024, 2, GPU) == (32, 256)
    assert reduce_ops._sum_tiles(100_000, 1024, 2, GPU)[:2] == (64, 128)
    assert copy_tiles(100_000, 1, 2, torch.device("cpu"))[0] == 65536  # (the interpreter's tiles: per-program cost)


def test_gpu_tiles_take_a_bounded_number_of_variants_over_any_batch():
    # The tiles follow the longest sequence in powers of two (tiles that don't ran 2-30x slower at short sequences),
    # so a stream of batches compiles a variant per power of two it meets, at most 11 for the copies (1 to 1,024 rows)
    # and 10 for the sums (1 to 512), per width and dtype: the README's bound.
    for n_cols in (1, 2, 3, 16, 40, 1024):
        for size in (2, 4, 8):
            assert len({copy_tiles(n, n_cols, size, GPU) for n in STREAM_LENGTHS}) <= 11, (n_cols, size)
            assert len({reduce_ops._sum_tiles(n, n_cols, size, GPU) for n in STREAM_LENGTHS}) <= 10, (n_cols, size)
