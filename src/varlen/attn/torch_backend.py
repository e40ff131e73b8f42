"""The PyTorch attention backend: CPU or CUDA, all features.

On CPU tensors, calls the fused CPU kernel can take (no dropout, ALiBi, softcap or window, no NaN or inf in the
queries or keys; see ``cpu_fused.takes``) run there, by length buckets. Everything else runs the chunked path
below, blockwise over query rows and memory-bounded, which the backward also takes when the bias or the
lse needs a gradient. On the CPU a jagged call runs it by length buckets too (:func:`_parts`: each bucket
padded only to its own longest lengths, its sequences keeping their dropout masks, options and bias planes).

Jagged batches are scattered once into a padded ``(B, max_len, ...)`` form with index ops built from
the device offsets (no per-sequence loop, no host sync); lengths become masks. Queries are processed in
chunks of rows sized so that one ``(B, H, rows, max_k)`` score block stays under
``SCORE_BLOCK_ELEMENTS``; every chunk holds whole rows, so the softmax of a chunk is exact and nothing
``(Sq, Sk)``-sized exists for the whole batch at once. The backward recomputes each chunk's scores, except in a
dropout call on the CPU whose forward kept the chunk's probabilities (up to ``KEPT_PROBS_BYTES`` a call:
:func:`_remember`); its dropout keep masks it takes from the forward where the call kept them (on the CPU, up to
``KEPT_MASK_BYTES`` a call: :func:`_chunk_keep`), and draws them again otherwise.

Half-precision inputs are computed in float32, float32 in float32 and float64 in float64.

Deterministic by construction: no atomics and no scatter-adds (the padding scatter writes each row
once); gradients of k, v and bias are summed over chunks in a fixed order, with matmuls and reductions
only. (cuBLAS matmuls repeat bitwise on one GPU and stream; across streams PyTorch documents
``CUBLAS_WORKSPACE_CONFIG``.)
"""

from __future__ import annotations

import dataclasses

import torch

from .._checks import FLOAT_DTYPES, accumulate_dtype
from .._tensor_cache import TensorCache
from ..capabilities import Capabilities
from ..offsets import row_positions, sequence_bounds
from . import cpu_fused
from .dropout import dropout_keep_scale, keep_mask_block
from .options import AttentionOptions, DropoutSeed, Problem

NAME = "torch"

# Elements of one (B, H, rows, max_k) score block; a handful of blocks of this size live at once.
SCORE_BLOCK_ELEMENTS = 1 << 22

# Bytes of dropout keep masks (one a weight) a CPU forward keeps for its backward, per call (``DropoutSeed.kept``):
# the draw is about a third of a dropout call's forward + backward there (bench/NOTES.md, "The CPU backward takes
# the forward's dropout masks"); past this, chunks draw their masks again, so a call's memory stays bounded (4x a
# score block's elements).
KEPT_MASK_BYTES = 4 * SCORE_BLOCK_ELEMENTS
# Bytes of softmax probabilities (the forward's, before dropout) a CPU dropout forward keeps for its backward, per call
# in the same memo: a chunk's backward then skips its scores and softmax (bench/NOTES.md, "The CPU backward takes the
# forward's probabilities"). As many bytes as the masks'.
KEPT_PROBS_BYTES = KEPT_MASK_BYTES


# Every option, float dtype and head dim, on the CPU and CUDA.
CAPABILITIES = Capabilities("torch", FLOAT_DTYPES, ("cpu", "cuda"))


@dataclasses.dataclass
class _Batch:
    """One call's operands in the padded, head-grouped layout the chunk loop works on."""

    q: torch.Tensor  # (B, Hkv, G, Sq, D), compute dtype
    k: torch.Tensor  # (B, Hkv, Sk, D)
    v: torch.Tensor  # (B, Hkv, Sk, Dv)
    q_rows: tuple[torch.Tensor, torch.Tensor] | None  # jagged: (sequence, position) of each q row
    k_rows: tuple[torch.Tensor, torch.Tensor] | None
    q_len: torch.Tensor | None  # jagged: (B, 1, 1, 1, 1) int64 lengths
    k_len: torch.Tensor | None
    bottom_right_shift: int | torch.Tensor  # Lk - Lq: an int (dense) or (B, 1, 1, 1, 1)
    chunk: int  # query rows per block


