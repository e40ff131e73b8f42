"""``varlen.scaled_dot_product_attention``: a drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

Same signature, layouts and semantics as torch's (see the function's docstring for the few differences);
the inputs are viewed as varlen's ``(B, S, H, D)`` layout by a transpose, without copies, and run through
``varlen.attention``.
"""

from __future__ import annotations

import math

import torch

from ._checks import (
    FLOAT_DTYPES,
    check_bool,
    check_dtype,
    check_probability,
    check_same_device,
    check_same_dtype,
    check_scale,
    check_tensor,
    is_integer_dtype,
)
from .attn.api import attention
from .jagged import JaggedTensor


class SDPAValueError(ValueError, RuntimeError):
    """An invalid input value: a ValueError (varlen's convention) that is also the RuntimeError torch raises."""


class SDPATypeError(TypeError, RuntimeError):
    """An input of the wrong type or dtype: a TypeError that is also a RuntimeError, as torch may raise."""


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                                 scale=None, enable_gqa=False):
    """Scaled dot-product attention with ``torch.nn.functional.scaled_dot_product_attention``'s signature.

    Computes ``softmax(query @ key.T * scale + mask) @ value`` with dropout on the weights, as torch does,
    through varlen's fused kernels (Triton on CUDA, the PyTorch backend elsewhere), with its backward.

    Args:
        query: ``(N, ..., Hq, L, E)``; also ``(L, E)``. Or a ``torch.nested`` jagged tensor in SDPA's
            nested layout ``(B, Hq, j, E)``: a ``(B, j, Hq, E)`` nested tensor transposed(1, 2).
        key: ``(N, ..., H, S, E)``, nested ``(B, H, j, E)`` (its lengths may differ from query's).
        value: ``(N, ..., H, S, Ev)``, nested like key with key's offsets (the same offsets tensor: nested
            key and value with separately built, equal offsets cost one device-to-host comparison).
            The leading dims ``N, ...`` of query, key and value broadcast against each other.
        attn_mask: bool (True = take part in attention) or float (added to the scores), broadcastable to
            the weights' shape ``(N, ..., Hq, L, S)``. A float mask that requires grad gets its gradient.
            Nested inputs (a varlen extension): broadcastable to ``(B, Hq, max_L, max_S)``, entry
            ``[b, h, i, j]`` being query i and key j of sequence b (entries past the lengths are ignored).
        dropout_p: drop probability of the attention weights (kept ones scaled by ``1 / (1 - p)``, p
            rounded to a multiple of 2**-8), drawn from torch's default generator for the device; pass 0.0
            in evaluation. A float, or as in torch a 0-dim float or integer tensor, read on the host (a
            device-to-host copy on a GPU).
        is_causal: top-left causal mask (query i sees keys ``j <= i``, per sequence for nested inputs).
            Must not be combined with ``attn_mask``.
        scale: keyword-only; multiplies the scores; default ``1 / sqrt(E)``. A float or, as in torch, a
            0-dim float or integer tensor (read on the host, like ``dropout_p``); nonzero (torch takes 0, which
            weighs every visible key alike; varlen refuses it).
        enable_gqa: keyword-only; let query have ``Hq`` heads, a multiple of key/value's ``H``, query
            head h using key/value head ``h // (Hq // H)``. Without it ``H`` must equal ``Hq`` (or be 1,
            broadcast).

    Returns:
        ``(N, ..., Hq, L, Ev)``, a transposed view of a ``(N, L, Hq, Ev)`` buffer (strides differ from the
        math backend's; values are what torch computes). Nested inputs give a nested tensor in the same
        ``(B, Hq, j, Ev)`` layout, sharing query's offsets. A query that sees no key gets output 0, as
        torch's math backend gives.

    Differences from torch:
        - Dropout draws another random stream than torch's, so masks differ for one seed (same
          distribution and scaling; a seed still reproduces varlen's mask). Get the mask of the next call
          with ``varlen.attention_dropout_mask(query.transpose(1, 2), key.transpose(1, 2), dropout_p)``
          (4-dim or nested inputs; eager calls only: captured and compiled calls draw their key on the GPU).
        - Extensions: float masks of any float dtype; nested inputs with ``is_causal``, masks and GQA.
        - Rejected: ``dropout_p == 1`` (torch returns zeros), key and value with different head counts,
          a query with fewer heads than key (broadcasting query over heads), zero heads or head dims of 0
          (torch returns empty or mean-of-values results), ``|scale|`` outside ``[2**-100, 2**100]`` (the
          kernels compute in float32, ``1 / scale`` too), fewer than 2 dims, bools (Python or 0-dim tensors)
          and complex tensors for ``scale`` and ``dropout_p`` (torch reads them).
        - Leading dims beyond one batch dim are flattened (a copy when they can't be viewed as one) and a
          mask broadcast along them is expanded in memory.

    Raises:
        ValueError / TypeError naming the argument, for invalid inputs. Every error raised here is also a
        ``RuntimeError``, which is what torch raises for most invalid inputs, so code catching torch's
        errors keeps working.
    """
    try:
        if _is_nested(query) or _is_nested(key) or _is_nested(value):
            return _nested_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
        return _dense_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    except (SDPAValueError, SDPATypeError):
        raise
    except TypeError as exc:
        raise SDPATypeError(str(exc)) from exc
    except ValueError as exc:
        raise SDPAValueError(str(exc)) from exc


