"""A drop-in for flash-attn 2.x's ``flash_attn.flash_attn_interface`` (the training functions).

``from varlen.flash_attn_interface import flash_attn_func, flash_attn_varlen_func`` in place of
``from flash_attn import ...``: the six functions below take flash-attn 2.x's arguments, in its order, with
its defaults and conventions (those of the flash-attn 2.7 / 2.8 releases):

- layouts: dense ``(B, S, H, D)``; varlen ``(total, H, D)`` with ``cu_seqlens`` ``(B + 1,)`` int32 offsets
  on the device and ``max_seqlen`` host ints; packed ``qkv`` ``(B, S, 3, H, D)`` / ``(total, 3, H, D)``,
  ``kv`` ``(B, S, 2, Hkv, D)`` / ``(total, 2, Hkv, D)``. GQA/MQA: k, v with ``Hkv`` dividing ``H``.
- ``causal`` and ``window_size`` are aligned to the bottom-right corner of each sequence's attention
  matrix (flash-attn >= 2.1): query i sees keys ``[i + Lk - Lq - window_size[0], i + Lk - Lq +
  window_size[1]]``, a negative side unbounded, and ``causal`` caps the right side at 0. ALiBi adds
  ``-slope * |i + Lk - Lq - j|``. ``softcap > 0`` caps the scores with ``softcap * tanh(s / softcap)``.
- ``window_size`` may also be a 2-element integer tensor ``[left, right]`` on any device (read on the
  host: a device-to-host copy on a GPU).
- ``return_attn_probs=True`` returns ``(out, softmax_lse, S_dmask)``: lse float32 (float64 for float64
  inputs) ``(B, H, Sq)`` dense or ``(H, total_q)`` varlen. ``S_dmask`` is what flash-attn 2.7 / 2.8
  returns there, made exact: with ``dropout_p == 0`` an empty ``(0,)`` tensor (so asking for the lse
  costs nothing more); otherwise the attention probabilities ``(B, H, Sq, Sk)`` (varlen ``(B, H,
  max_seqlen_q, max_seqlen_k)``, entry ``[b, h, i, j]`` being query i and key j of sequence b) in q's
  dtype, with the dropped ones negated. ``S_dmask.abs()`` is the softmax before dropout and its
  ``1 / (1 - p)`` scaling (0 where masked or past a sequence's end); ``torch.signbit(S_dmask)`` is the
  call's drop mask, the complement of ``varlen.attention_dropout_mask`` (a dropped 0 is ``-0.0``, which
  flash-attn's test convention ``S_dmask >= 0`` counts as kept). flash-attn pads its matrix to
  multiples of 128 and scales it per block; this one is unpadded and normalised. Computed only when
  asked for, materialised in float32 (float64 for float64 inputs; ``O(B * H * Sq * Sk)`` memory) and
  not differentiable: for tests and debugging at small sizes.
- ``flash_attn.bert_padding``'s ``unpad_input`` / ``pad_input`` are ``varlen.bert_padding``'s.

Differences from flash-attn: dropout draws other bits (Philox4x32-7 and 8-bit thresholds as flash-attn, kept
weights scaled by the inverse of the exact keep rate, 256 / (256 - t), where flash-attn uses 1 / (1 - p)); a
query that sees no key gets lse ``-inf`` (flash-attn gives ``+inf``), output 0 in both; the lse is
differentiable; fp32/fp64 inputs and any head dim work. ``cu_seqlens`` and ``max_seqlen`` on a GPU are
trusted without a device-to-host check, as in flash-attn, but wrong ones never make a kernel touch memory
outside its tensors; ``varlen.set_checks(True)`` (or ``VARLEN_CHECKS=1``) validates them on every call, as
is always done on the CPU: ``cu_seqlens`` start at 0, never decrease and end at the row count, and
``max_seqlen`` is at least the longest length (larger is legal). ``block_table`` (paged KV cache) and
``flash_attn_with_kvcache`` are not provided.
"""

from __future__ import annotations

import numbers

import torch

