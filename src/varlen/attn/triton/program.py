"""What every attention kernel starts with: the tensor and sequence bundles, and the prologue.

Kernel arguments travel as namedtuples (Triton flattens them into scalars and pointers; their fields are
read by name in the kernels), except the integers that change from batch to batch: Triton specializes
integer arguments on their value (equal to 1, divisible by 16), inside tuples too, where
``do_not_specialize`` doesn't reach. Those stay top-level arguments (``launch.DATA_DEPENDENT``), gathered
into a namedtuple in the kernel:

- ``Rows(ptr, stride_b, stride_s, stride_h)``: a ``(B, S, H, X)`` dense tensor or the ``(T, H, X)`` values
  of a jagged one (``stride_b`` 0), last dim contiguous.
- ``Seqs(cu_q, cu_k, heads)``: the offsets (jagged) and the query head count; with the top-level
  ``total_q, total_k, max_q, max_k`` (rows of q and k, longest lengths) they make the in-kernel ``Batch``.
- ``ORDER``: the backward kernels walk a jagged batch's sequences longest first (:func:`longest_first`):
  grid axis 2's program b takes sequence ``ORDER[b]``.
- lse-shaped fp32 buffers (lse, delta, their gradients) are plain pointers to contiguous ``(B, H, max_q)``
  (dense) or ``(H, total_q)`` (jagged) tensors: :func:`lse_row` finds a sequence's row.

Sequence bounds are trusted metadata on the GPU (checking them costs a device-to-host copy; see
``varlen.set_checks``), so :func:`sequence` clamps them: a sequence's rows always lie in its buffer and its
length never exceeds the host's ``max_q``/``max_k``, whatever the offsets say. Wrong offsets give wrong
values for the sequences they describe, never an access outside the tensors; rows that no sequence covers are
left unwritten (the output's and every gradient's: the dQ accumulator is zeroed per sequence).
"""

import collections

import torch

from ..._triton import tl, triton
from ...tiling import sm_count
from .masks import Mask, seq_mask

Rows = collections.namedtuple("Rows", "ptr stride_b stride_s stride_h")
Seqs = collections.namedtuple("Seqs", "cu_q cu_k heads")
# In-kernel: the batch (Seqs and the data-dependent sizes), and one sequence of it (its index, first rows in
# q's and k's buffers, lengths).
Batch = collections.namedtuple("Batch", "cu_q cu_k heads total_q total_k max_q max_k")
Seq = collections.namedtuple("Seq", "b q_start Lq k_start Lk")


def rows(t, dense: bool) -> Rows:
    """``t`` as a ``Rows`` bundle: ``(B, S, H, X)`` dense, ``(T, H, X)`` jagged."""
    strides = t.stride()
    return Rows(t, *strides[:3]) if dense else Rows(t, 0, *strides[:2])


def seqs(problem, q, k, placeholder) -> dict:
    """The ``seqs`` bundle and the data-dependent sizes of a call, as kernel keyword arguments
    (``placeholder``: any tensor, for the offsets of a dense call)."""
    if problem.dense:
        return dict(seqs=Seqs(placeholder, placeholder, problem.heads), total_q=problem.max_q,
                    total_k=problem.max_k, max_q=problem.max_q, max_k=problem.max_k)
    return dict(seqs=Seqs(problem.cu_q, problem.cu_k, problem.heads), total_q=q.shape[0], total_k=k.shape[0],
                max_q=problem.max_q, max_k=problem.max_k)


def longest_first(problem, placeholder) -> torch.Tensor:
    """Grid axis 2's sequences in decreasing order of work (``Lq x Lk``): the hardware starts programs in
    grid order, so a long sequence met last runs on a few SMs after the rest have finished. The backward
    kernels take it (H100, jagged train_llm-like batches, D64 GQA 12/4 causal: +3-6% for the Triton kv
    kernel, +7-9% for the Gluon one; 16 sequences of 256-4096 at H16 D128: +2%); the forward's programs are
    short, and the extra dependent load at their start cost them more than the order gained (bench/NOTES.md).
    Dense calls, whose sequences are all alike, keep their order (``placeholder`` stands in, unread).
    Sequences of equal work keep theirs (a stable sort), so the order is a pure function of the lengths."""
    if problem.dense:
        return placeholder
    len_q = problem.cu_q[1:] - problem.cu_q[:-1]
    len_k = len_q if problem.cu_k is problem.cu_q else problem.cu_k[1:] - problem.cu_k[:-1]
    return torch.argsort(len_q.to(torch.int64) * len_k, descending=True, stable=True)