def forward(q, k, v, bias, alibi, problem: Problem, opts: AttentionOptions, seed: DropoutSeed | None):
    """``(out, lse)`` in the layouts of ``options.py``."""
    if cpu_fused.takes(q, k, bias, alibi, problem, opts):
        return cpu_fused.forward(q, k, v, bias, problem, opts)
    if _bucketed(q, problem):
        out = q.new_zeros(q.shape[0], problem.heads, problem.head_dim_v)
        lse = torch.full((problem.heads, q.shape[0]), float("-inf"), dtype=accumulate_dtype(q.dtype), device=q.device)
        for index, part in enumerate(_parts(problem, opts, alibi, (q.shape[0], k.shape[0]))):
            out[part.q_rows], lse[:, part.q_rows] = _forward_padded(
                q[part.q_rows], k[part.k_rows], v[part.k_rows], _part_bias(bias, part), part.alibi, part.problem,
                part.opts, seed, index)
        return out, lse
    return _forward_padded(q, k, v, bias, alibi, problem, opts, seed)


def _forward_padded(q, k, v, bias, alibi, problem: Problem, opts: AttentionOptions, seed: DropoutSeed | None,
                    part: int = 0):
    """The chunked forward over the whole batch padded to ``(B, max_q, ...)``; ``part``: the length bucket's index
    (it names the chunks' kept masks and probabilities)."""
    batch = _prepare(q, k, v, problem)
    B, H, Sq = problem.batch, problem.heads, problem.max_q
    out = batch.q.new_empty(B, problem.kv_heads, problem.group, Sq, problem.head_dim_v)
    lse = torch.empty(B, problem.kv_heads, problem.group, Sq, dtype=accumulate_dtype(q.dtype), device=q.device)
    for i0 in range(0, Sq, batch.chunk):
        rows = (i0, min(i0 + batch.chunk, Sq))
        s, capped = _scores(batch, rows, bias, alibi, problem, opts)
        p, lse_rows = _softmax(s)
        keep = _chunk_keep(seed, problem, rows, opts, s, part, forward=True)
        if keep is not None:
            if capped is None:  # (with a softcap the backward needs the capped scores too: it recomputes them)
                _remember(seed, (part, *rows, "probabilities"), p, KEPT_PROBS_BYTES)
            p = p * keep
        out[:, :, :, rows[0]:rows[1]] = p @ batch.v.unsqueeze(2)
        lse[:, :, :, rows[0]:rows[1]] = lse_rows
    lse = lse.view(B, H, Sq)
    if problem.dense:
        return _ungroup(out, problem).to(q.dtype), lse
    lse_rows = lse.permute(0, 2, 1)[batch.q_rows]  # (Tq, H)
    return _ungroup(out, problem)[batch.q_rows].to(q.dtype), lse_rows.t().contiguous()


def backward(dout, dlse, q, k, v, out, lse, bias, alibi, problem: Problem, opts: AttentionOptions,
             seed: DropoutSeed | None, needs_grad):
    """``(dq, dk, dv, dbias)``; each None when not needed.

    The probabilities are recomputed from the scores rather than from the float32 ``lse``, which keeps
    float64 gradients exact to float64, and ``delta = rowsum(P * dP)`` (equal to ``rowsum(dO * O)``)
    uses them rather than the stored output, for the same reason.
    """
    need_q, need_k, need_v, need_bias = needs_grad
    if dlse is None and not need_bias and cpu_fused.takes(q, k, bias, alibi, problem, opts):
        dq, dk, dv = cpu_fused.backward(dout, q, k, v, out, lse, problem, opts, bias)
        return dq if need_q else None, dk if need_k else None, dv if need_v else None, None
    if _bucketed(q, problem):
        grads = [torch.zeros_like(t) if need else None for t, need in zip((q, k, v), needs_grad[:3], strict=True)]
        # The bias gradient is summed over the buckets in the compute dtype, as the padded pass sums its chunks, and
        # cast once: each bucket gets its bias in that dtype, so that it returns its gradient in it too.
        ct = accumulate_dtype(q.dtype)
        dbias = torch.zeros(bias.shape, dtype=ct, device=bias.device) if need_bias else None
        for index, part in enumerate(_parts(problem, opts, alibi, (q.shape[0], k.shape[0]))):
            qr, kr = part.q_rows, part.k_rows
            part_bias = _part_bias(bias, part)
            part_bias = None if part_bias is None else part_bias.to(ct)
            *part_grads, part_dbias = _backward_padded(
                dout[qr], None if dlse is None else dlse[:, qr], q[qr], k[kr], v[kr], out[qr], lse[:, qr],
                part_bias, part.alibi, part.problem, part.opts, seed, needs_grad, index)
            for total, grad, rows in zip(grads, part_grads, (qr, kr, kr), strict=True):
                if total is not None:
                    total[rows] = grad
            if need_bias:
                _add_part_bias_grad(dbias, part, part_dbias)
        return (*grads, None if dbias is None else dbias.to(bias.dtype))
    return _backward_padded(dout, dlse, q, k, v, out, lse, bias, alibi, problem, opts, seed, needs_grad)


