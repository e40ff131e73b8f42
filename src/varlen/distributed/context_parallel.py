"""Context parallelism: one packed batch of sequences split across the ranks of a process group.

Design (see ``ContextParallel``): each rank owns some query rows (the plan, ``plan.py``); attention
all-gathers K and V (one collective for both, in their dtype), and each rank's queries attend in one
varlen call in which every piece of a sequence is a sequence of its own, its keys that sequence's first
``k_len`` keys and its queries placed at their positions (``query_offset``), its dropout mask the whole
sequence's (``dropout_sequences``). So the result is exact: no lse merging, no approximation. The gathered
K and V are not kept for the backward, which gathers them again: a rank's saved activations are its own
rows only. The backward sums dK and dV into the gathered layout in float32 and reduce-scatters them to
their owners.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from .. import _amp
from .._backend import refuse_double_backward
from .._checks import accumulate_dtype, check_choice, check_int, check_tensor, is_int, type_name
from ..attn import api, function
from ..attn.options import AttentionOptions
from ..jagged import JaggedTensor
from ..offsets import check_offsets, check_offsets_tensor, read_on_host
from .plan import BALANCES, Piece, make_plan

# funcol's single-tensor collectives (their older names in the torch versions that lack these).
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
_reduce_scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor


@dataclasses.dataclass(frozen=True)
class _Layout:
    """The local varlen call of one rank, for one visible-right bound, on one device."""

    q_cu: torch.Tensor  # (P + 1,) int32: the rank's pieces, one after another
    k_cu: torch.Tensor  # (P + 1,) int32: each piece's keys, one after another
    key_rows: torch.Tensor  # (sum k_len,) int64: rows of the gathered K/V each piece's keys are
    query_offset: torch.Tensor  # (P,) int32: each piece's first query position
    sequences: torch.Tensor  # (P,) int32 (int64 view for indexing): each piece's sequence
    max_q: int
    max_k: int


class ContextParallel:
    """Attention over a packed batch of sequences split across the ranks of a process group, exactly.

    Args:
        offsets: the packed global batch's offsets ``(B + 1,)`` (int32/int64, host or device; read on the
            host once here), identical on every rank.
        group: the process group (default: the world). Collectives run on it: NCCL for CUDA tensors,
            gloo for CPU ones.
        balance: ``"causal"`` (equal attention work under a causal mask: long sequences in zig-zag
            chunks, short ones whole) or ``"tokens"`` (equal token counts). See ``plan.py``.

    ``local_index`` (int64, on ``offsets``' device) lists the global rows this rank owns, in the order
    :meth:`attention` takes and returns them: ``out = cp.attention(q[idx], k[idx], v[idx], causal=True)``.
    Any world size and any lengths work; a rank may own no row (it still joins the collectives).

    Every rank must call :meth:`attention` (and, in training, the backward through its output) the same
    number of times in the same order, as with any collective. For dropout, every rank must draw from
    generators in the same state (the same seed): the mask is then the one ``varlen.attention`` on the
    whole batch draws. The plan reads the offsets once; forward and backward make no host syncs.
    """

    def __init__(self, offsets: torch.Tensor, group: dist.ProcessGroup | None = None, balance: str = "causal"):
        check_offsets_tensor("offsets", offsets)
        check_choice("balance", balance, BALANCES)
        host = read_on_host(offsets, "offsets", "build the ContextParallel outside the capture")
        host = check_offsets(host, int(host[-1]), None)
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialized; call torch.distributed."
                             "init_process_group first")
        self.group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.plan = make_plan((host[1:] - host[:-1]).tolist(), self.world, balance)
        self.batch = len(self.plan.lengths)
        counts = [self.plan.rows(r) for r in range(self.world)]
        # Each rank's rows padded to the longest rank's count: the all-gather's equal blocks.
        self._block_rows = max(max(counts), 1)
        starts = host[:-1].tolist()
        gathered = torch.empty(int(host[-1]), dtype=torch.int64)  # global row -> row in the gathered K/V
        self.local_index = torch.zeros(0, dtype=torch.int64, device=offsets.device)
        for r, pieces in enumerate(self.plan.pieces):
            rows = [torch.arange(starts[p.sequence] + p.start, starts[p.sequence] + p.end) for p in pieces]
            if rows:
                owned = torch.cat(rows)
                gathered[owned] = r * self._block_rows + torch.arange(owned.numel())
                if r == self.rank:
                    self.local_index = owned.to(offsets.device)
        self._starts = starts
        self._gathered_row = gathered
        # A rank without rows runs one empty piece, so that its call has the same shape as the others'.
        self._pieces = self.plan.pieces[self.rank] or (Piece(0, 0, 0),)
        self._layouts: dict = {}

    @property
    def local_rows(self) -> int:
        return self.local_index.numel()

    # ------------------------------------------------------------------------------------- layout
    def _layout(self, device: torch.device, right: int) -> _Layout:
        """Device metadata of this rank's call when queries see keys up to ``right`` past their position
        (-1: unbounded): each piece's keys are its sequence's first ``k_len`` keys."""
        key = (device, right)
        if key not in self._layouts:
            k_lens, key_rows = [], []
            for p in self._pieces:
                length = self.plan.lengths[p.sequence]
                k_len = length if right < 0 else min(length, p.end + right)
                k_len = k_len if p.rows else 0
                k_lens.append(k_len)
                first = self._starts[p.sequence]
                key_rows.append(self._gathered_row[first:first + k_len])
            q_lens = [p.rows for p in self._pieces]

            def cu(lengths):
                return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(device, torch.int32)

            self._layouts[key] = _Layout(
                q_cu=cu(q_lens), k_cu=cu(k_lens), key_rows=torch.cat(key_rows).to(device),
                query_offset=torch.tensor([p.start for p in self._pieces], dtype=torch.int32, device=device),
                sequences=torch.tensor([p.sequence for p in self._pieces], dtype=torch.int32, device=device),
                max_q=max(q_lens), max_k=max(k_lens))
        return self._layouts[key]

    # ---------------------------------------------------------------------------------- attention
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                  window: tuple[int | None, int | None] | None = None, align: str = "top_left",
                  scale: float | None = None, alibi_slopes: torch.Tensor | None = None, softcap: float = 0.0,
                  dropout_p: float = 0.0, generator: torch.Generator | None = None, deterministic: bool = False,
                  prefix_len: int | torch.Tensor | None = None, return_lse: bool = False,
                  backend: str | None = None, head_chunks: int | None = None):
        """This rank's rows of ``varlen.attention`` on the whole batch (self-attention: q, k, v share the
        offsets).

        Args:
            q: ``(rows, H, D)``, k: ``(rows, Hkv, D)``, v: ``(rows, Hkv, Dv)``: this rank's rows, in
                ``local_index`` order (``rows = len(local_index)``).
            causal, window, align, scale, softcap, dropout_p, generator, deterministic, backend: as in
                ``varlen.attention`` (q and k have the same lengths, so both alignments agree).
            alibi_slopes: ``(H,)`` or ``(B, H)`` for the global batch.
            prefix_len: an int or ``(B,)`` for the global batch.
            head_chunks: run the kv heads in this many groups, one after another, each with its own
                all-gather and reduce-scatter: a rank then holds one group's gathered K/V (and its float32
                dK/dV sums) at a time, not every head's. None (default): the smallest divisor of the kv heads
                that is at least ``2 * world`` (a group's gathered K/V at most half the rank's own K/V);
                1 with dropout (its mask is keyed on the head index inside one call).

        Returns:
            ``(rows, H, Dv)``, and with ``return_lse`` the lse ``(H, rows)``. Differentiable with respect
            to q, k and v (the gradients of k and v include what other ranks' queries send back).
        """
        for name, t in (("q", q), ("k", k), ("v", v)):
            check_tensor(name, t)
            if t.dim() != 3 or t.shape[0] != self.local_rows:
                raise ValueError(f"{name}: expected ({self.local_rows}, heads, dim), this rank's rows in local_index "
                                 f"order, got shape {tuple(t.shape)}")
        check_choice("align", align, ("top_left", "bottom_right"))
        left, right = api.parse_window(window)
        visible_right = AttentionOptions(scale=1.0, causal=causal, window_left=left, window_right=right).visible_right()
        # A prefix is seen by every query of its sequence, past the band too: then every key is needed.
        layout = self._layout(q.device, -1 if prefix_len is not None else visible_right)
        index = layout.sequences.long()
        if isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.dim() == 2:
            if alibi_slopes.shape[0] != self.batch:
                raise ValueError(f"alibi_slopes: expected ({self.batch}, H) for the global batch, got "
                                 f"{tuple(alibi_slopes.shape)}")
            alibi_slopes = alibi_slopes[index]
        if isinstance(prefix_len, torch.Tensor):
            if tuple(prefix_len.shape) != (self.batch,):
                raise ValueError(f"prefix_len: expected ({self.batch},) for the global batch, got "
                                 f"{tuple(prefix_len.shape)}")
            prefix_len = prefix_len[index]
        qj = JaggedTensor._trusted(q, layout.q_cu, layout.max_q)
        # k and v as the local call will see them (shapes only: the gathered rows exist inside the op).
        k_rows = layout.key_rows.numel()
        kj = JaggedTensor._trusted(k.new_empty(1, *k.shape[1:]).expand(k_rows, *k.shape[1:]), layout.k_cu,
                                   layout.max_k)
        vj = kj.with_values(v.new_empty(1, *v.shape[1:]).expand(k_rows, *v.shape[1:]))
        call = api.prepare(qj, kj, vj, causal=causal, window=window, align="top_left", scale=scale, bias=None,
                           alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p, generator=generator,
                           deterministic=deterministic, backend=backend, prefix_len=prefix_len,
                           query_offset=layout.query_offset, dropout_sequences=layout.sequences)
        qt, _, _, _, alibi, problem, opts, impl, seed = call.args
        extras, primitives = function.flatten(alibi, problem, opts, impl.NAME, seed)
        k, v = _amp.cast(_amp.LOWER_PRECISION, qt.device, k, v)  # as api.prepare cast q
        chunks = head_chunks_for(k.shape[1], self.world, dropout_p, head_chunks)
        out, lse = _ContextParallelAttention.apply(qt, k, v, layout.key_rows, self._block_rows, self.group, chunks,
                                                   extras, primitives)
        return (out, lse) if return_lse else out


def head_chunks_for(kv_heads: int, world: int, dropout_p: float, requested: int | None) -> int:
    """How many kv-head groups the attention runs in, one after another (see ``ContextParallel.attention``).

    Default: the smallest divisor of ``kv_heads`` that is at least ``2 * world`` (all of them if none is), so
    that a group's gathered K/V is at most half the size of the rank's own K/V; 1 with dropout, whose mask
    is keyed on the head's index inside the call.
    """
    if requested is not None:
        if not is_int(requested):
            raise TypeError(f"head_chunks: expected an int or None, got {type_name(requested)}")
        requested = check_int("head_chunks", requested)
        if requested < 1 or kv_heads % requested:
            raise ValueError(f"head_chunks: got {requested}; it must divide the {kv_heads} kv heads")
        if requested > 1 and dropout_p > 0:
            raise ValueError(f"head_chunks: got {requested} with dropout_p={dropout_p}; dropout's mask is keyed on "
                             "the head index within one call, so with dropout the heads run in one chunk (1)")
        return requested
    if dropout_p > 0:
        return 1
    return next((c for c in range(2 * world, kv_heads + 1) if kv_heads % c == 0), kv_heads)


def _head_slices(heads: int, kv_heads: int, chunks: int):
    """``(q heads, kv heads)`` slices of each chunk: kv heads in ``chunks`` groups with their query heads."""
    per_kv, per_q = kv_heads // chunks, heads // chunks
    return [(slice(c * per_q, (c + 1) * per_q), slice(c * per_kv, (c + 1) * per_kv)) for c in range(chunks)]


def _chunk_extras(extras: list, q_heads: slice, chunks: int) -> list:
    """The call's tensor arguments for one head chunk: ALiBi slopes ``(H,)`` or ``(P, H)`` sliced to its heads."""
    if chunks == 1 or extras[0] is None:
        return extras
    return [extras[0][..., q_heads], *extras[1:]]


# ------------------------------------------------------------------------------------ collectives
def _gather(k: torch.Tensor, v: torch.Tensor, key_rows: torch.Tensor, block_rows: int, group):
    """Every rank's K and V rows (one all-gather of both, each rank's block padded to ``block_rows``),
    then the rows ``key_rows`` of that: the local call's keys and values (contiguous)."""
    rows = k.shape[0]
    width_k = k.shape[1] * k.shape[2]
    kv = torch.cat([k.reshape(rows, -1), v.reshape(rows, -1)], dim=1)
    if rows < block_rows:
        kv = torch.cat([kv, kv.new_zeros(block_rows - rows, kv.shape[1])])
    everyone = funcol.wait_tensor(_all_gather(kv.contiguous(), 0, group))
    k_call = everyone[:, :width_k].index_select(0, key_rows).view(-1, *k.shape[1:])
    v_call = everyone[:, width_k:].index_select(0, key_rows).view(-1, *v.shape[1:])
    return k_call, v_call


def _scatter(d_call: torch.Tensor, key_rows: torch.Tensor, block_rows: int, group, like: torch.Tensor):
    """The local call's dK (or dV) summed, in float32 (float64 for float64), into the gathered layout and
    reduce-scattered to the rows' owners: this rank's rows, shaped and typed as ``like``."""
    world = dist.get_world_size(group)
    flat = d_call.reshape(d_call.shape[0], -1)
    summed = flat.new_zeros(world * block_rows, flat.shape[1], dtype=accumulate_dtype(flat.dtype))
    # index_put_ with accumulate: deterministic under torch.use_deterministic_algorithms (sorted), unlike index_add_.
    summed.index_put_((key_rows,), flat.to(summed.dtype), accumulate=True)
    mine = funcol.wait_tensor(_reduce_scatter(summed, "sum", 0, group))[:like.shape[0]]
    return mine.view(like.shape).to(like.dtype)


def _attention_forward(*args):
    if torch.compiler.is_compiling():
        return torch.ops.varlen.attention_forward(*args)
    return function._forward_impl(*args)


def _attention_backward(*args):
    if torch.compiler.is_compiling():
        return torch.ops.varlen.attention_backward(*args)
    return function._backward_impl(*args)


class _ContextParallelAttention(torch.autograd.Function):
    """The local attention with its keys gathered from every rank, one kv-head chunk at a time, gathered
    again in the backward. Only this rank's rows are saved."""

    @staticmethod
    def forward(ctx, q, k, v, key_rows, block_rows, group, chunks, extras, primitives):
        slices = _head_slices(q.shape[1], k.shape[1], chunks)
        out = lse = None
        for q_heads, kv_heads in slices:
            k_call, v_call = _gather(k[:, kv_heads], v[:, kv_heads], key_rows, block_rows, group)
            q_chunk = q if chunks == 1 else q[:, q_heads]  # a strided view: the backends take head strides
            o, l = _attention_forward(q_chunk, k_call, v_call, None, _chunk_extras(extras, q_heads, chunks),
                                      *primitives)
            del k_call, v_call
            if chunks == 1:
                out, lse = o, l
                break
            if out is None:
                out = o.new_empty(q.shape[0], q.shape[1], o.shape[2])
                lse = l.new_empty(q.shape[1], *l.shape[1:])
            out[:, q_heads] = o
            lse[q_heads] = l
        present = [e is not None for e in extras]
        ctx.save_for_backward(q, k, v, out, lse, key_rows, *(e for e in extras if e is not None))
        ctx.layout = (block_rows, group, chunks, present, primitives)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, key_rows, *kept = ctx.saved_tensors
        block_rows, group, chunks, present, primitives = ctx.layout
        kept = iter(kept)
        extras = [next(kept) if p else None for p in present]
        if dout is None:
            dout = torch.zeros_like(out)
        needs = [ctx.needs_input_grad[0], True, True, False]  # dK and dV: every rank joins the reduce-scatter
        dq = torch.empty_like(q) if needs[0] and chunks > 1 else None
        dk = torch.empty_like(k) if chunks > 1 else None
        dv = torch.empty_like(v) if chunks > 1 else None
        for q_heads, kv_heads in _head_slices(q.shape[1], k.shape[1], chunks):
            def part(t, heads=q_heads):
                return t if chunks == 1 else t[:, heads]

            k_call, v_call = _gather(k[:, kv_heads], v[:, kv_heads], key_rows, block_rows, group)
            grads = _attention_backward(part(dout), None if dlse is None else dlse[q_heads], part(q), k_call, v_call,
                                        part(out), lse[q_heads], None, _chunk_extras(extras, q_heads, chunks),
                                        *primitives, needs)
            del k_call, v_call
            dk_chunk = _scatter(grads[-2], key_rows, block_rows, group, k[:, kv_heads])
            dv_chunk = _scatter(grads[-1], key_rows, block_rows, group, v[:, kv_heads])
            if chunks == 1:
                dq = grads[0] if needs[0] else None
                dk, dv = dk_chunk, dv_chunk
                break
            if needs[0]:
                dq[:, q_heads] = grads[0]
            dk[:, kv_heads] = dk_chunk
            dv[:, kv_heads] = dv_chunk
            del grads
        return (*refuse_double_backward(function.DOUBLE_BACKWARD, (dq, dk, dv), q, k, v, dout), None, None, None, None,
                None, None)
