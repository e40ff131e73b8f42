"""Score modifiers shared by every attention kernel: softcap, bias, ALiBi, masking, dropout bits.

Scores are kept in log2 units (the kernels use ``exp2``): with ``LOG2E = log2(e)``,
``s2 = LOG2E * (softcap * tanh(scale * qk / softcap) + bias + alibi)`` (or ``LOG2E * scale * qk``
without softcap), then -inf where the (query, key) pair is hidden. ``rows``/``cols`` are broadcastable
tiles of in-sequence query and key positions, in either orientation (the dK/dV kernel works on
transposed, keys x queries, tiles).
"""

import triton
import triton.language as tl

from .masks import visible

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def tanh(x):
    """tanh through exp2, exact at both tails (no tanh instruction in every Triton build)."""
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * LOG2E)) + 1.0)


@triton.jit
def score_tile(qk, rows, cols, Lq, Lk, shift, WL, R, qk_scale, softcap_scale, softcap2,
               bias_bh, stride_bq, stride_bk, slope2,
               HAS_WL: tl.constexpr, HAS_R: tl.constexpr, MASKED: tl.constexpr, HAS_BIAS: tl.constexpr,
               HAS_ALIBI: tl.constexpr, SOFTCAP: tl.constexpr):
    """(log2-unit scores, tanh values) of a tile of raw ``qk`` products.

    The tanh values feed the softcap chain rule in the backward (``ds * (1 - t**2)``); without softcap
    the second result is unused. ``bias_bh`` points at ``bias[b, h]``; bias entries past Lq/Lk are not
    read (a jagged bias may hold anything there).
    """
    if SOFTCAP:
        t = tanh(qk * softcap_scale)
        s = t * softcap2
    else:
        t = qk
        s = qk * qk_scale
    if HAS_BIAS:
        in_seq = (rows < Lq) & (cols < Lk)
        bias = tl.load(bias_bh + rows.to(tl.int64) * stride_bq + cols.to(tl.int64) * stride_bk, mask=in_seq,
                       other=0.0)
        s += bias.to(tl.float32) * LOG2E
    if HAS_ALIBI:
        s -= slope2 * tl.abs(rows + shift - cols).to(tl.float32)
    if MASKED:
        s = tl.where(visible(rows, cols, Lq, Lk, shift, WL, R, HAS_WL, HAS_R), s, float("-inf"))
    return s, t


@triton.jit
def keep_tile(seed, offset_lo, threshold, bh, m0, n0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``[BLOCK_M, BLOCK_N]`` dropout keep bits of queries ``m0 + i`` and keys ``n0 + j`` (n0 a multiple
    of 8) of batch-head ``bh = b * H + h``: the definition in ``varlen.attention.dropout``.

    One Philox call per query and 8 keys gives four 32-bit words, that is eight 16-bit numbers, laid
    out so that key ``8 g + t`` takes word ``t >> 1``, half ``t & 1``.
    """
    G: tl.constexpr = BLOCK_N // 8
    i = m0 + tl.arange(0, BLOCK_M)[:, None]
    g = n0 // 8 + tl.arange(0, G)[None, :]
    zero = tl.zeros([BLOCK_M, G], dtype=tl.int32)
    r0, r1, r2, r3 = tl.philox(seed, i + zero, g + zero, bh + zero, offset_lo + zero)
    # join(join(r0, r2), join(r1, r3))[..., a, c] is word 2a + c: flattening the last two dims orders
    # the words 0..3; the halves then go innermost.
    words = tl.join(tl.join(r0, r2), tl.join(r1, r3))
    halves = tl.join(words & 0xFFFF, words >> 16)
    return tl.reshape(halves, [BLOCK_M, BLOCK_N]) >= threshold