def _backward_padded(dout, dlse, q, k, v, out, lse, bias, alibi, problem: Problem, opts: AttentionOptions,
                     seed: DropoutSeed | None, needs_grad, part: int = 0):
    """The chunked backward over the whole batch padded to ``(B, max_q, ...)``; ``part``: as
    :func:`_forward_padded`'s."""
    need_q, need_k, need_v, need_bias = needs_grad
    batch = _prepare(q, k, v, problem)
    Sq, ct = problem.max_q, batch.q.dtype
    do = _group(dout, problem, batch.q_rows, ct)  # (B, Hkv, G, Sq, Dv)
    if dlse is not None:
        dlse = dlse.t() if not problem.dense else dlse.permute(0, 2, 1)  # rows first: (., Sq, H)
        dlse = _group(dlse.unsqueeze(-1), problem, batch.q_rows, ct).squeeze(-1)  # (B, Hkv, G, Sq)
    dq = torch.empty_like(batch.q) if need_q else None
    dk = torch.zeros_like(batch.k) if need_k else None
    dv = torch.zeros_like(batch.v) if need_v else None
    dbias = torch.zeros(bias.shape, dtype=ct, device=bias.device) if need_bias else None
    scale = opts.scale
    for i0 in range(0, Sq, batch.chunk):
        rows = (i0, min(i0 + batch.chunk, Sq))
        q_c, do_c = batch.q[:, :, :, i0:rows[1]], do[:, :, :, i0:rows[1]]
        # (the forward's probabilities, where it kept them: the same values these scores and softmax would give)
        p, capped = _recall(seed, (part, *rows, "probabilities"), (*q_c.shape[:-1], batch.k.shape[-2])), None
        if p is None:
            s, capped = _scores(batch, rows, bias, alibi, problem, opts)
            p, _ = _softmax(s)
        keep = _chunk_keep(seed, problem, rows, opts, p, part, forward=False)
        dp = do_c @ batch.v.unsqueeze(2).transpose(-1, -2)  # (B, Hkv, G, n, Sk): d(dropped P)
        if keep is not None:
            dp = dp * keep
        if need_v:
            p_kept = p * keep if keep is not None else p
            dv += _fold(p_kept).transpose(-1, -2) @ _fold(do_c)
        delta = (p * dp).sum(dim=-1, keepdim=True)
        if dlse is not None:
            delta = delta - dlse[:, :, :, i0:rows[1]].unsqueeze(-1)
        ds = p * (dp - delta)  # gradient of the scores after softcap, bias and alibi
        if need_bias:
            _add_bias_grad(dbias, ds, rows, problem)
        if capped is not None:
            ds = ds * (1 - capped * capped)  # d softcap*tanh(x/softcap) / dx
        if need_q:
            dq[:, :, :, i0:rows[1]] = (ds @ batch.k.unsqueeze(2)) * scale
        if need_k:
            dk += (_fold(ds).transpose(-1, -2) @ _fold(q_c)) * scale
    return (_ungroup_rows(dq, problem, batch.q_rows, q.dtype) if need_q else None,
            _unpad_kv(dk, problem, batch.k_rows, k.dtype) if need_k else None,
            _unpad_kv(dv, problem, batch.k_rows, v.dtype) if need_v else None,
            dbias.to(bias.dtype) if need_bias else None)


