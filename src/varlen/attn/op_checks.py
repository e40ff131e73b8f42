"""The operands of the attention custom ops, checked (``varlen::attention_forward`` / ``attention_backward``, which
anyone can call as ``torch.ops.varlen.*``): ``varlen.attention`` validates its arguments once (``api.prepare``) and
passes the ops what the kernels take; a direct call gets the same guarantees here. Operands that disagree with each
other or with the problem raise ValueError/TypeError naming them (a kernel indexing by the problem would read or
write past them), and the ones the kernels read at unit stride (head dims, offsets, per-sequence tensors, lse) are
made so. The bias and ALiBi checks are ``varlen.attention``'s own.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .._checks import (
    FLOAT_DTYPES,
    accumulate_dtype,
    check_dtype,
    check_ndim,
    check_same_device,
    check_same_dtype,
)
from ..tiling import last_dim_contiguous
from .options import AttentionOptions, Problem

# The per-sequence option tensors, (B,) integers each.
_PER_SEQUENCE = ("prefix_len", "query_offset", "dropout_sequences")


def check_bias(bias, problem: Problem, dtype: torch.dtype):
    """The bias as 4 dims; a bool mask becomes an additive one (0 where True, -inf where False) of ``dtype``, the
    inputs' (exact in every float dtype; the kernels that take a bias of the inputs' dtype then take it)."""
    if bias is None:
        return None
    if bias.dtype != torch.bool:
        check_dtype("bias", bias, FLOAT_DTYPES)
    if bias.dim() > 4:
        raise ValueError(f"bias: expected at most 4 dims (B, H, Sq, Sk), got shape {tuple(bias.shape)}")
    full = (problem.batch, problem.heads, problem.max_q, problem.max_k)
    shape = (1,) * (4 - bias.dim()) + tuple(bias.shape)
    for axis, (got, want, what) in enumerate(zip(shape, full, ("B", "H", "Sq", "Sk"), strict=True)):
        # (A jagged bias may be wider than the longest sequence; got >= want alone keeps a compiled call from guarding
        # on got == want: a graph for a bias as wide as max_len and another for a wider one.)
        ok = got == 1 or (got >= want if not problem.dense and axis >= 2 else got == want)
        if not ok:
            allowed = f"1 or {want}" + ("" if problem.dense or axis < 2 else " (or more, jagged)")
            raise ValueError(f"bias: shape {tuple(bias.shape)} does not broadcast to "
                             f"(B, H, Sq, Sk) = {full}: dim {what} is {got}, allowed {allowed}")
    bias = bias.reshape(shape)
    if bias.dtype == torch.bool:
        bias = torch.zeros(shape, dtype=dtype, device=bias.device).masked_fill(~bias, float("-inf"))
    return bias


def check_alibi(slopes, problem: Problem, dtype: torch.dtype):
    """ALiBi slopes ``(H,)`` or ``(B, H)`` as ``(B, H)`` in the accumulation dtype of ``dtype``."""
    if slopes is None:
        return None
    check_dtype("alibi_slopes", slopes, FLOAT_DTYPES)
    if slopes.requires_grad:
        raise ValueError("alibi_slopes: gradients with respect to the slopes are not computed; pass "
                         "slopes that don't require grad (e.g. slopes.detach())")
    B, H = problem.batch, problem.heads
    if slopes.shape == (H,):
        slopes = slopes.unsqueeze(0).expand(B, H)
    elif slopes.shape != (B, H):
        raise ValueError(f"alibi_slopes: expected shape ({H},) or ({B}, {H}), got {tuple(slopes.shape)}")
    return slopes.to(accumulate_dtype(dtype))  # float64 slopes stay float64 for float64 inputs


def lse_shape(q: Tensor, cu_q: Tensor | None) -> tuple:
    """The log-sum-exp's shape: ``(B, H, Sq)`` dense, ``(H, Tq)`` jagged."""
    return (q.shape[0], q.shape[2], q.shape[1]) if cu_q is None else (q.shape[1], q.shape[0])