# Grid orders of the key-block kernels (``prologue``'s ``GRID``; :func:`key_block_grid` picks one).
BLOCKS_FIRST = 0  # (blocks, heads, B)
BLOCKS_LAST = 1  # (heads, B, blocks): blocks_last
HEADS_LAST = 2  # (blocks, B, heads): heads_last
KV_GROUPS = 3  # (kv heads in a group, blocks, groups): kv_head_groups


def blocks_last(problem, feats, blocks: int, device, programs_per_sm: int) -> bool:
    """Whether a key-block kernel (one program per key block, kv head and sequence) takes the ``(heads, B,
    blocks)`` grid, which starts every (head, sequence)'s first key block before any second one, rather than
    ``(blocks, heads, B)``: on dense calls under a causal mask (the first key blocks see the most queries, and a
    heavy block starting last leaves the GPU idle around it) with fewer than ``programs_per_sm`` programs per SM
    (each kernel's own measured bound: with many programs the tail is short, and concurrent programs reading one
    head's queries share them in L2). Not with a left window (its blocks are alike) or jagged batches (ordered
    longest first instead)."""
    if not (problem.dense and first_blocks_heaviest(feats)):
        return False
    return blocks * problem.kv_heads * problem.batch < programs_per_sm * sm_count(device)


def first_blocks_heaviest(feats) -> bool:
    """Whether a sequence's first key blocks see the most queries: a causal-like mask (a right band) without a left
    window (whose blocks are alike)."""
    return bool(feats.HAS_R) and not bool(feats.HAS_WL)


def heads_last(problem, adds_across_batch: bool) -> bool:
    """Whether a key-block kernel takes the ``(blocks, B, heads)`` grid: when its programs of one key block and
    head in different sequences add into the same memory (``adds_across_batch``: a bias gradient broadcast over
    the batch, summed by atomic adds), so that those programs run together and the adds meet in L2. In the
    ``(blocks, heads, B)`` order a sequence's programs cover every head before the next sequence's start, and a
    (1, H, S, S) fp32 gradient (268 MB at H16 S2048) leaves L2 between them. Needs B within the 65535 a grid's
    second axis allows."""
    return adds_across_batch and 1 < problem.batch <= 65535