# ----------------------------------------------------------------------------- CPU length buckets
# A bucket's chunked pass costs about as much as this many (query, key, head, head-dim) products besides its
# padded work (its Python and small ops; `cpu_fused.CALL_COST` is the fused kernel's, per call). Swept on a 2-core
# x86 CPU, forward + backward, jagged lengths 2-65 and 2-300 with dropout or softcap: 5e5-2e6 within 8% of each
# other, one bucket (the whole batch padded) 1.6-2.9x slower (bench/NOTES.md).
BUCKET_COST = 1e6


@dataclasses.dataclass(frozen=True)
class _Part:
    """The sequences of one length bucket as a jagged call of their own."""

    members: torch.Tensor  # (n,) int64: its sequences' indices in the batch
    q_rows: torch.Tensor  # (rows,) int64: the rows of q's values (and of out, lse, dq) that its sequences own
    k_rows: torch.Tensor  # the same for k and v
    problem: Problem
    opts: AttentionOptions
    alibi: torch.Tensor | None


def _bucketed(q, problem: Problem) -> bool:
    """Whether a call runs as length buckets: jagged, of more than one sequence, on the CPU (where the host may
    loop over buckets)."""
    return not problem.dense and q.device.type == "cpu" and problem.batch > 1


def _part_bias(bias: torch.Tensor | None, part: _Part) -> torch.Tensor | None:
    """A bucket's bias ``(n or 1, H or 1, >= max_q or 1, >= max_k or 1)``: its sequences' planes (all of a
    batch-broadcast bias), cut to the bucket's longest lengths."""
    if bias is None:
        return None
    planes = bias if bias.shape[0] == 1 else bias[part.members]
    return planes[:, :, _cut(bias, 2, part.problem.max_q), _cut(bias, 3, part.problem.max_k)]


def _add_part_bias_grad(dbias: torch.Tensor, part: _Part, grad: torch.Tensor) -> None:
    """Add a bucket's bias gradient (shaped like :func:`_part_bias`'s view) into the whole bias's: its sequences'
    planes, or summed into a batch-broadcast one."""
    rows, cols = _cut(dbias, 2, part.problem.max_q), _cut(dbias, 3, part.problem.max_k)
    if dbias.shape[0] == 1:
        dbias[:, :, rows, cols] += grad
    else:
        dbias[part.members, :, rows, cols] += grad


def _cut(bias: torch.Tensor, dim: int, length: int) -> slice:
    """The first ``length`` entries along a query or key dim of a bias, or its single broadcast one."""
    return slice(None, length) if bias.shape[dim] > 1 else slice(None)


@dataclasses.dataclass(frozen=True)
class _Bucket:
    """The sequences of one length bucket and their rows, whatever a call's per-sequence options."""

    members: torch.Tensor  # (n,) int64: its sequences' indices in the batch
    q_rows: torch.Tensor  # (rows,) int64
    k_rows: torch.Tensor
    max_q: int  # its longest lengths
    max_k: int
    cu_q: torch.Tensor  # (n + 1,) int32 offsets of its rows
    cu_k: torch.Tensor


# Buckets by (cu_q, cu_k) pair, as cpu_fused's plans: a model's layers share their batch's offsets tensors, and a
# backward cuts the buckets its forward cut (cut twice a call, they took 9% of a dropout call, B32 lengths 2-65 H4
# D16: bench/NOTES.md, "The CPU path").
_buckets = TensorCache(4)


def _parts(problem: Problem, opts: AttentionOptions, alibi, rows: tuple[int, int]) -> list[_Part]:
    """The batch cut into buckets of sequences of similar lengths (``cpu_fused.bucket_members``), each padded only
    to its own longest lengths. Per-sequence options and ALiBi slopes follow their sequences, and each sequence's
    dropout mask stays the one of its index in the whole batch (``dropout_sequences``). The buckets are kept per
    offsets tensors (:data:`_buckets`); the options are the call's."""
    extra = (rows, problem.max_q, problem.max_k, problem.heads, problem.head_dim, opts.causal, BUCKET_COST)
    parts = []
    for bucket in _buckets.get((problem.cu_q, problem.cu_k), extra, lambda: _cut_buckets(problem, opts, rows)):
        members = bucket.members
        part_problem = dataclasses.replace(problem, batch=len(members), max_q=bucket.max_q, max_k=bucket.max_k,
                                           cu_q=bucket.cu_q, cu_k=bucket.cu_k)
        sequences = members if opts.dropout_sequences is None else opts.dropout_sequences[members]
        part_opts = dataclasses.replace(
            opts, dropout_sequences=sequences.to(torch.int32),
            **{name: getattr(opts, name)[members] for name in ("prefix_len", "query_offset")
               if getattr(opts, name) is not None})
        parts.append(_Part(members, bucket.q_rows, bucket.k_rows, part_problem, part_opts,
                           None if alibi is None else alibi[members]))
    return parts


