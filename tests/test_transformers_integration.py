"""``attn_implementation="varlen"`` in Hugging Face transformers, on tiny randomly initialised models.

Logits and parameter gradients must match ``attn_implementation="eager"`` (and ``"sdpa"``, more tightly)
for padded batches, packed batches (``position_ids`` restarting per sequence, or the collator's
``cu_seq_lens`` kwargs), GQA/MQA/MHA and sliding windows (Llama, Mistral); generation with dynamic and
static caches must give sdpa's tokens and logits (Llama, Qwen2, Gemma3); ``torch.compile(model,
fullgraph=True)`` must give eager's logits with no host reads in the graph; Falcon, GPT-J and GPT-Neo, which
bypass transformers' AttentionInterface, must refuse "varlen" with a ValueError. transformers is a test
dependency: this module fails to import without it, on purpose.
"""

from __future__ import annotations

import functools
import re
import subprocess
import sys
import types

import pytest
import torch
import transformers
from torch._dynamo.testing import CompileCounterWithBackend
from transformers import (
    AutoModelForCausalLM,
    DataCollatorWithFlattening,
    FalconConfig,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPTJConfig,
    GPTNeoConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    StaticCache,
)

import varlen
import varlen.integrations.transformers as integration
from utils import assert_close

F64 = torch.float64
# eager computes its softmax in float32 even for a float64 model, so it agrees with varlen to ~1e-7 only;
# sdpa (torch's math kernel in float64 here) agrees to float64 rounding.
EAGER_TOL, SDPA_TOL = 1e-5, 1e-10
# A compiled float32 forward on the CPU differs from eager's only by fused and reordered rounding.
COMPILE_TOL = 1e-5


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

    monkeypatch.setattr(integration, "_documents", fail)
    _assert_matches(model, valid, batch, references=("eager",))


def test_position_ids_are_never_read_on_the_host(device, monkeypatch):
    """The documents of a position_ids-packed batch are found on the device: varlen adds no device-to-host
    read to those transformers makes itself (counted with sdpa, whose packed-mask path reads the same)."""
    model = _llama(device)
    ids = torch.tensor([sum((f["input_ids"] for f in _packed_features()), [])], device=device)
    reads = []
    for name in ("cpu", "item", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, functools.partial(_count_read, reads, real))
    documents = []
    real_documents = integration._documents
    monkeypatch.setattr(integration, "_documents", lambda *a: documents.append(real_documents(*a)) or documents[-1])
    counts = {}
    for implementation in ("sdpa", "varlen"):
        model.set_attn_implementation(implementation)
        reads.clear()
        model(input_ids=ids, position_ids=_positions(device), use_cache=False)
        counts[implementation] = len(reads)
    assert len(documents) == 2 and documents[0] is not None  # both layers ran with the documents
    assert counts["varlen"] == counts["sdpa"], counts


def _count_read(reads, real, self, *args, **kwargs):
    reads.append(self.shape)
    return real(self, *args, **kwargs)


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


# ------------------------------------------------------------------------ generation, static caches
# Gemma3 alternates sliding-window (static: a rolling cache of `sliding_window` slots) and full layers.
ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM,
               dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                    layer_types=["sliding_attention", "full_attention"])),
}


def _model(arch, device):
    config_class, model_class, extra = ARCHITECTURES[arch]
    torch.manual_seed(0)
    return model_class(config_class(**_config(), **extra)).to(device, F64).eval()


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left_padded"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_generate_matches_sdpa(arch, cache, padded, device):
    """Greedy generation gives sdpa's tokens and step logits. A static cache has empty slots past the tokens
    seen, which must never be attended; decoding after any cache needs bottom-right alignment. (sdpa, not
    eager, for the reason given in test_left_padded_batch.) disable_compile: on the GPU, generate would
    compile the static-cache forward; compiled forwards have tests of their own below."""
    model = _model(arch, device)
    ids = torch.randint(3, 100, (2, 7), device=device)
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :3] = 0
    results = {}
    for name in ("sdpa", "varlen"):
        model.set_attn_implementation(name)
        results[name] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                                       cache_implementation="static" if cache == "static" else None,
                                       disable_compile=True, output_logits=True, return_dict_in_generate=True,
                                       pad_token_id=0)
    assert torch.equal(results["varlen"].sequences, results["sdpa"].sequences)
    for got, ref in zip(results["varlen"].logits, results["sdpa"].logits, strict=True):
        assert_close(got, ref, tol=SDPA_TOL, name="step logits")


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_static_cache_forward_without_mask(arch, device):
    """Forwards with a StaticCache and no attention mask: a prefill, a chunk continuing it and decoded tokens
    give sdpa's logits at every position (transformers gives no mask for the empty slots unless asked). Gemma3's
    4-slot sliding layers go from part-filled to full on the way."""
    model = _model(arch, device)
    ids = torch.randint(3, 100, (2, 7), device=device)
    logits = {}
    for name in ("sdpa", "varlen"):
        model.set_attn_implementation(name)
        cache = StaticCache(config=model.config, max_cache_len=16)
        logits[name] = [model(input_ids=chunk, past_key_values=cache).logits for chunk in ids.split([3, 2, 1, 1], 1)]
    for step, (got, ref) in enumerate(zip(logits["varlen"], logits["sdpa"], strict=True)):
        assert_close(got, ref, tol=SDPA_TOL, name=f"logits of forward {step}")


# ------------------------------------------------------------------------------------- torch.compile
# Dynamo-graph calls that read a tensor on the host (a device-to-host copy on the GPU).
HOST_READS = {"cpu", "item", "tolist", "nonzero", "numpy"}


