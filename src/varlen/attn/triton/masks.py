"""Which (query, key) pairs are visible: every mask of the attention kernels, each in one block below.

Positions are in-sequence: query i in ``[0, Lq)``, key j in ``[0, Lk)``, ``shift`` = 0 (top-left),
``Lk - Lq`` (bottom-right) or ``query_offset[b]`` (``POSITIONS``: query i sits at key position
``query_offset[b] + i``). The masks, each switched on by a flag of the ``Features`` constexpr:

- key padding (always): ``j < Lk``; rows ``i >= Lq`` of a tile are padding and see nothing.
- band (``HAS_R``, ``HAS_WL``): causal and/or a window, ``i + shift - WL <= j <= i + shift + R``.
- prefix (``PREFIX``): keys ``j < prefix_len[b]`` are visible to every query of sequence b as well (with a
  causal mask: a prefix-LM, bidirectional inside the prefix, causal after it).
- documents (``DOCS``, dense self-attention over packed rows): query and key must lie in the same
  document; ``doc_start``/``doc_end`` ``(B, S)`` hold each token's document as ``[first, last + 1)``.

Besides the per-element rule (:func:`visible`), each mask narrows the tiles a block must visit:
:func:`key_stages` (keys of a query block) and :func:`query_stages` (queries of a key block) return four
tile boundaries: masked tiles ``[t_lo, u_lo)``, tiles every element of which is visible ``[u_lo, u_hi)``
(no mask arithmetic), masked tiles ``[u_hi, t_hi)``; tiles outside are never visited.

Host side, :func:`mask_args` packs the masks' runtime values into the ``Mask`` bundle.
"""

import collections

from ..._triton import tl, triton

# Runtime values of the masks (host bundle): window sides (-1: unbounded), and the per-sequence prefix
# lengths and per-token document bounds (placeholder tensors when off).
Mask = collections.namedtuple("Mask", "window_left right prefix doc_start doc_end query_offset")
# The masks of one sequence (in-kernel): shift, window sides, prefix length, document-bound row pointers.
SeqMask = collections.namedtuple("SeqMask", "shift WL R P doc_start doc_end")


def mask_args(problem, opts, placeholder) -> Mask:
    """The ``Mask`` bundle of a call (``placeholder`` stands in for tensors a call doesn't have)."""
    docs = opts.documents
    return Mask(opts.window_left, opts.visible_right(),
                placeholder if opts.prefix_len is None else opts.prefix_len,
                placeholder if docs is None else docs[0], placeholder if docs is None else docs[1],
                placeholder if opts.query_offset is None else opts.query_offset)


@triton.jit
def seq_mask(mask: Mask, b, Lq, Lk, row_stride, F: tl.constexpr):
    """The masks of sequence b (``row_stride``: the documents' row length, the dense sequence length)."""
    if F.POSITIONS:
        shift = tl.load(mask.query_offset + b)
    elif F.BOTTOM_RIGHT:
        shift = Lk - Lq
    else:
        shift = Lk * 0
    P = tl.maximum(tl.load(mask.prefix + b), 0) if F.PREFIX else 0
    doc_start = mask.doc_start + b.to(tl.int64) * row_stride
    doc_end = mask.doc_end + b.to(tl.int64) * row_stride
    return SeqMask(shift, mask.window_left, mask.right, P, doc_start, doc_end)


@triton.jit
def visible(rows, cols, Lq, Lk, m: SeqMask, F: tl.constexpr):
    """Boolean tile: query ``rows`` (in-sequence positions) sees key ``cols``; shapes broadcast."""
    ok = (rows < Lq) & (cols < Lk)
    band = in_band(ok, rows, cols, m.shift, m.WL, m.R, F.HAS_R, F.HAS_WL)
    if F.PREFIX:
        band = band | (ok & (cols < m.P))
    if F.DOCS:
        same = tl.load(m.doc_start + rows, mask=rows < Lq, other=-1) == tl.load(m.doc_start + cols, mask=cols < Lk,
                                                                                other=-2)
        band = band & same
    return band


@triton.jit
def in_band(ok, rows, cols, shift, WL, R, HAS_R: tl.constexpr, HAS_WL: tl.constexpr):
    """``ok`` where key ``cols`` lies in query ``rows``'s band ``[rows + shift - WL, rows + shift + R]`` (a side
    only when its flag is on)."""
    if HAS_R:
        ok = ok & (cols <= rows + shift + R)
    if HAS_WL:
        ok = ok & (cols >= rows + shift - WL)
    return ok


@triton.jit
def tile_stages(lo, hi, full_lo, full_hi, BLOCK: tl.constexpr):
    """Split the visible range [lo, hi) into BLOCK-aligned tiles: masked [t_lo, u_lo), unmasked
    [u_lo, u_hi), masked [u_hi, t_hi). ``[full_lo, full_hi)`` is where every element of the other axis's
    tile is visible. All inputs are clamped to >= 0 so integer division is exact."""
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
def _within_documents(lo, hi, full_lo, full_hi, m: SeqMask, first, last):
    """The visible range ``[lo, hi)`` and fully visible range ``[full_lo, full_hi)`` of a block of rows
    ``first..last`` (queries or keys: documents are runs of rows, the same along both) cut to the documents
    of its first and last rows; every row sees the full range only when the block lies in one document."""
    first_doc = tl.load(m.doc_start + first)
    last_doc = tl.load(m.doc_start + last)
    lo = tl.maximum(lo, first_doc)
    hi = tl.minimum(hi, tl.load(m.doc_end + last))
    full_lo = tl.maximum(full_lo, last_doc)
    full_hi = tl.where(first_doc == last_doc, tl.minimum(full_hi, tl.load(m.doc_end + first)), full_lo)
    return lo, hi, full_lo, full_hi


