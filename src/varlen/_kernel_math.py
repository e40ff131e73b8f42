"""Math shared by the Triton kernels: log2(e), ln(2), ``exp`` through ``exp2``, and the online max and sum of
exponentials (the softmax and cross-entropy kernels' statistics)."""

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


@triton.jit
def merge_max_sum(m, s, m_other, s_other):
    """Two running (max, sum of exp(x - max)) pairs as one, elementwise (``s_other`` 1.0: ``m_other`` is one more
    value). A slot with no finite max yet shifts by 0, so exp never sees -inf - -inf."""
    m_new = tl.maximum(m, m_other)
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    return m_new, s * exp(m - shift) + s_other * exp(m_other - shift)


@triton.jit
def lowest_like(t):
    """A tensor of ``t``'s shape and float dtype holding that dtype's lowest finite value: where
    :func:`add_to_max_sum`'s running maxima start."""
    if t.dtype == tl.float64:
        return tl.full(t.shape, -1.7976931348623157e308, t.dtype)
    else:
        return tl.full(t.shape, -3.4028234663852886e38, t.dtype)


@triton.jit
def add_to_max_sum(m, s, x):
    """One more value ``x`` in each running (max, sum of exp(x - max)) pair, elementwise, with one exponential where
    :func:`merge_max_sum` takes two: ``exp(-|x - m|)`` is the added term where ``x <= m`` and the old sum's rescale
    where ``x > m`` (the new term is then 1). ``m`` must never be -inf (start it at :func:`lowest_like`; a sum of 0
    then means no finite value yet), so that no per-element test is needed: an ``x`` of -inf adds 0. A slot that meets
    +inf keeps a sum of 1; :func:`reduce_max_sum` then gives NaN (inf - inf), as ``merge_max_sum``'s sums do."""
    e = exp(-tl.abs(x - m))
    return tl.maximum(m, x), tl.where(x > m, s * e + 1.0, s + e)


@triton.jit
def reduce_max_sum(m, s):
    """The running pairs of ``m``, ``s`` along their first axis as one: (max, sum of exp(x - max)); the max is -inf
    where no value was finite (the sum then 0; pairs started at :func:`lowest_like` hold a finite max there)."""
    top = tl.max(m, 0)
    shift = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(s * exp(m - tl.expand_dims(shift, 0)), 0)
    return tl.where(total == 0, float("-inf"), top), total
