"""``attn_implementation="varlen"`` in Hugging Face transformers, on a tiny randomly initialised Llama.

Logits and parameter gradients must match ``attn_implementation="eager"`` (and ``"sdpa"``, more tightly)
for padded batches, packed batches (``position_ids`` restarting per sequence, or the collator's
``cu_seq_lens`` kwargs), GQA/MQA/MHA, sliding windows and cached generation. transformers is a test
dependency: this module fails to import without it, on purpose.
"""

from __future__ import annotations

import subprocess
import sys
import types

import pytest
import torch
import transformers
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

import varlen
import varlen.integrations.transformers as integration
from utils import assert_close

F64 = torch.float64
# eager computes its softmax in float32 even for a float64 model, so it agrees with varlen to ~1e-7 only;
# sdpa (torch's math kernel in float64 here) agrees to float64 rounding.
EAGER_TOL, SDPA_TOL = 1e-5, 1e-10


def _config(kv_heads=2, **extra):
    return dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=kv_heads, num_hidden_layers=2,
                intermediate_size=128, vocab_size=100, **extra)


def _llama(device, kv_heads=2):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**_config(kv_heads))).to(device, F64)


def _run(model, implementation, valid, weights, **inputs):
    """Logits, and the gradients of every parameter for a loss over the ``valid`` positions only."""
    model.set_attn_implementation(implementation)
    logits = model(**inputs, use_cache=False).logits
    loss = torch.where(valid[..., None], logits * weights, 0).sum()
    params = [p for p in model.parameters() if p.requires_grad]
    return logits, torch.autograd.grad(loss, params)


def _assert_matches(model, valid, inputs, references=("eager", "sdpa"), grads=True):
    weights = torch.randn(*valid.shape, model.config.vocab_size, dtype=F64, device=valid.device)
    logits, dparams = _run(model, "varlen", valid, weights, **inputs)
    assert torch.isfinite(logits[valid]).all()
    for ref_name in references:
        tol = EAGER_TOL if ref_name == "eager" else SDPA_TOL
        ref_logits, ref_dparams = _run(model, ref_name, valid, weights, **inputs)
        assert_close(logits[valid], ref_logits[valid], tol=tol, name=f"logits vs {ref_name}")
        if grads:
            for (name, _), g, r in zip(model.named_parameters(), dparams, ref_dparams, strict=True):
                assert_close(g, r, tol=tol, name=f"d{name} vs {ref_name}", floor=1e-12)


# ------------------------------------------------------------------------------------- padded batches
@pytest.mark.parametrize("kv_heads", [2, 1, 4], ids=["gqa", "mqa", "mha"])
def test_right_padded_batch(kv_heads, device):
    model = _llama(device, kv_heads)
    ids = torch.randint(0, 100, (3, 11), device=device)
    mask = torch.ones(3, 11, dtype=torch.long, device=device)
    mask[0, 7:] = 0
    mask[2, 1:] = 0  # a sequence of length 1
    _assert_matches(model, mask.bool(), dict(input_ids=ids, attention_mask=mask))


def test_left_padded_batch(device):
    """Left padding leaves queries that see no key. eager can't be the reference here: with a float64 model
    its float32 softmax turns the mask's float64 minimum into -inf and such rows into NaN, which spread to
    every row through the next layer's keys. sdpa gives 0 there, as varlen does."""
    model = _llama(device)
    ids = torch.randint(0, 100, (2, 9), device=device)
    mask = torch.ones(2, 9, dtype=torch.long, device=device)
    mask[0, :4] = 0
    _assert_matches(model, mask.bool(), dict(input_ids=ids, attention_mask=mask), references=("sdpa",))


# ------------------------------------------------------------------------------------- packed batches
LENGTHS = (4, 1, 9, 3)


def _packed_features():
    torch.manual_seed(1)
    return [{"input_ids": torch.randint(0, 100, (n,)).tolist()} for n in LENGTHS]


def _positions(device):
    return torch.cat([torch.arange(n) for n in LENGTHS]).view(1, -1).to(device)


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_packed_batch_by_position_ids(kv_heads, device):
    model = _llama(device, kv_heads)
    ids = torch.tensor([sum((f["input_ids"] for f in _packed_features()), [])], device=device)
    valid = torch.ones_like(ids, dtype=torch.bool)
    _assert_matches(model, valid, dict(input_ids=ids, position_ids=_positions(device)))


def test_packed_batch_equals_sequences_run_alone(device):
    model = _llama(device)
    model.set_attn_implementation("varlen")
    features = _packed_features()
    ids = torch.tensor([sum((f["input_ids"] for f in features), [])], device=device)
    packed = model(input_ids=ids, position_ids=_positions(device), use_cache=False).logits[0]
    alone = torch.cat([model(input_ids=torch.tensor([f["input_ids"]], device=device), use_cache=False).logits[0]
                       for f in features])
    assert_close(packed, alone, tol=SDPA_TOL, name="logits")


