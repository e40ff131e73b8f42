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
- lse-shaped fp32 buffers (lse, delta, their gradients) are plain pointers to contiguous ``(B, H, max_q)``
  (dense) or ``(H, total_q)`` (jagged) tensors: :func:`lse_row` finds a sequence's row.

Sequence bounds are trusted metadata on the GPU (checking them costs a device-to-host copy; see
``varlen.set_checks``), so :func:`sequence` clamps them: a sequence's rows always lie in its buffer and its
length never exceeds the host's ``max_q``/``max_k``, whatever the offsets say. Wrong offsets give wrong
values for the sequences they describe, never an access outside the tensors.
"""

import collections

from ..._triton import tl, triton
from .masks import Mask, seq_mask

Rows = collections.namedtuple("Rows", "ptr stride_b stride_s stride_h")
Seqs = collections.namedtuple("Seqs", "cu_q cu_k heads")
# In-kernel: the batch (Seqs and the data-dependent sizes), and one sequence of it (its index, first rows in
# q's and k's buffers, lengths).
Batch = collections.namedtuple("Batch", "cu_q cu_k heads total_q total_k max_q max_k")
Seq = collections.namedtuple("Seq", "b q_start Lq k_start Lk")


def rows(t, dense: bool) -> Rows:
    """``t`` as a ``Rows`` bundle: ``(B, S, H, X)`` dense, ``(T, H, X)`` jagged."""
    return Rows(t, t.stride(0), t.stride(1), t.stride(2)) if dense else Rows(t, 0, t.stride(0), t.stride(1))


def seqs(problem, q, k, placeholder) -> dict:
    """The ``seqs`` bundle and the data-dependent sizes of a call, as kernel keyword arguments
    (``placeholder``: any tensor, for the offsets of a dense call)."""
    if problem.dense:
        return dict(seqs=Seqs(placeholder, placeholder, problem.heads), total_q=problem.max_q,
                    total_k=problem.max_k, max_q=problem.max_q, max_k=problem.max_k)
    return dict(seqs=Seqs(problem.cu_q, problem.cu_k, problem.heads), total_q=q.shape[0], total_k=k.shape[0],
                max_q=problem.max_q, max_k=problem.max_k)


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
def prologue(bt: Batch, mask: Mask, F: tl.constexpr, HEAVY_FIRST: tl.constexpr):
    """``(block, head, seq, masks)`` of a program of a ``(blocks, heads, B)`` grid. ``HEAVY_FIRST``: under a
    causal-like mask later query blocks see more keys, so they start first (block order reversed)."""
    block = tl.program_id(0)
    if HEAVY_FIRST:
        block = tl.num_programs(0) - 1 - block
    b = tl.program_id(2)
    seq = sequence(bt, b, F)
    return block, tl.program_id(1), seq, seq_mask(mask, b, seq.Lq, seq.Lk, bt.max_q, F)


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