def _integers(name: str, t: Tensor, shape: tuple) -> Tensor:
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected int32 or int64 values, got dtype {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")
    return t.contiguous()


def forward_operands(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, alibi: Tensor | None, problem: Problem,
                     opts: AttentionOptions) -> tuple:
    """``(q, k, v, bias, alibi, problem, opts)`` as the kernels take them, from an op's operands (``problem`` and
    ``opts`` as ``function.rebuild`` reads them back)."""
    dense = problem.dense
    ndim, layout = (4, "(batch, seq, heads, dim)") if dense else (3, "(rows, heads, dim): jagged values")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_ndim(name, t, ndim, layout)
        check_dtype(name, t, FLOAT_DTYPES)
    check_same_dtype([("q", q), ("k", k), ("v", v)])
    tensors = [("q", q), ("k", k), ("v", v), ("bias", bias), ("alibi", alibi), ("cu_q", problem.cu_q),
               ("cu_k", problem.cu_k)]
    check_same_device(tensors + [(name, getattr(opts, name)) for name in (*_PER_SEQUENCE, "documents")])
    H, D, Hkv = q.shape[-2], q.shape[-1], k.shape[-2]
    if k.shape[-1] != D:
        raise ValueError(f"k: head dim {k.shape[-1]} differs from q's {D}")
    if v.shape[-2] != Hkv:
        raise ValueError(f"v: {v.shape[-2]} heads differ from k's {Hkv}")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"q: {H} heads are not a multiple of k/v's {Hkv} heads (GQA/MQA needs H % Hkv == 0)")
    if D == 0 or v.shape[-1] == 0:
        raise ValueError(f"q, k, v: head dims must be >= 1, got D = {D}, Dv = {v.shape[-1]}")
    if v.shape[:-2] != k.shape[:-2]:
        raise ValueError(f"v: shape {tuple(v.shape)} differs from k's {tuple(k.shape)} before the heads")
    if dense:
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"k: batch size {k.shape[0]} differs from q's {q.shape[0]}")
        if problem.cu_k is not None:
            raise ValueError("cu_k: given without cu_q; a jagged call passes both, a dense call neither")
        if (problem.max_q, problem.max_k) != (q.shape[1], k.shape[1]):
            raise ValueError(f"max_q, max_k: a dense call's are q's and k's sequence lengths ({q.shape[1]}, "
                             f"{k.shape[1]}); got ({problem.max_q}, {problem.max_k})")
    else:
        cu_q = _integers("cu_q", problem.cu_q, (problem.batch + 1,))
        if problem.cu_k is None:
            raise ValueError("cu_k: missing; a jagged call passes both offsets (the same tensor for self-attention)")
        cu_k = _integers("cu_k", problem.cu_k, (problem.batch + 1,))
        if min(problem.max_q, problem.max_k) < 0:
            raise ValueError(f"max_q, max_k: expected lengths >= 0, got ({problem.max_q}, {problem.max_k})")
        if cu_q is not problem.cu_q or cu_k is not problem.cu_k:
            problem = dataclasses.replace(problem, cu_q=cu_q, cu_k=cu_k)
    per_sequence = {name: _integers(name, getattr(opts, name), (problem.batch,))
                    for name in _PER_SEQUENCE if getattr(opts, name) is not None}
    if opts.documents is not None:
        if not dense:
            raise ValueError("documents: only for dense inputs (packed rows)")
        per_sequence["documents"] = _integers("documents", opts.documents, (2, problem.batch, problem.max_q))
    if any(t is not getattr(opts, name) for name, t in per_sequence.items()):
        opts = dataclasses.replace(opts, **per_sequence)
    bias = check_bias(bias, problem, q.dtype)
    alibi = check_alibi(alibi, problem, q.dtype)
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))  # (the kernels walk the head dim at stride 1)
    return q, k, v, bias, alibi, problem, opts


def backward_operands(dout: Tensor, dlse: Tensor | None, q: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                      bias: Tensor | None, problem: Problem, needs: tuple) -> tuple:
    """``(dout, dlse, out, lse)`` as the backward kernels take them, checked against ``q`` and ``v`` (checked by
    :func:`forward_operands`)."""
    want = (*q.shape[:-1], v.shape[-1])
    for name, t in (("out", out), ("dout", dout)):
        if tuple(t.shape) != want:
            raise ValueError(f"{name}: expected shape {want} (q's rows and heads, v's head dim), got "
                             f"{tuple(t.shape)}")
    check_same_dtype([("q", q), ("out", out), ("dout", dout)])
    lse_want, lse_dtype = lse_shape(q, problem.cu_q), accumulate_dtype(q.dtype)
    for name, t in (("lse", lse), ("dlse", dlse)):
        if t is not None and (tuple(t.shape) != lse_want or t.dtype != lse_dtype):
            raise ValueError(f"{name}: expected shape {lse_want} of dtype {lse_dtype}, got {tuple(t.shape)} of "
                             f"{t.dtype}")
    check_same_device([("q", q), ("out", out), ("dout", dout), ("lse", lse), ("dlse", dlse)])
    if needs[3] and bias is None:
        raise ValueError("needs: a bias gradient asked for without a bias")
    out, dout = last_dim_contiguous(out), last_dim_contiguous(dout)
    return dout, None if dlse is None else dlse.contiguous(), out, lse.contiguous()