def test_collator_flash_kwargs_are_used_without_reading_position_ids(device, monkeypatch):
    """DataCollatorWithFlattening(return_flash_attn_kwargs=True) gives cu_seq_lens_q/k and max_length_q/k:
    varlen uses them (no device-to-host copy) and never derives offsets from position_ids."""
    model = _llama(device)
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(_packed_features(), return_tensors="pt")
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    assert batch["cu_seq_lens_q"].dtype == torch.int32 and isinstance(batch["max_length_q"], int)
    batch.pop("labels")
    valid = torch.ones_like(batch["input_ids"], dtype=torch.bool)

    def fail(*args):
        raise AssertionError("offsets were derived from position_ids despite cu_seq_lens kwargs")

    monkeypatch.setattr(integration, "_sequence_starts", fail)
    _assert_matches(model, valid, batch, references=("eager",))


def test_position_ids_are_read_once_per_forward(device, monkeypatch):
    model = _llama(device)
    model.set_attn_implementation("varlen")
    ids = torch.tensor([sum((f["input_ids"] for f in _packed_features()), [])], device=device)
    reads = []
    real_cpu = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: reads.append(self.shape) or real_cpu(self, *a, **k))
    model(input_ids=ids, position_ids=_positions(device), use_cache=False)
    assert reads == [torch.Size([sum(LENGTHS)])]  # one read of the sequence starts for both layers


# ----------------------------------------------------------------------------- windows and generation
def _mistral(device, window):
    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(**_config(), sliding_window=window)).to(device, F64)


def test_sliding_window(device):
    model = _mistral(device, window=3)
    ids = torch.randint(0, 100, (2, 10), device=device)
    _assert_matches(model, torch.ones_like(ids, dtype=torch.bool), dict(input_ids=ids))
    packed = torch.tensor([sum((f["input_ids"] for f in _packed_features()), [])], device=device)
    _assert_matches(model, torch.ones_like(packed, dtype=torch.bool),
                    dict(input_ids=packed, position_ids=_positions(device)))
    # padding past the window leaves queries that see no key: sdpa only (see test_left_padded_batch)
    mask = torch.ones(2, 10, dtype=torch.long, device=device)
    mask[1, 5:] = 0
    _assert_matches(model, mask.bool(), dict(input_ids=ids, attention_mask=mask), references=("sdpa",))


def test_cached_generation_matches_sdpa(device):
    """Decoding after a KV cache needs bottom-right alignment; the left-padded prompt a 2-D mask. (sdpa, not
    eager, for the reason given in test_left_padded_batch.)"""
    model = _llama(device).eval()
    ids = torch.randint(0, 100, (2, 6), device=device)
    mask = torch.ones(2, 6, dtype=torch.long, device=device)
    mask[0, :2] = 0
    results = {}
    for name in ("sdpa", "varlen"):
        model.set_attn_implementation(name)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        results[name] = out
    assert torch.equal(results["varlen"].sequences, results["sdpa"].sequences)
    for got, ref in zip(results["varlen"].logits, results["sdpa"].logits, strict=True):
        assert_close(got, ref, tol=SDPA_TOL, name="step logits")


# -------------------------------------------------------------------------- the function on its own
def _module(is_causal=True):
    return types.SimpleNamespace(is_causal=is_causal, num_key_value_groups=2, training=True)


@pytest.mark.parametrize("is_causal", [True, False])
def test_attention_function_options(is_causal, device):
    """softcap, scaling, dropout and is_causal reach varlen.attention with transformers' layouts."""
    q = torch.randn(2, 4, 7, 8, dtype=F64, device=device)  # (B, H, S, D)
    k, v = (torch.randn(2, 2, 7, 8, dtype=F64, device=device) for _ in range(2))
    keep = varlen.attention_dropout_mask(q.transpose(1, 2), k.transpose(1, 2), 0.2)
    out, weights = integration.varlen_attention_forward(_module(is_causal), q, k, v, None, scaling=0.3, dropout=0.2,
                                                        softcap=2.0)
    assert weights is None and out.shape == (2, 7, 4, 8)  # (B, S, H, D)
    ref, _ = varlen.attention_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=is_causal,
                                        scale=0.3, softcap=2.0, dropout_mask=keep, dropout_p=0.2)
    assert_close(out, ref, name="out")


def test_four_dim_mask_is_a_bias(device):
    q, k, v = (torch.randn(1, 2, 5, 8, dtype=F64, device=device) for _ in range(3))
    bias = torch.randn(1, 1, 5, 5, dtype=F64, device=device)
    out, _ = integration.varlen_attention_forward(_module(), q, k, v, bias)
    ref, _ = varlen.attention_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bias=bias)
    assert_close(out, ref, name="out")


@pytest.mark.parametrize("kwargs,mask,message", [
    (dict(s_aux=torch.zeros(2)), None, "s_aux: attention sinks are not supported"),
    ({}, torch.ones(1, 1, 5), "attention_mask: expected a 2-D padding mask (batch, keys) or a 4-D mask"),
])
def test_unsupported_inputs(kwargs, mask, message):
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        integration.varlen_attention_forward(_module(), q, q, q, mask, **kwargs)


# --------------------------------------------------------------------------------------- registration
def test_registered_with_transformers():
    assert transformers.AttentionInterface._global_mapping["varlen"] is integration.varlen_attention_forward
    assert "varlen" in transformers.AttentionMaskInterface._global_mapping


def test_import_varlen_does_not_import_transformers():
    code = "import sys, varlen, varlen.integrations; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