def kv_head_groups(problem, feats, blocks: int, device) -> int:
    """The kv heads (of every sequence: sequence b's head h is the ``b Hkv + h``-th) in each group of the ``(P, blocks,
    groups)`` grid, or 0 where it doesn't apply. The grid runs one group's programs, every key block of P kv heads,
    heaviest blocks first, before the next group's: for dense calls under a causal-like mask
    (:func:`first_blocks_heaviest`) with GQA (each program walks a kv head's query heads), P the largest divisor of the
    kv heads x B up to ``sm_count / blocks``, at least 2, leaving at most 65535 groups (a grid's third axis). Blocks
    last (every head's first block, then every head's second...) ran a GQA head's 32 blocks in four waves (D128 S4k B2,
    32/8), and each wave read that head's Q, dO and dQ rows from DRAM again (ncu: 2.4 GB read against 0.7 for MHA of the
    same FLOPs); blocks first leaves the last heads' heaviest blocks to the end. Measured on an H100 (bench/NOTES.md,
    "GQA programs in groups of kv heads"; the old and new grids alternated in one call): D64 GQA 32/8 and 12/4 causal
    +5-6%, D128 GQA 32/8 S4k +1-2% (0.92 -> 0.94x cuDNN at B2)."""
    if not (problem.dense and first_blocks_heaviest(feats) and problem.group > 1):
        return 0
    pairs = problem.kv_heads * problem.batch
    return next((p for p in range(min(pairs, sm_count(device) // blocks), 1, -1)
                 if pairs % p == 0 and pairs // p <= 65535), 0)


def key_block_grid(problem, feats, blocks: int, device, programs_per_sm: int,
                   adds_across_batch: bool = False, kv_groups: bool = False) -> tuple[tuple[int, int, int], int]:
    """The grid of a key-block kernel with ``blocks`` key blocks per sequence, and its order (``prologue``'s
    ``GRID``): kv heads in groups (:func:`kv_head_groups`; for kernels that take that grid, ``kv_groups``, unless
    sequences add into one memory), blocks last (:func:`blocks_last`; it wins where both apply: its few programs run
    at once anyway), heads last (:func:`heads_last`), or blocks first. (Blocks last is taken with few programs
    only, so its B and block count stay far below the 65535 a grid's second and third axes allow; heads last checks
    its B; a group's P kv heads are at most sm_count / blocks, its groups at most 65535.)"""
    group = kv_head_groups(problem, feats, blocks, device) if kv_groups and not adds_across_batch else 0
    if group:
        return (group, blocks, problem.kv_heads * problem.batch // group), KV_GROUPS
    if blocks_last(problem, feats, blocks, device, programs_per_sm):
        return (problem.kv_heads, problem.batch, blocks), BLOCKS_LAST
    if heads_last(problem, adds_across_batch):
        return (blocks, problem.batch, problem.kv_heads), HEADS_LAST
    return (blocks, problem.kv_heads, problem.batch), BLOCKS_FIRST


@triton.jit
def batch(s: Seqs, total_q, total_k, max_q, max_k):
    return Batch(s.cu_q, s.cu_k, s.heads, total_q, total_k, max_q, max_k)


@triton.jit
def bounds(cu, b, total, longest, VARLEN: tl.constexpr):
    """(first row, length) of sequence b, clamped into ``[0, total)`` and to at most ``longest`` rows."""
    if VARLEN:
        start = tl.minimum(tl.maximum(tl.load(cu + b), 0), total)
        end = tl.minimum(tl.maximum(tl.load(cu + b + 1), start), total)
        return start, tl.minimum(end - start, longest)
    else:
        return b * 0, longest  # b * 0: a tensor zero, typed like the loaded offsets


@triton.jit
def sequence(bt: Batch, b, F: tl.constexpr):
    """Sequence b's bounds (clamped: see the module docstring)."""
    q_start, Lq = bounds(bt.cu_q, b, bt.total_q, bt.max_q, F.VARLEN)
    k_start, Lk = bounds(bt.cu_k, b, bt.total_k, bt.max_k, F.VARLEN)
    return Seq(b, q_start, Lq, k_start, Lk)


@triton.jit
def prologue(bt: Batch, mask: Mask, ORDER, F: tl.constexpr, HEAVY_FIRST: tl.constexpr, ORDERED: tl.constexpr,
             GRID: tl.constexpr = 0, KV_HEADS: tl.constexpr = 0):
    """``(block, head, seq, masks)`` of a program of a ``(blocks, heads, B)`` grid, or of the other orders of
    :func:`key_block_grid` (``GRID``; the kv head count ``KV_HEADS`` for its grid in groups). ``HEAVY_FIRST``: under
    a causal-like mask later query blocks see more keys, so they start first (block order reversed). ``ORDERED``: the
    sequence axis walks the sequences in ``ORDER`` (:func:`longest_first`)."""
    if GRID == 1:  # BLOCKS_LAST
        block = tl.program_id(2)
        b = tl.program_id(1)
        head = tl.program_id(0)
    elif GRID == 3:  # KV_GROUPS (its blocks heaviest first already)
        tl.static_assert(KV_HEADS > 0 and not HEAVY_FIRST, "the grid in groups of kv heads: KV_HEADS, no HEAVY_FIRST")
        kv_head = tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)  # (over the sequences' kv heads)
        block = tl.program_id(1)
        b = kv_head // KV_HEADS
        head = kv_head % KV_HEADS
    else:
        block = tl.program_id(0)
        if HEAVY_FIRST:
            block = tl.num_programs(0) - 1 - block
        if GRID == 2:  # HEADS_LAST
            b = tl.program_id(1)
            head = tl.program_id(2)
        else:
            b = tl.program_id(2)
            head = tl.program_id(1)
    if ORDERED:
        b = tl.load(ORDER + b).to(tl.int32)
    seq = sequence(bt, b, F)
    return block, head, seq, seq_mask(mask, b, seq.Lq, seq.Lk, bt.max_q, F)


@triton.jit
def base(R: Rows, seq_b, start, h):
    """Pointer to row ``start`` (the sequence's first) of batch ``seq_b``, head ``h``, of ``R``."""
    return R.ptr + seq_b.to(tl.int64) * R.stride_b + start.to(tl.int64) * R.stride_s + h * R.stride_h


@triton.jit
def lse_row(ptr, bt: Batch, seq: Seq, h, F: tl.constexpr):
    """Pointer to sequence ``seq``'s first entry, head ``h``, of a contiguous lse-shaped buffer."""
    return ptr + lse_offset(seq.b, seq.q_start, h, bt.heads, bt.total_q, bt.max_q, F.VARLEN)


@triton.jit
def lse_offset(b, q_start, h, heads, total_q, max_q, VARLEN: tl.constexpr):
    """:func:`lse_row`'s offset from scalars (for kernels that can't pass the bundles on, as Gluon partitions)."""
    if VARLEN:
        return h.to(tl.int64) * total_q + q_start.to(tl.int64)
    else:
        return (b.to(tl.int64) * heads + h) * max_q