def _compile_inputs(style):
    """A tiny float32 Llama on the CPU (the compile path doesn't depend on the device) and the inputs of one
    batch layout: unpadded with no mask, right-padded, the flattening collator's kwargs, position_ids only."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**_config(), attn_implementation="varlen")).eval()
    ids = torch.randint(0, 100, (2, 9))
    if style == "unpadded":
        return model, dict(input_ids=ids)
    if style == "right_padded":
        mask = torch.ones_like(ids)
        mask[0, 6:] = 0
        return model, dict(input_ids=ids, attention_mask=mask)
    batch = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(_packed_features(), return_tensors="pt")
    batch.pop("labels")
    if style == "collator":
        return model, batch
    return model, dict(input_ids=batch["input_ids"], position_ids=batch["position_ids"])


def _assert_compiles_to_eager(style, backend):
    model, inputs = _compile_inputs(style)
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    with torch.no_grad():
        eager = model(**inputs, use_cache=False).logits
        compiled = torch.compile(model, fullgraph=True, backend=counter)(**inputs, use_cache=False).logits
    torch._dynamo.reset()
    assert counter.frame_count == 1
    reads = [f"{n.target}: {n.meta.get('stack_trace', '')}" for g in counter.graphs for n in g.graph.nodes
             if n.op == "call_method" and n.target in HOST_READS]
    assert not reads, "host reads in the compiled graph:\n" + "\n".join(reads)
    assert_close(compiled, eager, tol=COMPILE_TOL, name="compiled logits")


@pytest.mark.parametrize("style", ["unpadded", "right_padded", "collator"])
def test_compiles_to_one_graph_without_host_reads(style):
    """torch.compile(model, fullgraph=True) gives eager's logits (aot_eager: dynamo and AOTAutograd trace
    everything but skip code generation); the mask function decides from shapes, never from mask values."""
    _assert_compiles_to_eager(style, "aot_eager")


@pytest.mark.inductor
def test_compiles_with_inductor():
    """The same through TorchInductor's code generation (C++ on the CPU)."""
    _assert_compiles_to_eager("unpadded", "inductor")


def test_position_ids_packed_batch_compiles():
    """Packed rows given by position_ids alone (no cu_seq_lens kwargs) under fullgraph compile."""
    _assert_compiles_to_eager("position_ids", "aot_eager")


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
    ({}, torch.ones(1, 1, 5), "attention_mask: expected a 2-D padding mask of shape (1, 5) or (1, 5) (batch, keys), "
                              "or a 4-D mask; got shape (1, 1, 5)"),
    ({}, torch.ones(1, 4), "attention_mask: expected a 2-D padding mask of shape (1, 5)"),
    ({}, torch.ones(3, 5), "attention_mask: expected a 2-D padding mask of shape (1, 5) or (1, 5) (batch, keys), or "
                           "a 4-D mask; got shape (3, 5)"),
])
def test_unsupported_inputs(kwargs, mask, message):
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        integration.varlen_attention_forward(_module(), q, q, q, mask, **kwargs)


@pytest.mark.parametrize("kwargs,mask,error,message", [
    (dict(sliding_window=-3), None, ValueError, "sliding_window: got -3; must be >= 0"),
    (dict(sliding_window=2.0), None, TypeError, "sliding_window: expected an int, got float"),
    (dict(dropout=None), None, ValueError, "dropout: expected a float in [0, 1), got None"),
    ({}, [[1, 1, 1, 1, 1]], TypeError, "attention_mask: expected a torch.Tensor or None, got list"),
    (dict(is_causal="yes"), None, TypeError, "is_causal: expected a bool or None, got str"),
    (dict(softcap="x"), None, TypeError, "softcap: expected a real number, got str 'x'"),
    (dict(position_ids=torch.arange(5.0)[None]), None, TypeError,
     "position_ids: expected an integer tensor, got torch.float32"),
])
def test_bad_arguments_are_named(kwargs, mask, error, message):
    """Arguments the attention would have named otherwise (sliding_window -3 as its window's left = -4), or not at
    all (a bare float() TypeError for dropout None, AttributeError for a list mask)."""
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(error, match=re.escape(message)):
        integration.varlen_attention_forward(_module(), q, q, q, mask, **kwargs)


# --------------------------------------------------------------------------------------- registration
def test_registered_with_transformers():
    assert transformers.AttentionInterface._global_mapping["varlen"] is integration.varlen_attention_forward
    assert transformers.AttentionMaskInterface._global_mapping["varlen"] is integration.varlen_mask


@pytest.mark.parametrize("architecture,config_class,sizes", [
    ("Falcon", FalconConfig, dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=1)),
    ("GPT-J", GPTJConfig, dict(n_embd=32, n_head=4, n_layer=1, rotary_dim=4)),
    ("GPT-Neo", GPTNeoConfig, dict(hidden_size=32, num_heads=4, num_layers=1, attention_types=[[["global"], 1]])),
], ids=["falcon", "gptj", "gpt_neo"])
def test_models_outside_the_attention_interface_raise(architecture, config_class, sizes):
    """These models pick their attention classes from a table of their own and would never call varlen:
    building one with "varlen" names the model instead of failing with a bare KeyError."""
    config = config_class(**sizes, vocab_size=100, bos_token_id=0, eos_token_id=0)
    with pytest.raises(ValueError, match=f'attn_implementation="varlen": {architecture} picks its attention'):
        AutoModelForCausalLM.from_config(config, attn_implementation="varlen")


def test_import_varlen_does_not_import_transformers():
    code = "import sys, varlen, varlen.integrations; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
