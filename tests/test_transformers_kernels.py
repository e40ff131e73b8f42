"""``use_varlen_kernels``: transformers' Llama-family RMSNorm, SwiGLU MLP and rotary embeddings through varlen.

The patched model's logits and parameter gradients must match the same model unpatched (packed and padded
batches, Llama, Mistral, Qwen2 and Qwen3), with the kernels counted as run (so a silent fall-back fails); where a
kernel doesn't apply (autocast's float32 tables, CPU tensors without the Triton backend) transformers' own code
runs. On the CPU the kernels run under ``varlen.use_backend("triton")`` (Triton's interpreter), in float64, where
transformers' RMSNorm computes in float32 (so the two agree to ~1e-7); on the GPU also bf16.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import varlen
from conftest import DEVICE, ON_GPU
from utils import assert_close, record_calls
from varlen.integrations.transformers_kernels import use_varlen_kernels

ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
LAYERS = 2
# transformers' RMSNorm computes in float32 whatever the model's dtype; bf16: one rounding apart per kernel.
TOL = {torch.float64: 1e-5, torch.float32: 1e-5, torch.bfloat16: 3e-2}
rotary = importlib.import_module("varlen.ops.rotary")
swiglu = importlib.import_module("varlen.ops.swiglu")


@pytest.fixture(autouse=True)
def _restore_rotary_functions():
    """use_varlen_kernels replaces a modeling module's apply_rotary_pos_emb; give each test the original."""
    modules = [importlib.import_module(f"transformers.models.{arch}.modeling_{arch}") for arch in ARCHITECTURES]
    saved = [m.apply_rotary_pos_emb for m in modules]
    yield
    for module, function in zip(modules, saved, strict=True):
        module.apply_rotary_pos_emb = getattr(function, "varlen_original", function)


def _model(arch, dtype):
    config_class, model_class = ARCHITECTURES[arch]
    torch.manual_seed(0)
    config = config_class(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=LAYERS,
                          intermediate_size=96, vocab_size=100, head_dim=16, attn_implementation="sdpa")
    return model_class(config).to(DEVICE, dtype)


def _logits_and_grads(model, **inputs):
    logits = model(**inputs, use_cache=False).logits
    weights = torch.randn_like(logits, generator=torch.Generator(logits.device).manual_seed(5))
    grads = torch.autograd.grad((logits * weights).sum(), [p for p in model.parameters() if p.requires_grad])
    return logits, grads


def _inputs(style):
    ids = torch.randint(0, 100, (2 if style == "padded" else 1, 21), device=DEVICE)
    if style == "padded":
        mask = torch.ones_like(ids)
        mask[1, 13:] = 0
        return dict(input_ids=ids, attention_mask=mask)
    positions = torch.cat([torch.arange(n) for n in (5, 1, 15)]).view(1, -1).to(DEVICE)
    return dict(input_ids=ids, position_ids=positions)


DTYPES = [torch.float64] + ([torch.bfloat16] if ON_GPU else [])


@pytest.mark.parametrize("style", ["packed", "padded"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_patched_model_matches_transformers(dtype, arch, style, monkeypatch):
    theirs = _model(arch, dtype)
    inputs = _inputs(style)
    # (first: the rotary function use_varlen_kernels replaces is every model's of the architecture)
    want, want_grads = _logits_and_grads(theirs, **inputs)
    ours = copy.deepcopy(theirs)
    counts = use_varlen_kernels(ours)
    norms = LAYERS * (2 + 2 * (arch == "qwen3")) + 1  # two per layer (Qwen3: q and k norms too), the final one
    assert counts == {"rms_norm": norms, "mlp": LAYERS, "rotary": LAYERS}
    turns = record_calls(monkeypatch, rotary, "rotary_tables_triton")
    products = record_calls(monkeypatch, swiglu, "silu_mul_fwd_triton")
    with varlen.use_backend("triton"):
        got, got_grads = _logits_and_grads(ours, **inputs)
    assert len(turns) == 2 * LAYERS * 2 and len(products) == LAYERS  # q and k, forward and backward; the MLPs
    valid = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"])).bool()
    assert_close(got[valid], want[valid], tol=TOL[dtype], name="logits")
    for (name, _), g, w in zip(theirs.named_parameters(), got_grads, want_grads, strict=True):
        assert_close(g, w, tol=TOL[dtype], name=f"d{name}", floor=1e-12)


def test_transformers_code_where_the_kernels_do_not_apply(monkeypatch):
    """Without the Triton backend on the CPU the rotation is transformers' and the MLP torch's silu(gate) * up (the
    model then equals the unpatched one to float64 rounding but for the norms); a norm whose input dtype differs
    from its weight's runs transformers' forward."""
    theirs = _model("llama", torch.float64)
    inputs = _inputs("packed")
    want, _ = _logits_and_grads(theirs, **inputs)
    ours = copy.deepcopy(theirs)
    use_varlen_kernels(ours)
    turns = record_calls(monkeypatch, rotary, "rotary_tables_triton")
    with varlen.use_backend("torch"):
        got, _ = _logits_and_grads(ours, **inputs)
    assert turns == []
    assert_close(got, want, tol=TOL[torch.float64])
    norm = ours.model.norm
    x = torch.randn(3, 64, dtype=torch.float32, device=DEVICE)
    assert torch.equal(norm(x), type(norm).forward(norm, x))


def test_calling_twice_wraps_once():
    model = _model("llama", torch.float64)
    use_varlen_kernels(model)
    modeling = importlib.import_module("transformers.models.llama.modeling_llama")
    wrapped = modeling.apply_rotary_pos_emb
    assert use_varlen_kernels(model)["rotary"] == LAYERS
    assert modeling.apply_rotary_pos_emb is wrapped and not hasattr(wrapped.varlen_original, "varlen_original")


def test_bad_model():
    with pytest.raises(TypeError, match="model: expected a torch.nn.Module"):
        use_varlen_kernels("meta-llama/Llama-3.2-1B")


@pytest.mark.skipif(not ON_GPU, reason="CUDA autocast (the CPU's bf16 kernels run under the interpreter)")
def test_autocast_keeps_transformers_rotation(monkeypatch):
    """Under autocast the tables stay float32 while q is bf16: transformers' rotation (promoting q) runs, the norms
    and MLPs take the kernels, and the model matches the unpatched one under the same autocast."""
    theirs = _model("llama", torch.float32)
    inputs = _inputs("packed")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want, want_grads = _logits_and_grads(theirs, **inputs)
    ours = copy.deepcopy(theirs)
    use_varlen_kernels(ours)
    turns = record_calls(monkeypatch, rotary, "rotary_tables_triton")
    products = record_calls(monkeypatch, swiglu, "silu_mul_fwd_triton")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got, got_grads = _logits_and_grads(ours, **inputs)
    assert turns == [] and len(products) == LAYERS
    assert got.dtype == want.dtype
    assert_close(got, want, tol=TOL[torch.bfloat16], name="logits")
    for (name, _), g, w in zip(theirs.named_parameters(), got_grads, want_grads, strict=True):
        assert_close(g, w, tol=TOL[torch.bfloat16], name=f"d{name}", floor=1e-6)
