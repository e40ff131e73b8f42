"""Hugging Face transformers: varlen as the attention implementation ``"varlen"``.

Usage::

    import varlen.integrations.transformers  # registers "varlen" with transformers
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="varlen")
    # or, on a loaded model: model.set_attn_implementation("varlen")

``import varlen`` never imports transformers; this module does, and registers the attention function and
its mask function (transformers' flash-attention mask: a 2-D padding mask or None) under ``"varlen"``.

How each batch layout runs (no copies of q, k, v unless noted):

- Packed batches (``DataCollatorWithFlattening``: sequences one after another, ``position_ids`` restarting
  at each sequence). With ``return_flash_attn_kwargs=True`` the collator also gives ``cu_seq_lens_q/k``
  and ``max_length_q/k``: jagged attention with no device-to-host copy. With ``position_ids`` alone the
  sequence starts are read from them: one device-to-host copy per forward pass (shared by the layers).
  Batches of more than one row are flattened (a copy of q, k, v).
- Padded batches (2-D ``attention_mask``): dense attention with the padding as a key mask; exact for any
  mask, no device-to-host copy, but the padding is computed over (pack the batch to skip it).
- A 4-D mask passed by the caller: used as an additive (float) or keep (bool) bias, without adding
  causality or the sliding window (the mask holds them, as for eager and sdpa).
- Otherwise dense attention. Causal per ``module.is_causal`` (or the ``is_causal`` kwarg), aligned to the
  bottom-right corner so that queries decoded after a KV cache see the whole cache.

``sliding_window`` w keeps keys within ``w - 1`` positions of the query (the flash-attention convention of
transformers); ``softcap`` caps the scores; GQA needs no ``repeat_kv``. Attention weights are never
returned (``output_attentions`` gives None). Attention sinks (``s_aux``) and paged caches are not
supported: they raise ValueError.
"""

from __future__ import annotations

import weakref

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import flash_attention_mask

from ..attention.api import attention
from ..flash_attn_interface import flash_attn_varlen_func

NAME = "varlen"


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None,
                             dropout: float = 0.0, sliding_window: int | None = None,
                             softcap: float | None = None, is_causal: bool | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface, computed by ``varlen.attention``.

    Args:
        module: the attention module (its ``is_causal`` is read when the ``is_causal`` kwarg is None).
        query: ``(B, H, Sq, D)``; key, value: ``(B, Hkv, Sk, D)`` / ``(B, Hkv, Sk, Dv)``, ``H % Hkv == 0``.
        attention_mask: None, a 2-D ``(B, Sk)`` padding mask (1 = token), or a 4-D bool/float mask
            broadcastable to ``(B, H, Sq, Sk)``.
        scaling: score scale (default ``D ** -0.5``); dropout: attention dropout probability.
        sliding_window: keys within ``sliding_window - 1`` positions of the query; softcap: score cap.
        kwargs: ``position_ids``, and the packed-batch kwargs ``cu_seq_lens_q``, ``cu_seq_lens_k``,
            ``max_length_q``, ``max_length_k``; others are ignored.

    Returns:
        ``(attn_output (B, Sq, H, Dv), None)``.
    """
    if kwargs.get("s_aux") is not None:
        raise ValueError("s_aux: attention sinks are not supported by the varlen attention implementation")
    if kwargs.get("cache") is not None:
        raise ValueError("cache: paged attention caches are not supported by the varlen attention implementation")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    options = dict(scale=scaling, dropout_p=float(dropout), softcap=0.0 if softcap is None else float(softcap))
    window = None if sliding_window is None else (sliding_window - 1, sliding_window - 1)
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, S, H, D) views
    B, Sq, Sk = q.shape[0], q.shape[1], k.shape[1]

    if attention_mask is not None:
        if attention_mask.dim() == 4:
            return attention(q, k, v, bias=attention_mask, align="bottom_right", **options), None
        if attention_mask.dim() != 2:
            raise ValueError(f"attention_mask: expected a 2-D padding mask (batch, keys) or a 4-D mask, got shape "
                             f"{tuple(attention_mask.shape)}")
        width = attention_mask.shape[1]
        if width < Sk:  # a static cache longer than the tokens seen so far: the rest is unused
            k, v = k[:, :width], v[:, :width]
        keep = attention_mask[:, -k.shape[1]:].to(torch.bool)
        out = attention(q, k, v, bias=keep[:, None, None, :], causal=causal, window=window, align="bottom_right",
                        **options)
        return out, None

    packed = _packed_offsets(kwargs, B, Sq, Sk)
    if packed is None:
        return attention(q, k, v, causal=causal, window=window, align="bottom_right", **options), None
    cu_q, cu_k, max_q, max_k = packed
    H, Hkv, D = q.shape[2], k.shape[2], q.shape[3]
    out = flash_attn_varlen_func(q.reshape(-1, H, D), k.reshape(-1, Hkv, D), v.reshape(-1, Hkv, v.shape[3]),
                                 cu_q, cu_k, max_q, max_k, dropout_p=options["dropout_p"], softmax_scale=scaling,
                                 causal=causal, window_size=(-1, -1) if window is None else window,
                                 softcap=options["softcap"])
    return out.view(B, Sq, H, out.shape[-1]), None


def _packed_offsets(kwargs: dict, batch: int, seq_q: int, seq_k: int):
    """``(cu_q, cu_k, max_q, max_k)`` of a packed batch, or None when the rows are single sequences."""
    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    if all(kwargs.get(n) is not None for n in names):
        return tuple(kwargs[n] for n in names)
    position_ids = kwargs.get("position_ids")
    if not isinstance(position_ids, torch.Tensor) or seq_q != seq_k or seq_q < 2:
        return None
    if position_ids.shape[-1] != seq_q or position_ids.numel() not in (seq_q, batch * seq_q):
        return None
    found = _sequence_starts(position_ids, batch)
    if found is None:
        return None
    offsets, max_len = found
    return offsets, offsets, max_len, max_len


# One entry: the layers of a forward pass get the same position_ids tensor, so its offsets are read once.
_last_starts: tuple = (lambda: None, -1, 0, None)


def _sequence_starts(position_ids: torch.Tensor, batch: int):
    """``(offsets int32 on the device, max_len)`` of the sequences in the flattened rows, or None if each row
    is one sequence. A sequence starts at each row's start and wherever the position doesn't follow the
    previous one's by 1 (as transformers' packed-sequence masks define it). One device-to-host copy."""
    global _last_starts
    ref, version, rows, found = _last_starts
    if ref() is position_ids and version == position_ids._version and rows == batch:
        return found
    pos = position_ids.reshape(-1, position_ids.shape[-1]).expand(batch, -1)
    starts = torch.ones(pos.shape, dtype=torch.bool, device=pos.device)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    host = starts.flatten().cpu()  # the device-to-host copy
    found = None
    if int(host.sum()) > batch:
        offsets = torch.cat([host.nonzero().flatten(), torch.tensor([host.numel()])])
        max_len = int((offsets[1:] - offsets[:-1]).max())
        found = offsets.to(device=position_ids.device, dtype=torch.int32), max_len
    _last_starts = (weakref.ref(position_ids), position_ids._version, batch, found)
    return found


def register(name: str = NAME) -> None:
    """Register the attention function and its mask function with transformers under ``name``."""
    AttentionInterface.register(name, varlen_attention_forward)
    AttentionMaskInterface.register(name, flash_attention_mask)


register()
