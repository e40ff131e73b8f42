"""PyTorch's fused CPU attention kernel (the one behind ``scaled_dot_product_attention`` on CPU tensors),
run on jagged batches by length buckets.

``aten::_scaled_dot_product_flash_attention_for_cpu`` and its backward are blocked, multi-threaded and
take GQA, causal masks (top-left) and a float mask, but only dense ``(B, H, S, D)`` batches with D == Dv.
A jagged batch is cut into buckets of sequences of similar lengths (sorted, then split where one more
kernel call costs less than the padding it saves: :func:`length_buckets`); each bucket is gathered into a
padded ``(n, H, L, D)`` block (``index_select`` on the flat rows) with a key-padding mask and runs as one call,
whose results are copied back slot by slot (``index_copy_``; padding slots into a spare row past the last, cut off
at the end: no boolean masks, concatenations or scatters, which cost ~20% of a small call), into results left
uninitialized where the buckets write every row. On the CPU there is no device to wait for, so the host reads
the offsets and loops over buckets freely. A plan is built once per offsets tensor and reused by every layer's
forward and backward of that batch.

What the kernel can't do (dropout, ALiBi, softcap, windows, prefixes, documents, Dv != D, bottom-right
causal masks between different lengths, a bias on a jagged batch, a bias or lse that needs a gradient, a negative
scale: it masks causal scores with -inf before scaling them, so a negative scale made them +inf and the output NaN)
stays with the chunked PyTorch path: :func:`unsupported_reasons` says why, per call.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import capabilities
from .._checks import FLOAT_DTYPES, accumulate_dtype
from .._tensor_cache import TensorCache
from ..capabilities import ALL_FEATURES, Capabilities
from ..offsets import sequence_bounds
from .options import AttentionOptions, Problem

_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default

# Bucket cost model, in units of one (query, key, head, head-dim) product: a kernel call costs about as
# much as this many (measured on a 2-core x86 CPU, torch 2.13, forward + backward: ~0.12 ms per call against
# ~0.45 ns per unit, H4 D16 sequences of 1-64 tokens).
CALL_COST = 2.5e5
# Sorted lengths are grouped into at most this many runs before choosing buckets (bounds the planning work).
MAX_RUNS = 64


# What the kernel can't take stays with the chunked path (see the module docstring).
CAPABILITIES = Capabilities("cpu_fused", FLOAT_DTYPES, ("cpu",), features=ALL_FEATURES - {
    "empty", "value_dim", "dropout", "alibi", "softcap", "window", "prefix", "documents", "jagged_bias",
    "unequal_bottom_right", "query_offset", "negative_scale"})


def unsupported_reasons(q, bias, alibi, problem: Problem, opts: AttentionOptions) -> list[str]:
    """Why the fused CPU kernel can't run this forward (empty when it can)."""
    return capabilities.unsupported_reasons(CAPABILITIES, capabilities.Call(q, bias, alibi, problem, opts))


def takes(q, k, bias, alibi, problem: Problem, opts: AttentionOptions) -> bool:
    """Whether the fused kernel runs this call, forward and backward: what it supports, on queries and keys without
    NaN or inf. (The kernel gives a query whose scores hold a NaN the output 0 and the lse 0, where the reference and
    the other paths give NaN and -inf: a NaN reaching attention in training would pass on as zeros.)"""
    if unsupported_reasons(q, bias, alibi, problem, opts):
        return False
    # One sum of each: a NaN or inf makes it non-finite. (Finite values whose sum overflows send the call to the
    # chunked path, right too.) torch.isfinite(x).all() took 15-40x as long on the CPU: 9% of `make demo`'s jagged
    # step, 0.38 s per call at 32k x 16 x 64 (2-core x86, torch 2.13).
    total = q.sum(dtype=accumulate_dtype(q.dtype)) + k.sum(dtype=accumulate_dtype(k.dtype))
    return bool(torch.isfinite(total))


# ------------------------------------------------------------------------------------------- plan
@dataclasses.dataclass(frozen=True)
class _Bucket:
    """Sequences padded to one ``(n, Lq)`` / ``(n, Lk)`` block: the rows of values each slot reads, and the row
    of the result each slot's output goes to (results are made one row longer, then cut: padding slots write
    that spare last row)."""

    q_rows: torch.Tensor  # (n, Lq) int64 rows of q's values; padding slots repeat the sequence's first row
    k_rows: torch.Tensor  # (n, Lk)
    q_slots: torch.Tensor  # (n * Lq,) int64: the row of out, lse and dq each slot's result goes to
    k_slots: torch.Tensor  # (n * Lk,) int64: the row of dk and dv
    key_mask: torch.Tensor | None  # (n, 1, 1, Lk), -inf on padding keys; None where no padding key is seen


