"""Which query rows each rank owns: the context-parallel plan, computed once on the host from the lengths.

A plan gives each rank a list of *pieces*: query rows ``[start, end)`` of one sequence. Every rank holds the
same plan (it is a pure function of the lengths and the world size), so no communication is needed to
agree on it.

- ``balance="causal"``: under a causal mask a sequence of length L costs about L**2 / 2. Sequences too
  large to place whole without unbalancing the ranks (more than 1/64 of a rank's share of the work, and at
  least two rows per chunk) are cut into ``2 * world`` chunks, rank r taking chunks r and
  ``2 * world - 1 - r`` (zig-zag: an early, cheap chunk with a late, expensive one, so every rank does the
  same work on that sequence; the last rank's two chunks meet and are one piece). The other sequences go
  whole, largest first, to the least-loaded rank.
- ``balance="tokens"``: the packed token stream is cut into ``world`` contiguous ranges of equal length.
"""

from __future__ import annotations

import dataclasses

from .._checks import check_choice, check_int

BALANCES = ("causal", "tokens")
# A sequence whose causal work exceeds this fraction of a rank's share is split zig-zag; the others, placed
# whole, leave the ranks at most about this fraction apart.
SPLIT_FRACTION = 1 / 64


@dataclasses.dataclass(frozen=True)
class Piece:
    """Query rows ``[start, end)`` of sequence ``sequence`` (in-sequence positions)."""

    sequence: int
    start: int
    end: int

    @property
    def rows(self) -> int:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class Plan:
    """Pieces per rank, in the order their rows are laid out on that rank."""

    lengths: tuple[int, ...]
    pieces: tuple[tuple[Piece, ...], ...]

    @property
    def world(self) -> int:
        return len(self.pieces)

    def rows(self, rank: int) -> int:
        return sum(p.rows for p in self.pieces[rank])

    def work(self, rank: int, causal: bool = True) -> int:
        """Visible (query, key) pairs of the rank's queries under a causal (or no) mask."""
        if causal:
            return sum(_causal_pairs(p.start, p.end) for p in self.pieces[rank])
        return sum(p.rows * self.lengths[p.sequence] for p in self.pieces[rank])


def _causal_pairs(start: int, end: int) -> int:
    """Pairs (i, j <= i) for queries i in [start, end)."""
    return (end * (end + 1) - start * (start + 1)) // 2


def make_plan(lengths: list[int], world: int, balance: str = "causal") -> Plan:
    """The plan for sequences of ``lengths`` (ints >= 0) over ``world`` ranks (an int >= 1), balanced as ``balance``
    says (one of ``BALANCES``; see the module docstring). ValueError / TypeError naming the argument otherwise."""
    world = check_int("world", world, minimum=1)
    check_choice("balance", balance, BALANCES)
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, (list, tuple)):
        raise TypeError(f"lengths: expected a list of ints, got {type(lengths).__name__}")
    lengths = [check_int(f"lengths[{b}]", length, minimum=0) for b, length in enumerate(lengths)]
    pieces: list[list[Piece]] = [[] for _ in range(world)]
    if balance == "tokens":
        total = sum(lengths)
        bounds = [total * r // world for r in range(world + 1)]
        first = 0
        for b, length in enumerate(lengths):
            for r in range(world):
                lo, hi = max(bounds[r], first), min(bounds[r + 1], first + length)
                if lo < hi:
                    pieces[r].append(Piece(b, lo - first, hi - first))
            first += length
        return Plan(tuple(lengths), tuple(tuple(p) for p in pieces))
    share = sum(_causal_pairs(0, n) for n in lengths) / world
    load = [0] * world
    whole = []
    for b, length in enumerate(lengths):
        if length >= 4 * world and _causal_pairs(0, length) > SPLIT_FRACTION * share:
            bounds = [length * c // (2 * world) for c in range(2 * world + 1)]
            for r in range(world):
                for c in (r, 2 * world - 1 - r):
                    pieces[r].append(Piece(b, bounds[c], bounds[c + 1]))
                    load[r] += _causal_pairs(bounds[c], bounds[c + 1])
        elif length > 0:
            whole.append(b)
    for b in sorted(whole, key=lambda b: -lengths[b]):
        r = min(range(world), key=lambda r: (load[r], r))
        pieces[r].append(Piece(b, 0, lengths[b]))
        load[r] += _causal_pairs(0, lengths[b])
    return Plan(tuple(lengths), tuple(_merged(sorted(p, key=lambda x: (x.sequence, x.start))) for p in pieces))


def _merged(pieces: list[Piece]) -> tuple[Piece, ...]:
    """Adjacent pieces of one sequence as one (the zig-zag's middle chunks meet on the last rank): one piece
    whose keys are gathered once, not a prefix for each."""
    out: list[Piece] = []
    for p in pieces:
        if out and out[-1].sequence == p.sequence and out[-1].end == p.start:
            out[-1] = Piece(p.sequence, out[-1].start, p.end)
        else:
            out.append(p)
    return tuple(out)
