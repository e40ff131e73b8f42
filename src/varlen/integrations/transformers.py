"""Hugging Face transformers: varlen as the attention implementation ``"varlen"``.

Usage::

    import varlen.integrations.transformers  # registers "varlen" with transformers
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="varlen")
    # or, on a loaded model: model.set_attn_implementation("varlen")

``import varlen`` never imports transformers; this module does, and registers the attention function and
its mask function under ``"varlen"``. The mask function decides from shapes only (never from mask values,
so it compiles with ``fullgraph=True`` and costs no device-to-host copy): it gives the 2-D padding mask (or
None) when the keys end at the last query, which bottom-right alignment then handles exactly, and
otherwise transformers' 4-D boolean sdpa mask (static caches, whose empty slots must not be attended).

How each batch layout runs (no copies of q, k, v unless noted):

- Packed batches (``DataCollatorWithFlattening``: sequences one after another, ``position_ids`` restarting
  at each sequence). With ``return_flash_attn_kwargs=True`` the collator also gives ``cu_seq_lens_q/k``
  and ``max_length_q/k``: jagged attention over the rows, q, k, v flattened to ``(B * S, heads, dim)`` with
  ``reshape``: a view for the collator's single row (B = 1), a copy when B > 1 (and heads > 1). With
  ``position_ids`` alone, each row's documents (where positions restart) are found on the device and
  attention stays within them (``varlen.attention``'s ``document_ids``). Neither reads anything on the
  host, and both compile.
- Padded batches (2-D ``attention_mask``): dense attention with the padding as a key mask (an all-ones mask
  too: telling it apart would read it on the host); exact for any mask, no device-to-host copy, but the
  padding is computed over (pack the batch to skip it).
- 4-D masks (the caller's, or the mask function's for static caches): used as an additive (float) or keep
  (bool) bias, without adding causality or the sliding window (the mask holds them, as for eager and sdpa).
- Otherwise dense attention. Causal per ``module.is_causal`` (or the ``is_causal`` kwarg), aligned to the
  bottom-right corner so that queries decoded after a KV cache see the whole cache.

``sliding_window`` w keeps keys within ``w - 1`` positions of the query (the flash-attention convention of
transformers); ``softcap`` caps the scores; GQA needs no ``repeat_kv``. Attention weights are never
returned (``output_attentions`` gives None). Attention sinks (``s_aux``) and paged caches are not
supported: they raise ValueError. Models that pick their attention classes from a table of their own
(Falcon, GPT-J, GPT-Neo) instead of transformers' AttentionInterface can't run varlen: building one with
``attn_implementation="varlen"`` raises ValueError (``set_attn_implementation("varlen")`` on a built one
leaves its implementation as it was, with a warning from transformers).
"""

from __future__ import annotations

import functools
import importlib

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.masking_utils import causal_mask_function, prepare_padding_mask, sdpa_mask

from .._checks import check_bool, check_int, check_probability, check_real, check_tensor, is_integer_dtype
from ..attn.api import attention
from ..flash_attn_interface import flash_attn_varlen_func

NAME = "varlen"
TESTED_ARCHITECTURES = ("Llama", "Mistral", "Qwen2", "Gemma3")


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None,
                             dropout: float = 0.0, sliding_window: int | None = None,
                             softcap: float | None = None, is_causal: bool | None = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface, computed by ``varlen.attention``.

    Args:
        module: the attention module (its ``is_causal`` is read when the ``is_causal`` kwarg is None).
        query: ``(B, H, Sq, D)``; key, value: ``(B, Hkv, Sk, D)`` / ``(B, Hkv, Sk, Dv)``, ``H % Hkv == 0``.
        attention_mask: None, a 2-D ``(B, Sk)`` padding mask (1 = token; the last key is the last query's
            position), or a 4-D bool/float mask broadcastable to ``(B, H, Sq, Sk)``.
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
    check_bool("is_causal", is_causal, allow_none=True)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    options = dict(scale=scaling, dropout_p=check_probability("dropout", dropout),
                   softcap=0.0 if softcap is None else check_real("softcap", softcap))
    if sliding_window is not None:  # (0 leaves the keys unbounded, as flash-attn's integration does)
        sliding_window = check_int("sliding_window", sliding_window, minimum=0)
    window = None if sliding_window is None else (sliding_window - 1, sliding_window - 1)
    if attention_mask is not None:
        check_tensor("attention_mask", attention_mask, kind="a torch.Tensor or None")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, S, H, D) views
    B, Sq, Sk = q.shape[0], q.shape[1], k.shape[1]

    if attention_mask is not None:
        if attention_mask.dim() == 4:
            return attention(q, k, v, bias=attention_mask, align="bottom_right", **options), None
        if attention_mask.dim() != 2 or attention_mask.shape[0] not in (1, B) or attention_mask.shape[1] != Sk:
            raise ValueError(f"attention_mask: expected a 2-D padding mask of shape ({B}, {Sk}) or (1, {Sk}) (batch, "
                             f"keys), or a 4-D mask; got shape {tuple(attention_mask.shape)}")
        # Always a key bias, even when nothing is padded: finding that out would read the mask on the host.
        keep = attention_mask.to(torch.bool)[:, None, None, :]
        out = attention(q, k, v, bias=keep, causal=causal, window=window, align="bottom_right", **options)
        return out, None

    names = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    if all(kwargs.get(n) is not None for n in names):
        cu_q, cu_k, max_q, max_k = (kwargs[n] for n in names)
        H, Hkv, D = q.shape[2], k.shape[2], q.shape[3]
        out = flash_attn_varlen_func(q.reshape(-1, H, D), k.reshape(-1, Hkv, D), v.reshape(-1, Hkv, v.shape[3]),
                                     cu_q, cu_k, max_q, max_k, dropout_p=options["dropout_p"], softmax_scale=scaling,
                                     causal=causal, window_size=(-1, -1) if window is None else window,
                                     softcap=options["softcap"])
        return out.view(B, Sq, H, out.shape[-1]), None
    documents = _documents(kwargs.get("position_ids"), B, Sq, Sk)
    out = attention(q, k, v, causal=causal, window=window, align="bottom_right", document_ids=documents, **options)
    return out, None


