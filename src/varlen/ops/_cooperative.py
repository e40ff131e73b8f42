"""The cooperative kernels' claim, wait and combine (``softmax.py``'s Triton kernels, ``_softmax_gluon.py``'s Gluon
ones, which call these Triton helpers with tensors that carry their layouts).

A cooperative program takes the next chunk in the order programs start (a claim counter), so the chunks of a
(sequence, column block) are taken one after another; it publishes its chunk's statistics and waits until every
chunk of the group has published. It never waits for a chunk that can't start while the GPU holds at least as many
programs as a group has chunks (``softmax.cooperative_max_chunks``).
"""

from __future__ import annotations

from .._kernel_math import merge_max_sum, reduce_max_sum
from .._triton import tl, triton
from ..tiling import sequence_rows


@triton.jit
def claim_chunk(tickets, offsets, total, n_chunks, n_col_tiles, CHUNK_ROWS: tl.constexpr):
    """The chunk (``CHUNK_ROWS`` rows of one column block) a cooperative program takes, in the order programs
    start: the sequence b, the column tile, the group (b, column tile) whose chunks wait for each other, the
    chunk's index in it, the sequence's first row and length, and the number of chunks holding rows (at most
    ``n_chunks``: a sequence longer than the host's max_len, from wrong offsets, has no chunks past it)."""
    item = tl.atomic_add(tickets, 1)
    chunk = item % n_chunks
    group = item // n_chunks
    b = group // n_col_tiles
    start, length = sequence_rows(offsets, b, total)
    n_live = tl.minimum(tl.cdiv(length, CHUNK_ROWS), n_chunks).to(tl.int32)
    return b, group % n_col_tiles, group, chunk, start, length, n_live


@triton.jit
def wait_for_group(tickets, group, n_live):
    """Count this chunk's statistics as published (after every thread's stores: the barrier), then wait until
    all ``n_live`` chunks of the group have published theirs."""
    tl.debug_barrier()
    done = tl.atomic_add(tickets + 1 + group, 1) + 1
    while done < n_live:
        done = tl.atomic_add(tickets + 1 + group, 0)


@triton.jit
def _slice_max_sum(part_max, part_sum, first, c0, n_live, n_cols, cols, col_ok, slots):
    """The max and sum of exponentials per column of chunks ``c0 + slots`` (those below ``n_live``) of a group, from
    their partials, read from L2 (.cg: other SMs wrote them)."""
    c = c0 + slots
    idx = (first + c)[:, None] * n_cols + cols[None, :]
    ok = (c < n_live)[:, None] & col_ok[None, :]
    m = tl.load(part_max + idx, mask=ok, other=float("-inf"), cache_modifier=".cg")
    s = tl.load(part_sum + idx, mask=ok, other=0.0, cache_modifier=".cg")
    return reduce_max_sum(m, s)


@triton.jit
def share_max_sum(m, s, part_max, part_sum, tickets, b, chunk, group, n_chunks, n_live, n_cols, cols, col_ok, slots):
    """Publish this chunk's max and sum of exponentials per column (``part_max``, ``part_sum``: ``(B, n_chunks,
    n_cols)``), wait for the other chunks of its group, and return the sequence's: its ``n_live`` chunks' partials
    combined in chunk order (so every chunk gets the same), ``len(slots)`` chunks' partials per load (one load after
    another per chunk would wait out L2's latency ``n_live`` times). ``slots``: ``arange(0, SLICE)`` in the layout of
    the row axis of ``cols``' tiles (a Gluon kernel's carries one)."""
    first = b.to(tl.int64) * n_chunks
    idx = (first + chunk) * n_cols + cols
    tl.store(part_max + idx, m, mask=col_ok)
    tl.store(part_sum + idx, s, mask=col_ok)
    wait_for_group(tickets, group, n_live)
    m, s = _slice_max_sum(part_max, part_sum, first, 0, n_live, n_cols, cols, col_ok, slots)
    for c0 in range(slots.shape[0], n_live, slots.shape[0]):
        m, s = merge_max_sum(m, s, *_slice_max_sum(part_max, part_sum, first, c0, n_live, n_cols, cols, col_ok, slots))
    return m, s


@triton.jit
def _slice_sum(part, first, c0, n_live, n_cols, cols, col_ok, slots):
    """The sum per column of chunks ``c0 + slots``' partials (those below ``n_live``), as :func:`_slice_max_sum`."""
    c = c0 + slots
    ok = (c < n_live)[:, None] & col_ok[None, :]
    return tl.sum(tl.load(part + (first + c)[:, None] * n_cols + cols[None, :], mask=ok, other=0.0,
                          cache_modifier=".cg"), 0)


@triton.jit
def share_sum(dot, part_dot, tickets, b, chunk, group, n_chunks, n_live, n_cols, cols, col_ok, slots):
    """As :func:`share_max_sum` for one statistic, a sum per column (the backward's ``sum y * dy``): publish this
    chunk's ``dot`` (``part_dot``: ``(B, n_chunks, n_cols)``), wait for the group, and return the sum of its ``n_live``
    chunks' partials, added in chunk order, ``len(slots)`` per load."""
    first = b.to(tl.int64) * n_chunks
    tl.store(part_dot + (first + chunk) * n_cols + cols, dot, mask=col_ok)
    wait_for_group(tickets, group, n_live)
    total = _slice_sum(part_dot, first, 0, n_live, n_cols, cols, col_ok, slots)
    for c0 in range(slots.shape[0], n_live, slots.shape[0]):
        total += _slice_sum(part_dot, first, c0, n_live, n_cols, cols, col_ok, slots)
    return total
