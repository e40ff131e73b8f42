"""The launchers' host helpers (varlen.tiling)."""

import triton

from varlen.tiling import cdiv, next_power_of_2


def test_launch_integer_helpers_match_triton():
    # The launchers' plain-Python cdiv and next_power_of_2 (varlen.tiling) stand in for Triton's host wrappers.
    for n in range(0, 1100):
        assert next_power_of_2(n) == max(1, triton.next_power_of_2(n)), n  # (Triton's gives 0 for 0: no tile)
        for d in (1, 3, 16, 64, 1000):
            assert cdiv(n, d) == triton.cdiv(n, d), (n, d)
    assert next_power_of_2(2**40 + 1) == 2**41
