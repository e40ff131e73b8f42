"""Math shared by the Triton kernels: log2(e), ln(2), and ``exp`` through ``exp2``."""

from __future__ import annotations

from ._triton import tl, triton

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def exp(x):
    """``e ** x`` for float32 (and 16-bit) values as ``exp2(x * log2(e))``, exact ``exp`` for float64.

    ``tl.exp`` compiles to PTX's ``ex2.approx.f32``, which ptxas wraps in a range test and two predicated rescales
    to keep subnormal results: six instructions per element where ``tl.exp2`` gives ``ex2.approx.ftz.f32``, a
    multiply and one MUFU (the attention kernels' exponentials). The one difference: results below 2**-126
    (1.2e-38) are flushed to zero."""
    if x.dtype == tl.float64:
        return tl.exp(x)
    else:
        return tl.exp2(x * LOG2E)