def _documents(position_ids, batch: int, seq_q: int, seq_k: int) -> torch.Tensor | None:
    """The document of each token of packed rows, ``(B, S)``, or None when the batch can't be packed (no
    position_ids, or a cache: Sq != Sk). A document starts at each row's start and wherever the position
    doesn't follow the previous one's by 1, as transformers' packed-sequence masks define it. Computed on the
    device: no host sync, and it traces under ``torch.compile``; a row that is one sequence is one document.

    The ids are ``pos[i] - i``: ``varlen.attention`` only compares neighbours (a document is a run of equal
    ids), and ``pos[i] - i == pos[i - 1] - (i - 1)`` exactly when ``pos[i] == pos[i - 1] + 1``."""
    if not isinstance(position_ids, torch.Tensor) or seq_q != seq_k or seq_q < 2:
        return None
    if not is_integer_dtype(position_ids.dtype):
        raise TypeError(f"position_ids: expected an integer tensor, got {position_ids.dtype}")
    if position_ids.shape[-1] != seq_q or position_ids.numel() not in (seq_q, batch * seq_q):
        return None
    pos = position_ids.reshape(-1, seq_q).expand(batch, -1)
    return pos - torch.arange(seq_q, device=pos.device)


def varlen_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int | torch.Tensor = 0, kv_offset: int = 0,
                mask_function=causal_mask_function, attention_mask: torch.Tensor | None = None,
                **kwargs) -> torch.Tensor | None:
    """transformers' mask-function interface (``create_causal_mask`` and the others call it).

    Keys ``[kv_offset, kv_offset + kv_length)`` of the sequence meet queries ``[q_offset, q_offset +
    q_length)``. When the last key is the last query (no cache, or a dynamic one), bottom-right alignment
    places causality and the sliding window exactly, and the mask is the 2-D padding mask over those keys (or
    None). Otherwise (a static cache: its slots past the tokens seen are empty, and ``q_offset`` is a device
    tensor) it is transformers' 4-D boolean sdpa mask, built from ``mask_function`` with the padding.
    Only shapes are read, never mask values.
    """
    if not isinstance(q_offset, torch.Tensor) and kv_length == q_offset - kv_offset + q_length:
        if attention_mask is None:
            return None
        return prepare_padding_mask(attention_mask, kv_length, kv_offset)[:, kv_offset:kv_offset + kv_length]
    # sdpa_mask's skips return None for "attend to every key", which would include the empty cache slots.
    kwargs.update(allow_is_causal_skip=False, allow_is_bidirectional_skip=False)
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **kwargs)


# Models that build their attention layers from a table of their own, keyed by the implementation's name, and
# never call transformers' AttentionInterface: without an entry, "varlen" fails there with a bare KeyError.
_OWN_ATTENTION_TABLES = (
    ("Falcon", "transformers.models.falcon.modeling_falcon", "FALCON_ATTENTION_CLASSES"),
    ("GPT-J", "transformers.models.gptj.modeling_gptj", "GPTJ_ATTENTION_CLASSES"),
    ("GPT-Neo", "transformers.models.gpt_neo.modeling_gpt_neo", "GPT_NEO_ATTENTION_CLASSES"),
)


def _unsupported_model(architecture: str, table: str, name: str, *args, **kwargs):
    raise ValueError(
        f'attn_implementation="{name}": {architecture} picks its attention layers from {table} instead of '
        f"transformers' AttentionInterface, so varlen can't run it; use \"sdpa\" or \"eager\" for {architecture}. "
        f"varlen runs models whose attention goes through the AttentionInterface (tested: "
        f"{', '.join(TESTED_ARCHITECTURES)})")


def register(name: str = NAME) -> None:
    """Register the attention function and its mask function with transformers under ``name``, and make the
    models that can't use it raise a ValueError naming them when built with it."""
    AttentionInterface.register(name, varlen_attention_forward)
    AttentionMaskInterface.register(name, varlen_mask)
    for architecture, module, table in _OWN_ATTENTION_TABLES:
        try:
            classes = getattr(importlib.import_module(module), table)
        except (ImportError, AttributeError):  # a transformers release that moved the model (or dropped it)
            continue
        classes.setdefault(name, functools.partial(_unsupported_model, architecture, table, name))


register()
