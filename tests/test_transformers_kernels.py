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
from varlen.ops import _norm_kernels

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
cross_entropy_module = importlib.import_module("varlen.ops.cross_entropy")


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
    assert counts == {"rms_norm": norms, "mlp": LAYERS, "rotary": LAYERS, "loss": 1}
    turns = record_calls(monkeypatch, rotary, "rotary_tables_triton")
    products = record_calls(monkeypatch, swiglu, "silu_mul_fwd_triton")
    normalized = record_calls(monkeypatch, _norm_kernels, "norm_fwd_triton")
    with varlen.use_backend("triton"):
        got, got_grads = _logits_and_grads(ours, **inputs)
    assert len(turns) == 2 * LAYERS * 2 and len(products) == LAYERS  # q and k, forward and backward; the MLPs
    assert len(normalized) == norms
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


@pytest.mark.parametrize("normalization", ["mean", "num_items_in_batch", "shift_labels"])
def test_causal_lm_loss_matches_transformers(normalization, monkeypatch):
    """The patched model's loss (varlen.cross_entropy on the logits as they are) against transformers' ForCausalLMLoss
    on the same model: the label shift, ignored labels, the mean or the sum over num_items_in_batch."""
    theirs = _model("llama", torch.float64)
    inputs = _inputs("packed")
    labels = inputs["input_ids"].clone()
    labels[0, [4, 5]] = -100  # document ends, as the flattening collator marks them
    extra = {"mean": {}, "num_items_in_batch": {"num_items_in_batch": torch.tensor(7, device=DEVICE)},
             "shift_labels": {"shift_labels": torch.roll(labels, -1, dims=1)}}[normalization]
    params = [p for p in theirs.parameters() if p.requires_grad]
    want = theirs(**inputs, labels=labels, use_cache=False, **extra).loss
    want_grads = torch.autograd.grad(want, params)
    ours = copy.deepcopy(theirs)
    assert use_varlen_kernels(ours)["loss"] == 1
    losses = record_calls(monkeypatch, cross_entropy_module, "cross_entropy_fwd_triton")
    with varlen.use_backend("triton"):
        got = ours(**inputs, labels=labels, use_cache=False, **extra).loss
        got_grads = torch.autograd.grad(got, [p for p in ours.parameters() if p.requires_grad])
    # (transformers' loss is float32 even for float64 logits: it upcasts with .float(); varlen's keeps float64)
    assert len(losses) == 1 and got.dtype == torch.float64
    assert_close(got, want, tol=TOL[torch.float64], name="loss")
    for (name, _), g, w in zip(theirs.named_parameters(), got_grads, want_grads, strict=True):
        assert_close(g, w, tol=TOL[torch.float64], name=f"d{name}", floor=1e-12)


def test_rotary_function_falls_back_where_the_kernel_does_not_apply(monkeypatch):
    """transformers' own function for an odd head dim, another unsqueeze_dim, or an unknown keyword (which it then
    rejects itself); the kernel for the standard call."""
    use_varlen_kernels(_model("llama", torch.float64))
    modeling = importlib.import_module("transformers.models.llama.modeling_llama")
    patched, original = modeling.apply_rotary_pos_emb, modeling.apply_rotary_pos_emb.varlen_original
    turns = record_calls(monkeypatch, rotary, "rotary_tables_triton")

    def case(dim, heads_first=True):
        q, k = (torch.randn(*((2, h, 5, dim) if heads_first else (2, 5, h, dim)), dtype=torch.float64, device=DEVICE)
                for h in (4, 2))
        return q, k, *(torch.rand(1, 5, dim, dtype=torch.float64, device=DEVICE) for _ in range(2))
    with varlen.use_backend("triton"):
        for args, kwargs in [(case(5), {}), (case(6, heads_first=False), {"unsqueeze_dim": 2})]:
            got, want = patched(*args, **kwargs), original(*args, **kwargs)
            assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        with pytest.raises(TypeError):
            patched(*case(6), position_ids=None)
        assert turns == []
        patched(*case(6))
        assert len(turns) == 2


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
        # A bf16 model under autocast: the fused norm returns bf16 as transformers' does.
        bf16 = _model("llama", torch.bfloat16)
        bf16_want = bf16(**inputs, use_cache=False).logits
        use_varlen_kernels(bf16)
        bf16_got = bf16(**inputs, use_cache=False).logits
        assert bf16_got.dtype == bf16_want.dtype
        assert_close(bf16_got, bf16_want, tol=TOL[torch.bfloat16], name="bf16 logits")
        assert bf16.model.norm(torch.randn(3, 64, dtype=torch.bfloat16, device=DEVICE)).dtype == torch.bfloat16
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


def test_patched_model_compiles_to_one_graph(monkeypatch):
    """torch.compile(fullgraph=True) of the patched model: one graph, the kernels' custom ops in it, eager's logits
    and gradients (aot_eager: dynamo and AOTAutograd trace everything but skip code generation)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model = _model("llama", torch.float32)
    use_varlen_kernels(model)
    inputs = _inputs("packed")
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    with varlen.use_backend("triton"):
        want, want_grads = _logits_and_grads(model, **inputs)
        got, got_grads = _logits_and_grads(torch.compile(model, fullgraph=True, backend=counter), **inputs)
    torch._dynamo.reset()
    assert counter.frame_count == 1
    # (the autograd Functions' bodies are the graph's submodules)
    ops = [str(n.target) for g in counter.graphs for _, sub in g.named_modules() for n in sub.graph.nodes
           if n.op == "call_function" and str(n.target).startswith("varlen.")]
    assert sorted(set(ops)) == ["varlen.norm_backward.default", "varlen.norm_forward.default",
                                "varlen.rotary_tables.default", "varlen.silu_mul_backward.default",
                                "varlen.silu_mul_forward.default"], ops
    assert ops.count("varlen.silu_mul_forward.default") == LAYERS
    assert ops.count("varlen.norm_forward.default") == 2 * LAYERS + 1
    assert_close(got, want, tol=1e-5, name="compiled logits")
    for g, w in zip(got_grads, want_grads, strict=True):
        assert_close(g, w, tol=1e-5, floor=1e-12)