@triton.jit
def band_keys(i_first, i_last, Lk, shift, WL, R, HAS_R: tl.constexpr, HAS_WL: tl.constexpr):
    """The keys queries ``i_first..i_last`` see under the key-padding and band masks: ``(lo, hi, full_lo,
    full_hi)``, the visible range ``[lo, hi)`` and the range every one of them sees ``[full_lo, full_hi)``."""
    lo = i_first * 0
    hi = Lk
    full_lo = lo
    full_hi = Lk
    if HAS_WL:
        lo = i_first + shift - WL
        full_lo = i_last + shift - WL
    if HAS_R:
        hi = tl.minimum(Lk, i_last + shift + R + 1)
        full_hi = tl.minimum(Lk, i_first + shift + R + 1)
    return lo, hi, full_lo, full_hi


@triton.jit
def key_stages(m0, Lq, Lk, m: SeqMask, F: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tiles a block of queries [m0, m0 + BLOCK_M) must visit (see ``tile_stages``)."""
    i_first = m0
    i_last = tl.minimum(m0 + BLOCK_M, Lq) - 1
    lo, hi, full_lo, full_hi = band_keys(i_first, i_last, Lk, m.shift, m.WL, m.R, F.HAS_R, F.HAS_WL)
    if F.PREFIX:
        # Keys [0, P) are seen by every query. The fully visible range must stay one interval: it takes the
        # prefix when the band's starts at or before it (no window, or a wide one), else the band's alone.
        P = tl.minimum(m.P, Lk)
        hi = tl.maximum(hi, P)
        full_hi = tl.where(full_lo <= P, tl.maximum(full_hi, P), full_hi)
        full_lo = tl.where(full_lo <= P, 0, full_lo)
        lo = tl.where(P > 0, 0, lo)
    if F.DOCS:
        lo, hi, full_lo, full_hi = _within_documents(lo, hi, full_lo, full_hi, m, i_first, i_last)
    return tile_stages(lo, hi, full_lo, full_hi, BLOCK_N)


@triton.jit
def key_blocks_after(n0, m0, Lq, Lk, shift, R, HAS_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Under no mask or a causal-like one (a right band, ``HAS_R``; no left window, prefix or documents), how many key
    blocks after the one at ``n0`` visit the query tile at ``m0`` (one that block visits): those whose first key a row
    of the tile sees. Without a band every block visits every tile. With one, block ``k`` visits the tiles from that of
    its first visible row, ``max(0, k BLOCK_N - shift - R)``, where that row is below ``Lq`` (:func:`query_stages`), so
    the tile's last block is the last ``k`` whose ``k BLOCK_N - shift - R`` is at most the tile's last row below
    ``Lq``. (The Gluon backward's deterministic dQ adds: their order.)"""
    last = (Lk + BLOCK_N - 1) // BLOCK_N - 1
    if HAS_R:
        last_row = tl.minimum(Lq - 1, m0 + BLOCK_M - 1)
        last = tl.minimum(last, (last_row + shift + R) // BLOCK_N)
    return last - n0 // BLOCK_N


@triton.jit
def query_stages(n0, Lq, Lk, m: SeqMask, F: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query tiles a block of keys [n0, n0 + BLOCK_N) must visit (see ``tile_stages``)."""
    j_first = n0
    j_last = tl.minimum(n0 + BLOCK_N, Lk) - 1
    lo = j_first * 0
    hi = Lq
    full_lo = lo
    full_hi = Lq
    if F.HAS_R:
        lo = j_first - m.shift - m.R
        full_lo = j_last - m.shift - m.R
    if F.HAS_WL:
        hi = tl.minimum(Lq, j_last - m.shift + m.WL + 1)
        full_hi = tl.minimum(Lq, j_first - m.shift + m.WL + 1)
    if F.PREFIX:
        # A key in the prefix is seen by every query; a block wholly inside it, by every query in full.
        in_prefix = j_first < m.P
        lo = tl.where(in_prefix, 0, lo)
        hi = tl.where(in_prefix, Lq, hi)
        whole = j_last < m.P
        full_lo = tl.where(whole, 0, full_lo)
        full_hi = tl.where(whole, Lq, full_hi)
    if F.DOCS:
        lo, hi, full_lo, full_hi = _within_documents(lo, hi, full_lo, full_hi, m, j_first, j_last)
    # A key block that runs past Lk needs the key mask on every tile.
    full_hi = tl.where(n0 + BLOCK_N <= Lk, full_hi, 0)
    return tile_stages(lo, hi, full_lo, full_hi, BLOCK_M)
