"""The reference attention: plain materialised math, one sequence at a time, differentiable by autograd.

Every backend, test and benchmark compares against this. It is written independently of the backends
and favours being obviously right over speed or memory.
"""

from __future__ import annotations

import torch

from ..jagged import JaggedTensor, as_jagged
from .dropout import dropout_keep_scale


def attention_reference(q, k, v, *, causal: bool = False, window: tuple[int | None, int | None] | None = None,
                        align: str = "top_left", scale: float | None = None, bias: torch.Tensor | None = None,
                        alibi_slopes: torch.Tensor | None = None, softcap: float = 0.0,
                        dropout_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                        prefix_len: int | torch.Tensor | None = None, document_ids: torch.Tensor | None = None,
                        query_offset: int | torch.Tensor | None = None):
    """Attention computed naively in the inputs' dtype; returns ``(out, lse)``.

    Same arguments and semantics as ``varlen.attention`` (see its docstring), except that dropout is
    given as an explicit keep mask. Inputs are trusted (no validation); autograd differentiates
    everything, so reference gradients come from ``torch.autograd.grad``.

    Args:
        q, k, v: dense ``(B, Sq, H, D)``, ``(B, Sk, Hkv, D)``, ``(B, Sk, Hkv, Dv)`` tensors, or jagged
            tensors (JaggedTensor or ``torch.nested``) of logical shapes ``(B, j, H, D)`` etc.
        causal, window, align, scale, softcap, prefix_len, document_ids, query_offset: as in
            ``varlen.attention``.
        bias: float or bool, broadcastable to ``(B, H, Sq, Sk)`` (jagged: ``(B, H, >= max_q, >= max_k)``).
        alibi_slopes: ``(H,)`` or ``(B, H)``.
        dropout_mask: bool keep mask ``(B, H, max_q, max_k)`` (dense: ``(B, H, Sq, Sk)``), applied to
            the probabilities, kept ones scaled by ``dropout_keep_scale(dropout_p)`` (``1 / (1 - dropout_p)``
            with dropout_p rounded to a multiple of 2**-8, as the mask draws it); None for no dropout. Get a
            call's mask with ``varlen.attn.dropout.attention_dropout_mask``.
        dropout_p: the drop probability the mask was drawn with.

    Returns:
        ``out`` in q's layout with head dim Dv (a JaggedTensor sharing q's offsets for jagged inputs),
        and ``lse`` (natural log, in the inputs' dtype): ``(B, H, Sq)`` dense, ``(H, total_q)`` jagged;
        -inf for a query that sees no key (whose output is 0, with zero gradients).

    Example::

        >>> q, k, v = (torch.randn(2, 5, 4, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
        >>> out, lse = attention_reference(q, k, v, causal=True)
        >>> out.shape, lse.shape
        (torch.Size([2, 5, 4, 16]), torch.Size([2, 4, 5]))
        >>> dq, = torch.autograd.grad(out.sum(), q)
    """
    dense = not (isinstance(q, JaggedTensor) or q.is_nested)
    if dense:
        B = q.shape[0]
        q_seqs, k_seqs, v_seqs = list(q), list(k), list(v)  # the Python loop is the point here
        D, dtype = q.shape[-1], q.dtype
    else:
        qj = as_jagged(q, "q")
        B = qj.batch_size
        q_seqs, k_seqs, v_seqs = qj.unbind(), as_jagged(k, "k").unbind(), as_jagged(v, "v").unbind()
        D, dtype = qj.values.shape[-1], qj.dtype
    scale = D ** -0.5 if scale is None else scale
    left, right = window if window is not None else (None, None)
    if bias is not None:
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
        if bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=dtype, device=bias.device).masked_fill(
                ~bias, float("-inf"))
    if alibi_slopes is not None and alibi_slopes.dim() == 1:
        alibi_slopes = alibi_slopes.expand(B, -1)

    outs, lses = [], []
    for b in range(B):
        qb, kb, vb = q_seqs[b], k_seqs[b], v_seqs[b]  # (Lq, H, D), (Lk, Hkv, D), (Lk, Hkv, Dv)
        Lq, H, Lk = qb.shape[0], qb.shape[1], kb.shape[0]
        group = H // kb.shape[1]
        kb, vb = kb.repeat_interleave(group, dim=1), vb.repeat_interleave(group, dim=1)  # head h -> h // g
        s = scale * torch.einsum("ihd,jhd->hij", qb, kb)  # (H, Lq, Lk)
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(Lq, device=qb.device).view(-1, 1)
        j = torch.arange(Lk, device=qb.device).view(1, -1)
        if query_offset is not None:
            shift = int(query_offset[b] if isinstance(query_offset, torch.Tensor) else query_offset)
        else:
            shift = Lk - Lq if align == "bottom_right" else 0
        if bias is not None:
            bb = bias[b if bias.shape[0] > 1 else 0]
            # (in the inputs' dtype, whatever the bias's: varlen.attention takes a bias of another float dtype)
            s = s + bb[:, :Lq if bb.shape[1] > 1 else 1, :Lk if bb.shape[2] > 1 else 1].to(s.dtype)
        if alibi_slopes is not None:
            s = s - alibi_slopes[b].to(s.dtype).view(H, 1, 1) * (i + shift - j).abs()
        visible = torch.ones(Lq, Lk, dtype=torch.bool, device=qb.device)
        if causal:
            visible &= j <= i + shift
        if left is not None and left >= 0:
            visible &= j >= i + shift - left
        if right is not None and right >= 0:
            visible &= j <= i + shift + right
        if prefix_len is not None:
            visible |= j < int(prefix_len[b] if isinstance(prefix_len, torch.Tensor) else prefix_len)
        if document_ids is not None:
            # A document is a run of equal ids: number the runs along the row.
            ids = document_ids[b]
            run = torch.cat([ids.new_zeros(1), (ids[1:] != ids[:-1]).to(ids.dtype)]).cumsum(0)
            visible &= run.view(-1, 1) == run.view(1, -1)
        s = s.masked_fill(~visible, float("-inf"))
        p, lse = _softmax_and_lse(s)
        if dropout_mask is not None:
            p = p * dropout_mask[b, :, :Lq, :Lk].to(p.dtype) * dropout_keep_scale(dropout_p)
        outs.append(torch.einsum("hij,jhd->ihd", p, vb))
        lses.append(lse)

    if dense:
        if B == 0:  # (no sequence to stack)
            return q.new_zeros(*q.shape[:-1], v.shape[-1]), q.new_zeros(0, q.shape[2], q.shape[1])
        return torch.stack(outs), torch.stack(lses)
    return qj.with_values(torch.cat(outs)), torch.cat(lses, dim=1)


def _softmax_and_lse(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the last dim and its logsumexp, with rows of only -inf giving p = 0, lse = -inf.

    ``torch.softmax`` would give NaN for such rows (and NaN gradients), so the normaliser of an empty
    row is replaced by 1; its probabilities are exp(-inf) = 0 either way. The row max is detached: the
    result doesn't depend on it mathematically, only numerically.
    """
    if s.shape[-1] == 0:
        m = s.new_zeros(*s.shape[:-1], 1)
    else:
        m = s.detach().amax(dim=-1, keepdim=True)
        m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    seen = total > 0
    total = torch.where(seen, total, torch.ones_like(total))
    lse = torch.where(seen, m + torch.log(total), torch.full_like(total, float("-inf")))
    return e / total, lse.squeeze(-1)
