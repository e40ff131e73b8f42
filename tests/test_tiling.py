"""The launchers' host helpers (varlen.tiling)."""

import triton

from varlen.tiling import cdiv, next_power_of_2, row_align


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
