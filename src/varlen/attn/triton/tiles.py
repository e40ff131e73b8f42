"""Loading row tiles of one sequence's (rows x cols) matrix, by pointers or by TMA descriptors.

With ``TMA`` the sequence gets a device-side tensor descriptor whose shape ends at the sequence's
last row and at the head dim: reads past either come back as zeros without mask arithmetic, and no
tile ever reads a neighbouring sequence. Without it (the interpreter, unaligned strides), masked
pointer loads do the same.
"""

from ..._triton import tl, triton


@triton.jit
def rows_desc(base, n_rows, row_stride, COLS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
              TMA: tl.constexpr):
    """A descriptor over ``base[0:n_rows, 0:COLS]`` (TMA), or ``base`` itself for pointer loads."""
    if TMA:
        # A zero-row descriptor is not encodable; such a sequence has no tiles to load anyway.
        return tl.make_tensor_descriptor(base, shape=[tl.maximum(n_rows, 1), COLS], strides=[row_stride, 1],
                                         block_shape=[BLOCK_R, BLOCK_C])
    else:
        return base


@triton.jit
def load_rows(desc, r0, n_rows, row_stride, COLS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
              MASK_ROWS: tl.constexpr, TMA: tl.constexpr):
    """Rows ``[r0, r0 + BLOCK_R)`` x cols ``[0, BLOCK_C)``; zeros past ``n_rows`` (when MASK_ROWS) and
    past ``COLS``."""
    if TMA:
        return desc.load([r0, 0])
    else:
        rows = r0 + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_C)
        ptrs = desc + rows[:, None].to(tl.int64) * row_stride + cols[None, :]
        if MASK_ROWS:
            return tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < COLS), other=0.0)
        elif BLOCK_C != COLS:
            return tl.load(ptrs, mask=cols[None, :] < COLS, other=0.0)
        else:
            return tl.load(ptrs)


@triton.jit
def store_rows(base, r0, n_rows, row_stride, tile, COLS: tl.constexpr, BLOCK_R: tl.constexpr,
               BLOCK_C: tl.constexpr):
    """Store ``tile`` into rows ``[r0, r0 + BLOCK_R)`` x cols ``[0, BLOCK_C)`` of ``base``, rows below
    ``n_rows`` and cols below ``COLS`` only, cast to the destination's dtype."""
    rows = r0 + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    ptrs = base + rows[:, None].to(tl.int64) * row_stride + cols[None, :]
    tl.store(ptrs, tile.to(base.dtype.element_ty), mask=(rows[:, None] < n_rows) & (cols[None, :] < COLS))