@dataclasses.dataclass(frozen=True)
class _Plan:
    """A batch's buckets, and whether they write every row of q's results (out, dq) and of k's (dk, dv): where they
    do, those start uninitialized rather than zeroed (rows of sequences left out, or of no sequence, keep 0)."""

    buckets: tuple[_Bucket, ...]
    writes_every_q_row: bool
    writes_every_k_row: bool


def length_buckets(q_lens: list[int], k_lens: list[int], weight: float,
                   call_cost: float = CALL_COST) -> list[tuple[int, int]]:
    """Split sequences sorted by decreasing q length into ranges ``[i, j)``, each one kernel call on a block
    padded to the range's longest q and k, minimizing ``call_cost`` per call plus ``weight * n * Lq * Lk``
    per block (also the chunked path's buckets on the CPU: ``torch_backend``). Exact dynamic programming over
    at most ``MAX_RUNS`` runs of consecutive sequences."""
    n = len(q_lens)
    if n == 0:
        return []
    step = -(-n // MAX_RUNS)
    cuts = list(range(0, n, step)) + [n]
    run_k = [max(k_lens[a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]
    best = [0.0] + [float("inf")] * (len(cuts) - 1)
    choice = [0] * len(cuts)
    for j in range(1, len(cuts)):
        widest_k = 0
        for i in range(j - 1, -1, -1):
            if run_k[i] > widest_k:  # (not max(): this loop runs ~n^2 / 2 times per batch)
                widest_k = run_k[i]
            cost = best[i] + call_cost + weight * (cuts[j] - cuts[i]) * q_lens[cuts[i]] * widest_k
            if cost < best[j]:
                best[j], choice[j] = cost, i
    ranges, j = [], len(cuts) - 1
    while j > 0:
        ranges.append((cuts[choice[j]], cuts[j]))
        j = choice[j]
    return ranges[::-1]


def bucket_members(problem: Problem, opts: AttentionOptions, q_len: torch.Tensor, k_len: torch.Tensor,
                   seqs: torch.Tensor, call_cost: float = CALL_COST) -> list[torch.Tensor]:
    """The sequences ``seqs`` (indices, CPU) in length buckets: sorted by decreasing query length (stable), cut by
    :func:`length_buckets` with the problem's work per padded (query, key) pair; each bucket's sequence indices."""
    seqs = seqs[torch.argsort(q_len[seqs], descending=True, stable=True)]
    weight = problem.heads * problem.head_dim * (0.5 if opts.causal else 1.0)
    ranges = length_buckets(q_len[seqs].tolist(), k_len[seqs].tolist(), weight, call_cost)
    return [seqs[i:j] for i, j in ranges]


def _build_plan(problem: Problem, opts: AttentionOptions, mask_dtype: torch.dtype,
                rows: tuple[int, int]) -> _Plan:
    (cu_q, q_len), (cu_k, k_len) = (sequence_bounds(cu, total, longest) for cu, total, longest in
                                    ((problem.cu_q, rows[0], problem.max_q), (problem.cu_k, rows[1], problem.max_k)))
    # Sequences without a query or without a key are left out: their rows keep output 0 and lse -inf.
    seqs = ((q_len > 0) & (k_len > 0)).nonzero().flatten()
    buckets = []
    for members in bucket_members(problem, opts, q_len, k_len, seqs):
        q_rows, q_valid = padded_rows(cu_q[members], q_len[members])
        k_rows, k_valid = padded_rows(cu_k[members], k_len[members])
        # Causal self-attention needs no key mask: a real query i sees keys j <= i, all real; padding
        # queries see padding keys, but their rows are dropped.
        self_causal = opts.causal and torch.equal(q_len[members], k_len[members])
        key_mask = None
        if not self_causal and not bool(k_valid.all()):
            key_mask = torch.zeros(k_valid.shape, dtype=mask_dtype).masked_fill_(~k_valid, float("-inf"))
            key_mask = key_mask[:, None, None, :]
        q_slots = torch.where(q_valid, q_rows, rows[0]).flatten()
        k_slots = torch.where(k_valid, k_rows, rows[1]).flatten()
        buckets.append(_Bucket(q_rows, k_rows, q_slots, k_slots, key_mask))
    taken = (q_len > 0) & (k_len > 0)
    return _Plan(tuple(buckets), _writes_every_row(cu_q, q_len, taken, rows[0]),
                 _writes_every_row(cu_k, k_len, taken, rows[1]))


def _writes_every_row(starts: torch.Tensor, lengths: torch.Tensor, taken: torch.Tensor, total: int) -> bool:
    """Whether the sequences ``taken`` (a mask) write every one of ``total`` rows: each sequence with rows is taken,
    and the sequences lie end to end from row 0 to row ``total`` (offsets changed in place after their check, which
    :func:`sequence_bounds` clamps, can leave rows of no sequence and rows of two)."""
    ends = starts + lengths
    return (bool((taken | (lengths == 0)).all()) and int(starts[0]) == 0 and int(ends[-1]) == total
            and bool((starts[1:] == ends[:-1]).all()))


def padded_rows(starts: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(n, max length)`` rows ``starts[s] + p`` and whether ``p < lengths[s]``; padding repeats row
    ``starts[s]``."""
    pos = torch.arange(int(lengths.max()), device=lengths.device)
    valid = pos[None, :] < lengths[:, None]
    return starts[:, None] + torch.where(valid, pos[None, :], 0), valid


# Plans by (cu_q, cu_k) pair: the layers of a model share their batch's offsets tensors. A few are kept, so that
# self- and cross-attention layers over different offsets don't evict each other's.
_plans = TensorCache(4)


def _plan(problem: Problem, opts: AttentionOptions, dtype: torch.dtype, rows: tuple[int, int]) -> _Plan:
    """The buckets for ``rows`` (q's and k's row counts) of values under the problem's offsets."""
    mask_dtype = _kernel_dtype(dtype)
    extra = (opts.causal, problem.heads, problem.head_dim, mask_dtype, rows, problem.max_q, problem.max_k)
    return _plans.get((problem.cu_q, problem.cu_k), extra, lambda: _build_plan(problem, opts, mask_dtype, rows))


def _kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half-precision inputs run in float32: the kernel's half path rounds the scores to half precision,
    which left its lse 50x less accurate than float32 math on the same inputs (5e-5 vs 6e-7 absolute,
    float16 and bfloat16, measured in ``tests/test_attention.py::test_half_lse_accuracy``), and its
    gradients with it. The upcast costs ~15% of the kernel's time (bf16, 8 x 8 heads x 512, 2 threads)."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def _inputs(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(t.to(_kernel_dtype(t.dtype)) for t in tensors)


def _gather(values: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``values[rows]`` for ``(n, L)`` rows: a padded ``(n, L, ...)`` block. ``index_select`` on the flat rows, 3-5x
    faster than advanced indexing on the CPU (2-core x86, torch 2.13: 10-14 against 47 us for 248 rows of 4 x 64
    float32), and a forward + backward gathers five blocks per bucket."""
    return values.index_select(0, rows.flatten()).view(*rows.shape, *values.shape[1:])


def _results(like: torch.Tensor, rows: int, every_row: bool, *shape: int) -> torch.Tensor:
    """A result of ``rows`` rows and one spare past them (padding slots write there), zeroed unless the buckets
    write ``every_row``."""
    return (like.new_empty if every_row else like.new_zeros)(rows + 1, *shape)


# --------------------------------------------------------------------------------------- forward
def forward(q, k, v, bias, problem: Problem, opts: AttentionOptions):
    """``(out, lse)`` in the layouts of ``options.py``."""
    if problem.dense:
        return _forward_dense(q, k, v, bias, opts)
    plan = _plan(problem, opts, q.dtype, (q.shape[0], k.shape[0]))
    H, Dv, rows = problem.heads, problem.head_dim_v, q.shape[0]
    # One spare row past the last: every slot of a bucket is copied out, padding slots into the spare row.
    out = _results(q, rows, plan.writes_every_q_row, H, Dv)
    lse = torch.full((rows + 1, H), float("-inf"), dtype=accumulate_dtype(q.dtype))
    for bucket in plan.buckets:
        qb, kb, vb = (_gather(t, r).transpose(1, 2)
                      for t, r in ((q, bucket.q_rows), (k, bucket.k_rows), (v, bucket.k_rows)))
        o, lse_b = _FORWARD(*_inputs(qb, kb, vb), 0.0, opts.causal, attn_mask=bucket.key_mask, scale=opts.scale)
        out.index_copy_(0, bucket.q_slots, o.transpose(1, 2).reshape(-1, H, Dv).to(out.dtype))
        lse.index_copy_(0, bucket.q_slots, lse_b.transpose(1, 2).reshape(-1, H).to(lse.dtype))
    # (resize_ drops the spare row in place: a view made here would be one of a custom Function's outputs)
    return out.resize_(rows, H, Dv), lse[:rows].t().contiguous()


def _forward_dense(q, k, v, bias, opts: AttentionOptions):
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D) views
    mask = None if bias is None else bias.to(_kernel_dtype(q.dtype))
    out, lse = _FORWARD(*_inputs(qt, kt, vt), 0.0, opts.causal, attn_mask=mask, scale=opts.scale)
    out, lse = out.to(q.dtype), lse.to(accumulate_dtype(q.dtype))
    if mask is not None:
        # The kernel gives lse 0 to a query that sees no key; varlen's convention is -inf.
        lse = torch.where(_sees_a_key(mask, opts.causal, lse.shape), lse, float("-inf"))
    return out.transpose(1, 2), lse


def _sees_a_key(mask: torch.Tensor, causal: bool, shape) -> torch.Tensor:
    """``(B, H, Sq)``: whether the query has a key the mask (and the top-left causal rule) leaves visible."""
    finite = mask > float("-inf")
    if not causal:
        return finite.any(dim=-1).expand(shape)
    # Query i sees keys j <= i: it sees one iff the mask's first finite column is at most i. A row with none gets
    # the query count, which no query index reaches (the key count would, for queries past the last key).
    first = torch.where(finite.any(dim=-1), finite.to(torch.uint8).argmax(dim=-1), shape[-1])
    return (first <= torch.arange(shape[-1])).expand(shape)


# -------------------------------------------------------------------------------------- backward
def backward(dout, q, k, v, out, lse, problem: Problem, opts: AttentionOptions, bias):
    """``(dq, dk, dv)``; the lse gets no gradient here (callers with one take the chunked path)."""
    if problem.dense:
        return _backward_dense(dout, q, k, v, out, lse, bias, opts)
    plan = _plan(problem, opts, q.dtype, (q.shape[0], k.shape[0]))
    # (Tq + 1, H): the spare last row, +inf, is the lse of padding query slots, whose probabilities are then
    # zero, so that they add nothing to dk and dv.
    lse_rows = torch.cat([_kernel_lse(lse.t()), lse.new_full((1, lse.shape[0]), float("inf"))])
    # One spare row past the last, as in the forward: padding slots' gradients (zeros) go there.
    dq = _results(q, q.shape[0], plan.writes_every_q_row, *q.shape[1:])
    dk, dv = (_results(t, t.shape[0], plan.writes_every_k_row, *t.shape[1:]) for t in (k, v))
    for bucket in plan.buckets:
        qr, kr = bucket.q_rows, bucket.k_rows
        lse_b = _gather(lse_rows, bucket.q_slots.view(qr.shape)).transpose(1, 2).contiguous()
        grads = _BACKWARD(*_inputs(*(_gather(t, r).transpose(1, 2)
                                     for t, r in ((dout, qr), (q, qr), (k, kr), (v, kr), (out, qr)))),
                          lse_b, 0.0, opts.causal, attn_mask=bucket.key_mask, scale=opts.scale)
        for total, grad, slots in zip((dq, dk, dv), grads, (bucket.q_slots, bucket.k_slots, bucket.k_slots),
                                      strict=True):
            total.index_copy_(0, slots, grad.transpose(1, 2).reshape(-1, *total.shape[1:]).to(total.dtype))
    return tuple(t.resize_(t.shape[0] - 1, *t.shape[1:]) for t in (dq, dk, dv))


def _backward_dense(dout, q, k, v, out, lse, bias, opts: AttentionOptions):
    mask = None if bias is None else bias.to(_kernel_dtype(q.dtype))
    grads = _BACKWARD(*_inputs(*(t.transpose(1, 2) for t in (dout, q, k, v, out))), _kernel_lse(lse), 0.0,
                      opts.causal, attn_mask=mask, scale=opts.scale)
    return tuple(g.transpose(1, 2).to(t.dtype) for g, t in zip(grads, (q, k, v), strict=True))


def _kernel_lse(lse: torch.Tensor) -> torch.Tensor:
    """The lse as the kernel's backward needs it: +inf (not -inf) for a query that sees no key, so its
    recomputed probabilities ``exp(s - lse)`` are 0 rather than NaN."""
    return torch.where(lse == float("-inf"), float("inf"), lse)
