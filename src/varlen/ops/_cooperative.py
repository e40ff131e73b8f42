"""The cooperative kernels' claim and wait (``softmax.py``'s Triton kernels, ``_softmax_gluon.py``'s Gluon one).

A cooperative program takes the next chunk in the order programs start (a claim counter), so the chunks of a
(sequence, column block) are taken one after another; it publishes its chunk's statistics and waits until every
chunk of the group has published. It never waits for a chunk that can't start while the GPU holds at least as many
programs as a group has chunks (``softmax.cooperative_max_chunks``).
"""

from __future__ import annotations

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
