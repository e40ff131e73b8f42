"""Which (query, key) pairs are visible, and which tiles need a mask at all.

Per sequence with lengths Lq, Lk and ``shift`` (0 top-left, Lk - Lq bottom-right), query i sees key j
iff ``j < Lk``, ``j <= i + shift + R`` (when HAS_R: causal and/or a right window, R >= 0) and
``j >= i + shift - WL`` (when HAS_WL). The kernels walk tiles in three stages: masked tiles at the
lower edge, tiles every element of which is visible (no mask arithmetic), masked tiles at the upper
edge; tiles outside the visible band are never visited.
"""

import triton
import triton.language as tl


@triton.jit
def seq_bounds(cu_ptr, b, seq_len, VARLEN: tl.constexpr):
    """(first row, length) of sequence b: from the offsets when VARLEN, else (0, seq_len)."""
    if VARLEN:
        start = tl.load(cu_ptr + b)
        end = tl.load(cu_ptr + b + 1)
        return start, end - start
    else:
        # b * 0: a tensor zero, so callers can cast it like the loaded offsets.
        return b * 0, seq_len


@triton.jit
def tile_stages(lo, hi, full_lo, full_hi, BLOCK: tl.constexpr):
    """Split the visible range [lo, hi) into BLOCK-aligned tiles: masked [t_lo, u_lo), unmasked
    [u_lo, u_hi), masked [u_hi, t_hi). ``[full_lo, full_hi)`` is where every element of the
    other axis's tile is visible. All inputs are clamped to >= 0 so integer division is exact."""
    lo = tl.maximum(lo, 0)
    t_lo = (lo // BLOCK) * BLOCK
    t_hi = tl.where(hi > lo, hi, t_lo)
    u_lo = tl.maximum(((tl.maximum(full_lo, 0) + BLOCK - 1) // BLOCK) * BLOCK, t_lo)
    u_hi = (tl.maximum(tl.minimum(full_hi, t_hi), 0) // BLOCK) * BLOCK
    empty = u_hi <= u_lo
    u_lo = tl.where(empty, t_lo, u_lo)
    u_hi = tl.where(empty, t_lo, u_hi)
    return t_lo, u_lo, u_hi, t_hi


@triton.jit
def key_stages(m0, Lq, Lk, shift, WL, R, HAS_WL: tl.constexpr, HAS_R: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tiles a block of queries [m0, m0 + BLOCK_M) must visit (see ``tile_stages``)."""
    i_first = m0
    i_last = tl.minimum(m0 + BLOCK_M, Lq) - 1
    lo = 0
    hi = Lk
    full_lo = 0
    full_hi = Lk
    if HAS_WL:
        lo = i_first + shift - WL
        full_lo = i_last + shift - WL
    if HAS_R:
        hi = tl.minimum(Lk, i_last + shift + R + 1)
        full_hi = tl.minimum(Lk, i_first + shift + R + 1)
    return tile_stages(lo, hi, full_lo, full_hi, BLOCK_N)


@triton.jit
def query_stages(n0, Lq, Lk, shift, WL, R, HAS_WL: tl.constexpr, HAS_R: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query tiles a block of keys [n0, n0 + BLOCK_N) must visit (see ``tile_stages``)."""
    j_first = n0
    j_last = tl.minimum(n0 + BLOCK_N, Lk) - 1
    lo = 0
    hi = Lq
    full_lo = 0
    full_hi = Lq
    if HAS_R:
        lo = j_first - shift - R
        full_lo = j_last - shift - R
    if HAS_WL:
        hi = tl.minimum(Lq, j_last - shift + WL + 1)
        full_hi = tl.minimum(Lq, j_first - shift + WL + 1)
    # A key block that runs past Lk needs the key mask on every tile.
    full_hi = tl.where(n0 + BLOCK_N <= Lk, full_hi, 0)
    return tile_stages(lo, hi, full_lo, full_hi, BLOCK_M)


@triton.jit
def visible(rows, cols, Lq, Lk, shift, WL, R, HAS_WL: tl.constexpr, HAS_R: tl.constexpr):
    """Boolean tile: query ``rows`` (in-sequence positions) sees key ``cols``; shapes broadcast."""
    ok = (rows < Lq) & (cols < Lk)
    if HAS_R:
        ok = ok & (cols <= rows + shift + R)
    if HAS_WL:
        ok = ok & (cols >= rows + shift - WL)
    return ok