from ._checks import (
    INDEX_DTYPES,
    accumulate_dtype,
    check_bool,
    check_dtype,
    check_scale,
    check_tensor,
    host_int,
    is_int,
    is_integer_dtype,
)
from .attn.api import attention
from .attn.dropout import attention_dropout_mask
from .jagged import JaggedTensor


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """Attention over a dense batch: q ``(B, Sq, H, D)``, k ``(B, Sk, Hkv, D)``, v ``(B, Sk, Hkv, Dv)``.

    ``window_size``: ``(left, right)`` ints (or an integer tensor of shape ``(2,)``), -1 for unbounded.

    Returns ``out`` ``(B, Sq, H, Dv)``, or ``(out, softmax_lse (B, H, Sq), S_dmask)`` when
    ``return_attn_probs``: ``S_dmask`` is an empty tensor when ``dropout_p == 0``, else the probabilities
    ``(B, H, Sq, Sk)`` before dropout with the dropped ones negated (computed only then, ``O(Sq * Sk)``
    memory). See the module docstring for the conventions; raises ValueError / TypeError naming the
    argument for invalid inputs.
    """
    return _attend(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                              softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn_func`` on ``qkv`` ``(B, S, 3, H, D)`` (views, no copies)."""
    q, k, v = _unpack("qkv", qkv, 5, 3)
    return _attend(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                             softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn_func`` on q ``(B, Sq, H, D)`` and ``kv`` ``(B, Sk, 2, Hkv, D)``."""
    k, v = _unpack("kv", kv, 5, 2)
    return _attend(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """Attention over variable-length sequences stored one after another, without padding.

    Args:
        q: ``(total_q, H, D)``; sequence b is ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]``.
        k: ``(total_k, Hkv, D)``; v: ``(total_k, Hkv, Dv)``, both indexed by ``cu_seqlens_k``.
        cu_seqlens_q, cu_seqlens_k: ``(B + 1,)`` int32 (or int64) offsets on q's device (trusted on a GPU
            outside the checking mode: see ``varlen.set_checks``).
        max_seqlen_q, max_seqlen_k: host ints, the longest lengths (upper bounds are fine).
        block_table: must be None (paged KV caches are not supported).
        Others: as ``flash_attn_func``.

    Returns ``out`` ``(total_q, H, Dv)``, or ``(out, softmax_lse (H, total_q), S_dmask)``, ``S_dmask``
    as in ``flash_attn_func`` with shape ``(B, H, max_seqlen_q, max_seqlen_k)``. No device-to-host copies
    (a tensor given for a ``max_seqlen`` or for ``window_size`` is read, which is one).
    """
    if block_table is not None:
        raise ValueError("block_table: paged KV caches are not supported by varlen; pass block_table=None")
    q, k, v = _jagged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _attend(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                                     window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """``flash_attn_varlen_func`` on ``qkv`` ``(total, 3, H, D)`` with one ``cu_seqlens`` / ``max_seqlen``."""
    q, k, v = _unpack("qkv", qkv, 4, 3)
    q, k, v = _jagged(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen)
    return _attend(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                                    softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    """``flash_attn_varlen_func`` on q ``(total_q, H, D)`` and ``kv`` ``(total_k, 2, Hkv, D)``."""
    k, v = _unpack("kv", kv, 4, 2)
    q, k, v = _jagged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    return _attend(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


# ------------------------------------------------------------------------------------------ helpers
def _attend(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
            return_attn_probs):
    check_bool("return_attn_probs", return_attn_probs)
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)):
        raise TypeError(f"softcap: expected a float (<= 0 disables it), got {softcap!r}")
    softmax_scale = check_scale("softmax_scale", softmax_scale, allow_none=True)
    window, softcap = _window(window_size), max(float(softcap), 0.0)
    # The call's keep mask, read before the call draws it (reading doesn't advance the generator).
    keep = None
    if return_attn_probs and isinstance(dropout_p, numbers.Real) and dropout_p > 0:
        keep = attention_dropout_mask(q, k, dropout_p)
    out, lse = attention(q, k, v, causal=causal, window=window, align="bottom_right", scale=softmax_scale,
                         alibi_slopes=alibi_slopes, softcap=softcap, dropout_p=dropout_p,
                         deterministic=deterministic, return_lse=True)
    if isinstance(out, JaggedTensor):
        out = out.values
    if not return_attn_probs:
        return out
    if keep is None:
        return out, lse, out.new_empty(0)  # flash-attn 2.7 / 2.8 without dropout
    probs = _probabilities(q, k, causal=causal, window=window, scale=softmax_scale, softcap=softcap,
                           alibi_slopes=alibi_slopes)
    return out, lse, torch.where(keep, probs, -probs).to(out.dtype)


@torch.no_grad()
def _probabilities(q, k, *, causal, window, scale, softcap, alibi_slopes) -> torch.Tensor:
    """Softmax of the masked scores, ``(B, H, Sq, Sk)`` (jagged: padded to the max lengths, zeros past
    the ends), in float32 (float64 for float64 inputs), with flash-attn's bottom-right alignment."""
    if isinstance(q, JaggedTensor):
        len_q, len_k = q.lengths.view(-1, 1, 1), k.lengths.view(-1, 1, 1)
        q, k = q.to_padded(), k.to_padded()
    else:
        len_q, len_k = q.shape[1], k.shape[1]
    dtype = accumulate_dtype(q.dtype)
    _, Sq, H, D = q.shape
    Sk = k.shape[1]
    k = k.to(dtype).repeat_interleave(H // k.shape[2], dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q.to(dtype), k) * (D ** -0.5 if scale is None else scale)
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(Sq, device=q.device).view(1, -1, 1)
    j = torch.arange(Sk, device=q.device).view(1, 1, -1)
    behind = i + (len_k - len_q) - j  # (B | 1, Sq, Sk): how far key j lies behind query i's diagonal
    if alibi_slopes is not None:
        s = s - alibi_slopes.to(dtype).reshape(-1, H, 1, 1) * behind.abs().unsqueeze(1)
    visible = (i < len_q) & (j < len_k)
    left, right = window
    if causal:
        visible = visible & (behind >= 0)
    if left is not None:
        visible = visible & (behind <= left)
    if right is not None:
        visible = visible & (behind >= -right)
    visible = visible.unsqueeze(1)
    probs = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.where(visible.any(dim=-1, keepdim=True), probs, 0.0)  # a query that sees no key: zeros


def _window(window_size) -> tuple[int | None, int | None]:
    """flash-attn's ``(left, right)``, a negative side meaning unbounded, as varlen's window."""
    if isinstance(window_size, torch.Tensor):
        if not is_integer_dtype(window_size.dtype):
            raise TypeError(f"window_size: expected (left, right) ints or an integer tensor, got a tensor of dtype "
                            f"{window_size.dtype}")
        if window_size.shape != (2,):
            raise ValueError(f"window_size: expected (left, right) ints or a tensor of shape (2,), got a tensor of "
                             f"shape {tuple(window_size.shape)}")
        window_size = window_size.tolist()  # read on the host (a device-to-host copy on a GPU)
    if not isinstance(window_size, (tuple, list)) or len(window_size) != 2 or not all(is_int(s) for s in window_size):
        raise ValueError(f"window_size: expected (left, right) ints, -1 for unbounded; got {window_size!r}")
    return tuple(None if s < 0 else int(s) for s in window_size)


def _unpack(name: str, packed, ndim: int, parts: int) -> tuple[torch.Tensor, ...]:
    """Views ``packed[..., i, :, :]`` of a ``(..., parts, H, D)`` tensor (dim -3 holds the parts)."""
    check_tensor(name, packed)
    layout = "(batch, seq, " if ndim == 5 else "(total, "
    if packed.dim() != ndim or packed.shape[-3] != parts:
        raise ValueError(f"{name}: expected shape {layout}{parts}, heads, dim), got {tuple(packed.shape)}")
    return tuple(packed.select(-3, i) for i in range(parts))


def _jagged(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """q, k, v as JaggedTensors over the trusted offsets: no checks that need the offsets' values."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)
        if t.dim() != 3:
            raise ValueError(f"{name}: expected 3 dims (total, heads, dim), got shape {tuple(t.shape)}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"v: {v.shape[0]} rows differ from k's {k.shape[0]}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(name, cu)
        check_dtype(name, cu, INDEX_DTYPES)
        if cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name}: expected shape (batch + 1,) with batch >= 1, got {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name}: on device {cu.device}, but q is on {q.device}")
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"cu_seqlens_k: shape {tuple(cu_seqlens_k.shape)} differs from cu_seqlens_q's "
                         f"{tuple(cu_seqlens_q.shape)}; both hold batch + 1 offsets")
    max_q, max_k = host_int("max_seqlen_q", max_seqlen_q), host_int("max_seqlen_k", max_seqlen_k)
    qj = _sequences(q, cu_seqlens_q, max_q, "q")
    if cu_seqlens_k is cu_seqlens_q and k.shape[0] == q.shape[0] and max_k == max_q:
        kj = qj.with_values(k)  # self-attention: one offsets tensor, which varlen need not compare
    else:
        kj = _sequences(k, cu_seqlens_k, max_k, "k")
    return qj, kj, kj.with_values(v)


def _sequences(x: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, name: str) -> JaggedTensor:
    """``x`` over ``cu_seqlens``: checked where that costs no sync (CPU) or in checking mode, else
    trusted (see ``varlen.set_checks``)."""
    side = name[-1]
    return JaggedTensor._from_metadata(x, cu_seqlens, max_seqlen,
                                       (f"cu_seqlens_{side}", f"{name}.shape[0]", f"max_seqlen_{side}"))