def _cut_buckets(problem: Problem, opts: AttentionOptions, rows: tuple[int, int]) -> tuple[_Bucket, ...]:
    """:func:`_parts`'s buckets for ``rows`` (q's and k's row counts) of values under the problem's offsets."""
    q_start, q_len = sequence_bounds(problem.cu_q, rows[0], problem.max_q)
    k_start, k_len = sequence_bounds(problem.cu_k, rows[1], problem.max_k)
    seqs = (q_len > 0).nonzero().flatten()  # (a sequence without queries has no row to compute)
    buckets = []
    for members in cpu_fused.bucket_members(problem, opts, q_len, k_len, seqs, BUCKET_COST):
        lengths_q, lengths_k = q_len[members], k_len[members]
        q_rows, q_valid = cpu_fused.padded_rows(q_start[members], lengths_q)
        k_rows, k_valid = cpu_fused.padded_rows(k_start[members], lengths_k)
        cu_q, cu_k = (torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
                      for lengths in (lengths_q, lengths_k))
        buckets.append(_Bucket(members, q_rows[q_valid], k_rows[k_valid], int(lengths_q.max()),
                               int(lengths_k.max()), cu_q, cu_k))
    return tuple(buckets)


# ---------------------------------------------------------------------------------------- layout
def _pad(x: torch.Tensor, rows, batch: int, width: int) -> torch.Tensor:
    """``(T, ...)`` rows to ``(B, width, ...)`` zero-padded (dense input passes through)."""
    if rows is None:
        return x
    out = x.new_zeros(batch, width, *x.shape[1:])
    out[rows] = x
    return out