def _is_nested(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_nested


def _check_tensors(query, key, value) -> None:
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_dtype(name, t, FLOAT_DTYPES)
    check_same_dtype([("query", query), ("key", key), ("value", value)])
    check_same_device([("query", query), ("key", key), ("value", value)])


def _check_options(attn_mask, dropout_p, is_causal, scale, enable_gqa) -> tuple[float, float | None]:
    """Checks the options; returns ``dropout_p`` and ``scale`` as host floats (``scale`` may be None)."""
    check_bool("is_causal", is_causal)
    check_bool("enable_gqa", enable_gqa)
    dropout_p = check_probability("dropout_p", _host_number("dropout_p", dropout_p))
    scale = check_scale("scale", None if scale is None else _host_number("scale", scale), allow_none=True)
    if attn_mask is not None:
        check_tensor("attn_mask", attn_mask)
        if attn_mask.dtype != torch.bool:
            check_dtype("attn_mask", attn_mask, (torch.bool, *FLOAT_DTYPES))
        if is_causal:
            raise ValueError("attn_mask: must be None when is_causal=True (as in torch); put the causal "
                             "pattern into the mask instead")
    return float(dropout_p), None if scale is None else float(scale)


def _host_number(name: str, value):
    """A 0-dim float or integer tensor read on the host, as torch reads one for its float arguments (a
    device-to-host copy on a GPU); any other value is returned as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() != 0 or not (value.is_floating_point() or is_integer_dtype(value.dtype)):
        raise TypeError(f"{name}: expected a float or a 0-dim float or integer tensor, got a tensor of shape "
                        f"{tuple(value.shape)} and dtype {value.dtype}")
    if value.requires_grad:
        raise TypeError(f"{name}: got a tensor that requires grad, but no gradient is computed for {name} (torch "
                        f"rejects it too); pass {name}.detach() or a float")
    return value.item()


def _check_heads(hq: int, hk: int, hv: int, enable_gqa: bool) -> None:
    if min(hq, hk, hv) == 0:
        raise ValueError(f"query, key, value: {hq}, {hk} and {hv} heads; each needs at least 1 (torch returns an "
                         "empty result for 0; varlen refuses it)")
    if hk != hv:
        raise ValueError(f"key, value: {hk} and {hv} heads; key and value must have the same number of heads")
    if hq == hk or hk == 1 or (enable_gqa and hq % hk == 0):
        return
    if enable_gqa:
        raise ValueError(f"query: {hq} heads are not a multiple of key/value's {hk} heads (enable_gqa=True "
                         "needs Hq % H == 0)")
    raise ValueError(f"query: {hq} heads, but key/value have {hk}; pass enable_gqa=True for grouped-query "
                     "attention (Hq a multiple of H), or give key/value Hq heads (or 1)")


# -------------------------------------------------------------------------------------------- dense
def _dense_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_tensor(name, t)
        if t.dim() < 2:
            raise ValueError(f"{name}: expected at least 2 dims (..., L, E), got shape {tuple(t.shape)}")
    _check_tensors(query, key, value)
    dropout_p, scale = _check_options(attn_mask, dropout_p, is_causal, scale, enable_gqa)
    # Each input as (*leading, heads, seq, dim); a 2-dim input has one head.
    q, k, v = (t if t.dim() > 2 else t.unsqueeze(0) for t in (query, key, value))
    try:
        lead = torch.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    except RuntimeError:
        raise ValueError(f"query, key, value: leading dims of shapes {tuple(query.shape)}, {tuple(key.shape)}, "
                         f"{tuple(value.shape)} don't broadcast (the last 3 dims are heads, sequence, dim)") from None
    (hq, L, E), (hk, S, Ek), (hv, Sv, Ev) = q.shape[-3:], k.shape[-3:], v.shape[-3:]
    if Ek != E:
        raise ValueError(f"key: head dim {Ek} differs from query's {E}")
    if Sv != S:
        raise ValueError(f"value: sequence length {Sv} differs from key's {S}")
    _check_heads(hq, hk, hv, enable_gqa)
    weights = (*lead, hq, L, S)
    if attn_mask is not None:
        attn_mask = _flatten_mask(attn_mask, weights)
    # (B, H, S, D) -> (B, S, H, D): a transpose, no copy (varlen needs only stride(-1) == 1).
    q, k, v = (_flatten_lead(t, lead).transpose(1, 2) for t in (q, k, v))
    out = attention(q, k, v, causal=is_causal, align="top_left", scale=scale, bias=attn_mask, dropout_p=dropout_p)
    ndim = max(query.dim(), key.dim(), value.dim())
    return out.transpose(1, 2).reshape((*lead, hq, L, Ev)[-ndim:])


def _flatten_lead(t: torch.Tensor, lead: torch.Size) -> torch.Tensor:
    """``(*lead', H, S, D)`` broadcast to ``lead`` and flattened to ``(B, H, S, D)`` (a view when possible)."""
    t = t.expand(*lead, *t.shape[-3:])
    if len(lead) == 1:
        return t
    return t.reshape(math.prod(lead), *t.shape[-3:])


def _flatten_mask(mask: torch.Tensor, weights: tuple) -> torch.Tensor:
    """The mask as varlen's ``(B | 1, H | 1, L | 1, S | 1)`` bias for weights of shape ``(*lead, H, L, S)``."""
    if mask.dim() > len(weights) or any(m not in (1, w) for m, w in zip(reversed(mask.shape), reversed(weights),
                                                                         strict=False)):
        raise ValueError(f"attn_mask: shape {tuple(mask.shape)} does not broadcast to the attention weights' "
                         f"shape {weights} (..., Hq, L, S)")
    if mask.dim() <= 3 or len(weights) == 4:
        return mask  # varlen pads the shape with leading 1s, as broadcasting does
    mask = mask.reshape((1,) * (len(weights) - mask.dim()) + tuple(mask.shape))
    lead, rest = mask.shape[:-3], mask.shape[-3:]
    if all(n == 1 for n in lead):
        return mask.reshape(1, *rest)
    return mask.expand(*weights[:-3], *rest).reshape(math.prod(weights[:-3]), *rest)


# ------------------------------------------------------------------------------------------- nested
def _nested_sdpa(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not _is_nested(t):
            raise ValueError("query, key, value: mix nested and dense tensors; pass all three as "
                             "torch.nested jagged tensors of layout (B, H, j, D), or all three dense")
        if t.layout != torch.jagged:
            raise ValueError(f"{name}: expected a nested tensor of layout torch.jagged, got {t.layout}")
        if t.dim() != 4 or t._ragged_idx != 2:
            raise ValueError(f"{name}: expected SDPA's nested layout (B, H, j, D), a (B, j, H, D) nested tensor "
                             f"transposed(1, 2) (ragged dim 2); got {t.dim()} dims with ragged dim {t._ragged_idx}")
    _check_tensors(query, key, value)
    dropout_p, scale = _check_options(attn_mask, dropout_p, is_causal, scale, enable_gqa)
    _check_heads(query.shape[1], key.shape[1], value.shape[1], enable_gqa)
    if key.shape[0] != query.shape[0]:
        raise ValueError(f"key: batch size {key.shape[0]} differs from query's {query.shape[0]}")
    if value.shape[0] != key.shape[0]:
        raise ValueError(f"value: batch size {value.shape[0]} differs from key's {key.shape[0]}")
    # (B, H, j, D) -> (B, j, H, D) nested view -> JaggedTensor view of its values and offsets.
    q, k, v = (JaggedTensor.from_nested(t.transpose(1, 2)) for t in (query, key, value))
    out = attention(q, k, v, causal=is_causal, align="top_left", scale=scale, bias=attn_mask, dropout_p=dropout_p)
    nested = torch.nested.nested_tensor_from_jagged(out.values, query.offsets(), max_seqlen=q.max_len,
                                                    min_seqlen=query._maybe_min_seqlen)
    return nested.transpose(1, 2)