def _prepare(q, k, v, problem: Problem) -> _Batch:
    B, Sk = problem.batch, problem.max_k
    ct = accumulate_dtype(q.dtype)
    if problem.dense:
        q_rows = k_rows = q_len = k_len = None
        shift = Sk - problem.max_q
    else:
        # Clamped to the padded block whatever the offsets say: trusted metadata can't index out of it.
        q_rows = row_positions(problem.cu_q, q.shape[0], problem.max_q)
        same = problem.cu_k is problem.cu_q and problem.max_k == problem.max_q and k.shape[0] == q.shape[0]
        k_rows = q_rows if same else row_positions(problem.cu_k, k.shape[0], Sk)
        q_len = (problem.cu_q[1:] - problem.cu_q[:-1]).to(torch.int64).view(B, 1, 1, 1, 1)
        k_len = (problem.cu_k[1:] - problem.cu_k[:-1]).to(torch.int64).view(B, 1, 1, 1, 1)
        shift = k_len - q_len
    kv = [_pad(t.to(ct), k_rows, B, Sk).permute(0, 2, 1, 3).contiguous() for t in (k, v)]
    chunk = max(1, SCORE_BLOCK_ELEMENTS // max(1, B * problem.heads * Sk))
    return _Batch(q=_group(q, problem, q_rows, ct), k=kv[0], v=kv[1], q_rows=q_rows, k_rows=k_rows,
                  q_len=q_len, k_len=k_len, bottom_right_shift=shift, chunk=chunk)


def _group(x: torch.Tensor, problem: Problem, rows, ct: torch.dtype) -> torch.Tensor:
    """Query-shaped ``(B, Sq, H, X)`` dense or ``(Tq, H, X)`` jagged to ``(B, Hkv, G, Sq, X)`` in ct."""
    x = _pad(x.to(ct), rows, problem.batch, problem.max_q)
    x = x.reshape(problem.batch, problem.max_q, problem.kv_heads, problem.group, x.shape[-1])
    return x.permute(0, 2, 3, 1, 4)


def _ungroup(x: torch.Tensor, problem: Problem) -> torch.Tensor:
    """``(B, Hkv, G, Sq, X)`` to ``(B, Sq, H, X)``."""
    return x.permute(0, 3, 1, 2, 4).reshape(problem.batch, problem.max_q, problem.heads, x.shape[-1])


def _ungroup_rows(x: torch.Tensor, problem: Problem, rows, dtype: torch.dtype) -> torch.Tensor:
    x = _ungroup(x, problem)
    return (x if rows is None else x[rows]).to(dtype)


def _unpad_kv(x: torch.Tensor, problem: Problem, rows, dtype: torch.dtype) -> torch.Tensor:
    """``(B, Hkv, Sk, X)`` to ``(B, Sk, Hkv, X)`` dense or ``(Tk, Hkv, X)`` jagged."""
    x = x.permute(0, 2, 1, 3)
    return (x if rows is None else x[rows]).to(dtype)


def _fold(x: torch.Tensor) -> torch.Tensor:
    """``(B, Hkv, G, n, X)`` to ``(B, Hkv, G * n, X)``: a matmul over it then sums the group too."""
    return x.reshape(x.shape[0], x.shape[1], x.shape[2] * x.shape[3], x.shape[-1])  # no -1: x may be empty


# ---------------------------------------------------------------------------------------- scores
def _scores(batch: _Batch, rows: tuple[int, int], bias, alibi, problem: Problem, opts: AttentionOptions):
    """Masked scores ``(B, Hkv, G, n, Sk)`` of query rows ``[rows[0], rows[1])``, and ``tanh(s / softcap)``
    (for the softcap's derivative; None without softcap). Hidden pairs hold -inf."""
    i0, i1 = rows
    B, Hkv, G, Sk = problem.batch, problem.kv_heads, problem.group, problem.max_k
    s = (batch.q[:, :, :, i0:i1] @ batch.k.unsqueeze(2).transpose(-1, -2)) * opts.scale
    capped = None
    if opts.softcap > 0:
        capped = torch.tanh(s / opts.softcap)
        s = capped * opts.softcap
    if bias is not None:
        b = bias[:, :, i0:i1] if bias.shape[2] > 1 else bias
        b = b[..., :Sk] if bias.shape[3] > 1 else b
        heads = (Hkv, G) if bias.shape[1] > 1 else (1, 1)
        s = s + b.reshape(b.shape[0], *heads, b.shape[2], b.shape[3]).to(s.dtype)
    i = torch.arange(i0, i1, device=s.device).view(i1 - i0, 1)
    j = torch.arange(Sk, device=s.device).view(1, Sk)
    if opts.query_offset is not None:
        shift = opts.query_offset.to(torch.int64).view(B, 1, 1, 1, 1)
    else:
        shift = batch.bottom_right_shift if opts.bottom_right else 0
    rel = j - (i + shift)  # key position relative to the query's diagonal: (n, Sk) or (B, 1, 1, n, Sk)
    if alibi is not None:
        s = s - alibi.reshape(B, Hkv, G, 1, 1).to(s.dtype) * rel.abs()
    # The band (causal, window) hides what the prefix (keys every query sees) doesn't show.
    band = None
    right = opts.visible_right()
    for beyond in ((rel > right) if right >= 0 else None,
                   (rel < -opts.window_left) if opts.window_left >= 0 else None):
        if beyond is not None:
            band = beyond if band is None else band | beyond
    if band is not None and opts.prefix_len is not None:
        band = band & (j >= opts.prefix_len.to(torch.int64).view(B, 1, 1, 1, 1))
    hidden = band
    if not problem.dense:
        padding = (i >= batch.q_len) | (j >= batch.k_len)
        hidden = padding if hidden is None else hidden | padding
    if opts.documents is not None:
        # Same document iff same first row; documents are dense self-attention, rows i0..i1 of each batch row.
        first = opts.documents[0].to(torch.int64)
        other = first[:, i0:i1].view(B, 1, 1, i1 - i0, 1) != first[:, :Sk].view(B, 1, 1, 1, Sk)
        hidden = other if hidden is None else hidden | other
    if hidden is not None:
        s = s.masked_fill(hidden, float("-inf"))
    return s, capped


def _softmax(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row softmax and logsumexp of masked scores; a row with no visible key gets p = 0, lse = -inf.

    The max of such a row is -inf, and ``exp(s - max)`` would be NaN: it is replaced by 0, so the row's
    exponentials are exp(-inf) = 0 and its sum 0, whose reciprocal is taken as 0.
    """
    if s.shape[-1] == 0:
        m = s.new_zeros(*s.shape[:-1], 1)
    else:
        m = s.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, 0.0)
    p = torch.exp(s - m)
    total = p.sum(dim=-1, keepdim=True)
    seen = total > 0
    p *= torch.where(seen, 1 / total, 0.0)
    lse = torch.where(seen, m + torch.log(total), float("-inf"))
    return p, lse.squeeze(-1)


def _remember(seed: DropoutSeed | None, key: tuple, value: torch.Tensor, budget: int) -> None:
    """Keep a chunk's ``value`` (its keep mask, or its softmax probabilities before dropout) for the call's backward,
    under ``key`` in ``seed.kept``: where the call has that memo, on the CPU, while the memo's tensors of its kind
    (masks are bool, probabilities floating point) stay within ``budget`` bytes with it. The memo lives with the call's
    autograd node, outside its saved tensors (so a call under saved-tensor hooks gets none:
    ``function._eager_seed``)."""
    if seed is None or seed.kept is None or value.device.type != "cpu":
        return
    kind = value.is_floating_point()
    held = sum(t.untyped_storage().nbytes() for t in seed.kept.values() if t.is_floating_point() == kind)
    if held + value.untyped_storage().nbytes() <= budget:
        seed.kept[key] = value


def _recall(seed: DropoutSeed | None, key: tuple, shape: tuple) -> torch.Tensor | None:
    """What the call's forward kept under ``key`` (:func:`_remember`), taken out of the memo, where it has ``shape``
    (another shape is another chunk's: the buckets were cut otherwise); else None."""
    kept = None if seed is None or seed.kept is None else seed.kept.pop(key, None)
    return kept if kept is not None and kept.shape == shape else None


def _chunk_keep(seed: DropoutSeed | None, problem: Problem, rows: tuple[int, int], opts: AttentionOptions,
                like: torch.Tensor, part: int, forward: bool) -> torch.Tensor | None:
    """Dropout factor ``keep * dropout_keep_scale(p)`` of the chunk's ``(B, Hkv, G, n, Sk)`` weights, or None.

    The forward keeps its keep bits (:func:`_remember`, under the length bucket's index ``part`` and the chunk's rows,
    up to ``KEPT_MASK_BYTES`` a call); the backward, which cuts the same buckets and chunks, takes them back
    (:func:`_recall`), or draws them again: the same bits either way, a pure function of the Philox key."""
    if seed is None or opts.dropout_p == 0.0:
        return None
    key = (part, *rows)
    keep = None if forward else _recall(seed, key, (problem.batch, problem.heads, rows[1] - rows[0], problem.max_k))
    if keep is None:
        keep = keep_mask_block(seed.seed, seed.offset, problem.batch, problem.heads, rows, problem.max_k,
                               opts.dropout_p, like.device, row_offset=opts.query_offset,
                               sequences=opts.dropout_sequences)
        if forward:
            _remember(seed, key, keep, KEPT_MASK_BYTES)
    return keep.view(like.shape).to(like.dtype).mul_(dropout_keep_scale(opts.dropout_p))


def _add_bias_grad(dbias: torch.Tensor, ds: torch.Tensor, rows: tuple[int, int], problem: Problem) -> None:
    """Add a chunk's score gradient ``(B, Hkv, G, n, Sk)`` into ``dbias`` of the bias's broadcast shape."""
    i0, i1 = rows
    ds = ds.reshape(problem.batch, problem.heads, i1 - i0, problem.max_k)
    summed = tuple(d for d in range(4) if dbias.shape[d] == 1 and ds.shape[d] != 1)
    if summed:
        ds = ds.sum(dim=summed, keepdim=True)
    target = dbias[:, :, i0:i1] if dbias.shape[2] > 1 else dbias
    target = target[..., :problem.max_k] if dbias.shape[3] > 1 else target
    target += ds
