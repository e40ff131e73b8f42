"""End-to-end training steps of a Llama-style decoder on documents of mixed lengths: varlen next to its peers.

    PYTHONPATH=src python3 bench/train_llm.py --out bench/results/train_llm_h100.md --profile /tmp/train_llm.json
    .venv/bin/python bench/train_llm.py --device cpu --tiny   # smoke test of the logic (no FlexAttention on CPU)

The model is ``transformers``' ``LlamaForCausalLM`` built from a config (random init, about 150M parameters,
GQA, RMSNorm, rotary embeddings, SwiGLU MLP), in bf16. The documents (token ids drawn at random, lengths
log-uniform in [64, 4096]: many short ones and a long tail) are packed into batches of exactly ``--tokens``
tokens; every path runs forward, loss and backward on the same documents:

- ``varlen_packed``: attention implementation ``"varlen"``; one packed row per batch, as
  ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` builds it (``input_ids``, ``labels``,
  ``position_ids`` restarting at each document, and ``cu_seq_lens_q/k`` with ``max_length_q/k``), passed to
  the model as the collator's keyword arguments. Attention reads the sequence bounds from them, with no
  device-to-host copy. transformers' ``create_causal_mask`` still checks ``position_ids`` for packed documents
  (``find_packed_sequence_indices``: one host sync) for every attention implementation that registers a mask
  function, "varlen" and the flash-attention ones included; the host-syncs column counts what is left.
- ``flex_packed``: attention implementation ``"flex_attention"`` on the same row, without the flash-attention
  kwargs. transformers builds the document mask itself: ``create_causal_mask`` finds the documents from where
  ``position_ids`` restart (``find_packed_sequence_indices``, one host sync), ANDs "same document" into the
  causal ``mask_mod`` and builds a ``BlockMask`` (``create_block_mask(_compile=True)``) once per forward pass,
  shared by the layers; the attention is transformers' compiled ``flex_attention``.
- ``sdpa_padded``: attention implementation ``"sdpa"``; the documents as the rows of right-padded batches with
  an ``attention_mask``, in their sampled order, split into micro-batches of at most ``--padded-tokens``
  padded tokens (gradients accumulate over them; the loss is normalised by the whole batch's label count).
- ``varlen_kernels``: ``varlen_packed`` with varlen's kernels in the transformers model's other layers too
  (``varlen.integrations.transformers_kernels.use_varlen_kernels``: RMSNorm, the SwiGLU MLP, rotary embeddings, the
  loss through ``varlen.cross_entropy``).
- ``varlen_nn``: the same Llama written with ``varlen.nn.TransformerEncoderLayer`` (causal, pre-norm, GQA,
  ``norm="rms"``, ``activation="swiglu"``, ``rotary_base`` = the config's ``rope_theta``) on a
  ``varlen.JaggedTensor`` of the documents, with the transformers model's weights copied in (so its loss
  matches the other paths'), its loss through ``varlen.cross_entropy``. Parameters in bf16, as the others.

Measured per path: warm-up (every batch once, so that every Triton kernel and compiled graph exists), then
``--steps`` timed steps between ``torch.cuda.synchronize()`` calls. Real tokens/s counts document tokens only
(never padding). Peak memory: ``torch.cuda.max_memory_allocated`` over the timed steps (weights and gradients
included). Model TFLOP/s = (6 * P * T + 3 * A) / time, where P counts the parameters that multiply every
token (the weights of the linear layers, LM head included; not the embedding table, a lookup), T the real
tokens, and A the causal attention FLOPs of the real documents: forward 4 * L * L * hidden / 2 per layer for
a document of L tokens (QK^T and PV over the visible half), times 3 for forward and backward. The same FLOPs
count for every path, so padding computed in vain earns nothing. Host syncs: counted on one extra step with
``torch.cuda.set_sync_debug_mode("warn")``. ``--compile`` wraps each model in ``torch.compile``; ``--optimizer``
adds an AdamW step to each step.

``--profile PATH`` profiles two ``varlen_packed`` steps and two ``varlen_nn`` steps (eager) with ``torch.profiler``,
writes each Chrome trace to PATH with the path's name added (``PATH_varlen_nn.json``...), and prints the top CUDA
kernels and the step time per category (attention, matmul, norms, rotary, swiglu, loss, elementwise/other),
attributing the kernels that aren't attention, rotary, swiglu or matmul by name to the module or function that
launched them (transformers' MLP: its SwiGLU), in the forward pass and in the backward (through autograd's
sequence numbers).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import math
import os
import re
import sys
import time
import warnings
from collections import defaultdict

import torch
import transformers
from torch import nn
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM

import varlen
import varlen.integrations.transformers  # noqa: F401  (registers the attention implementation "varlen")

IGNORE_INDEX = -100  # label of tokens without a target: a document's first token, padding
PATHS = ("varlen_packed", "flex_packed", "sdpa_padded", "varlen_nn", "varlen_kernels")


@dataclasses.dataclass(frozen=True)
class Preset:
    """Model and data sizes; ``--tiny`` is the CPU smoke test's."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int  # SwiGLU width of the Llama MLP
    vocab: int
    min_len: int
    max_len: int
    tokens: int  # per batch
    batches: int
    steps: int


FULL = Preset(hidden=768, layers=12, heads=12, kv_heads=4, intermediate=3072, vocab=32000, min_len=64, max_len=4096,
              tokens=32768, batches=4, steps=12)
TINY = Preset(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=256, min_len=8, max_len=64,
              tokens=256, batches=2, steps=2)


# ------------------------------------------------------------------------------------------------- data
def sample_documents(gen: torch.Generator, tokens: int, min_len: int, max_len: int, vocab: int) -> list[torch.Tensor]:
    """Random token ids of documents filling exactly ``tokens``, lengths log-uniform in [min_len, max_len].

    The last document is cut to the room left (packing with truncation), so it may be shorter than min_len;
    a fixed row length keeps the packed paths' shapes static (Flex compiles for one shape).
    """
    docs, room = [], tokens
    while room > 0:
        u = float(torch.rand((), generator=gen))
        length = min(room, round(math.exp(math.log(min_len) + u * math.log(max_len / min_len))))
        docs.append(torch.randint(0, vocab, (length,), generator=gen))
        room -= length
    return docs


@dataclasses.dataclass
class Batch:
    """One batch of documents in every layout the paths take, already on the device."""

    lengths: list[int]
    packed: dict  # DataCollatorWithFlattening(return_flash_attn_kwargs=True)'s output: the model's kwargs
    micro_batches: list[dict]  # right-padded rows (input_ids, attention_mask, labels) for sdpa_padded
    padded_tokens: int  # rows x width, summed over the micro-batches
    jagged_ids: varlen.JaggedTensor  # (n_docs, j) token ids for varlen_nn
    targets: torch.Tensor  # (tokens,) the next token of each token, IGNORE_INDEX at each document's end

    @property
    def real_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def label_count(self) -> int:
        """Tokens with a target: all but the last of each document."""
        return self.real_tokens - len(self.lengths)


def padded_groups(docs: list[torch.Tensor], budget: int) -> list[list[torch.Tensor]]:
    """Consecutive documents grouped so that rows x longest row stays within ``budget`` tokens per group."""
    groups, group, width = [], [], 0
    for doc in docs:
        new_width = max(width, len(doc))
        if group and (len(group) + 1) * new_width > budget:
            groups.append(group)
            group, new_width = [], len(doc)
        group.append(doc)
        width = new_width
    groups.append(group)
    return groups


def right_padded(docs: list[torch.Tensor]) -> dict:
    """``input_ids`` (pad id 0), ``attention_mask`` and ``labels`` (IGNORE_INDEX at padding) of the rows."""
    width = max(len(d) for d in docs)
    input_ids = torch.zeros(len(docs), width, dtype=torch.long)
    attention_mask = torch.zeros(len(docs), width, dtype=torch.long)
    for row, doc in enumerate(docs):
        input_ids[row, :len(doc)] = doc
        attention_mask[row, :len(doc)] = 1
    labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)


def make_batch(docs: list[torch.Tensor], padded_budget: int, device: torch.device) -> Batch:
    # The collator's labels are the input ids with IGNORE_INDEX at each document's first token; the model
    # shifts them, so a document's last token gets no target (it would predict the next document).
    packed = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": d} for d in docs])
    packed = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in packed.items()}
    labels = packed["labels"][0]
    targets = torch.cat([labels[1:], labels.new_full((1,), IGNORE_INDEX)])  # the model's shift, done once
    lengths = [len(d) for d in docs]
    offsets = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    jagged_ids = varlen.JaggedTensor(torch.cat(docs), offsets, max(lengths)).to(device)  # validated on the host
    groups = padded_groups(docs, padded_budget)
    micro_batches = [{k: v.to(device) for k, v in right_padded(g).items()} for g in groups]
    return Batch(lengths=lengths, packed=packed, micro_batches=micro_batches,
                 padded_tokens=sum(len(g) * max(len(d) for d in g) for g in groups), jagged_ids=jagged_ids,
                 targets=targets)


def make_batches(preset: Preset, padded_budget: int, seed: int, device: torch.device) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    return [make_batch(sample_documents(gen, preset.tokens, preset.min_len, preset.max_len, preset.vocab),
                       padded_budget, device) for _ in range(preset.batches)]


# ----------------------------------------------------------------------------------------------- models
def llama_config(preset: Preset) -> LlamaConfig:
    return LlamaConfig(vocab_size=preset.vocab, hidden_size=preset.hidden, intermediate_size=preset.intermediate,
                       num_hidden_layers=preset.layers, num_attention_heads=preset.heads,
                       num_key_value_heads=preset.kv_heads, max_position_embeddings=max(4096, preset.max_len),
                       tie_word_embeddings=False, use_cache=False)


@contextlib.contextmanager
def own_rotary_function():
    """``use_varlen_kernels`` replaces transformers' ``apply_rotary_pos_emb`` for every Llama in the process: the
    paths after ``varlen_kernels`` get the original back."""
    from transformers.models.llama import modeling_llama

    original = modeling_llama.apply_rotary_pos_emb
    try:
        yield
    finally:
        modeling_llama.apply_rotary_pos_emb = original


def build_hf_path_model(path: str, preset: Preset, seed: int, device: torch.device) -> LlamaForCausalLM:
    impl = {"varlen_packed": "varlen", "varlen_kernels": "varlen", "flex_packed": "flex_attention",
            "sdpa_padded": "sdpa"}[path]
    model = build_llama(preset, impl, seed, device)
    if path == "varlen_kernels":
        from varlen.integrations.transformers_kernels import use_varlen_kernels

        use_varlen_kernels(model)
    return model


def build_llama(preset: Preset, attn_implementation: str, seed: int, device: torch.device) -> LlamaForCausalLM:
    """The same random weights for every path (built on the CPU from the seed, then moved).

    Built in bf16 as ``from_pretrained(..., dtype=torch.bfloat16)`` builds a model: the rotary embedding's
    ``inv_freq`` buffer stays float32 (``model.to(torch.bfloat16)`` would round it).
    """
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(llama_config(preset), dtype=torch.bfloat16).to(device)
    model.set_attn_implementation(attn_implementation)
    return model.train()


class JaggedDecoder(nn.Module):
    """The Llama of the other paths from ``varlen.nn`` on jagged batches: embedding, causal pre-norm layers
    (RMSNorm, GQA attention with rotary embeddings, SwiGLU MLP, no biases), RMSNorm, LM head."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            varlen.nn.TransformerEncoderLayer(
                config.hidden_size, config.num_attention_heads, dim_feedforward=config.intermediate_size,
                dropout=0.0, activation="swiglu", layer_norm_eps=config.rms_norm_eps, norm_first=True, bias=False,
                causal=True, num_kv_heads=config.num_key_value_heads, norm="rms",
                rotary_base=config.rope_parameters["rope_theta"])
            for _ in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    @torch.no_grad()
    def load_llama(self, llama: LlamaForCausalLM) -> JaggedDecoder:
        """Copy a transformers Llama's weights: q, k, v into the fused input projection, gate and up into
        ``linear1`` (the gate first)."""
        self.embed.weight.copy_(llama.model.embed_tokens.weight)
        for ours, theirs in zip(self.layers, llama.model.layers, strict=True):
            attn, mlp = theirs.self_attn, theirs.mlp
            ours.self_attn.in_proj_weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight,
                                                           attn.v_proj.weight]))
            ours.self_attn.out_proj.weight.copy_(attn.o_proj.weight)
            ours.linear1.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            ours.linear2.weight.copy_(mlp.down_proj.weight)
            ours.norm1.weight.copy_(theirs.input_layernorm.weight)
            ours.norm2.weight.copy_(theirs.post_attention_layernorm.weight)
        self.norm.weight.copy_(llama.model.norm.weight)
        self.lm_head.weight.copy_(llama.lm_head.weight)
        return self

    def forward(self, ids: varlen.JaggedTensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the next-token predictions (``targets``: one per token, flat)."""
        x = ids.with_values(self.embed(ids.values))
        for layer in self.layers:
            x = layer(x)
        x = varlen.rms_norm(x, self.norm.normalized_shape, self.norm.weight, self.norm.eps)
        return self.loss_function(self.lm_head(x.values), targets)

    @staticmethod
    def loss_function(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # transformers' ForCausalLMLoss (float32 arithmetic, mean over the labels), without a float32 copy of logits
        return varlen.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)


def build_jagged_decoder(preset: Preset, seed: int, device: torch.device) -> JaggedDecoder:
    """The other paths' model (same seed, built on the CPU) rewritten with varlen.nn."""
    llama = build_llama(preset, "sdpa", seed, torch.device("cpu"))
    decoder = JaggedDecoder(llama.config).to(torch.bfloat16).load_llama(llama)
    return decoder.to(device).train()


def matmul_parameters(model: nn.Module) -> int:
    """Parameters that multiply every token: linear weights (LM head included), varlen's fused q/k/v weight."""
    total = 0
    for module in model.modules():
        if isinstance(module, nn.Linear):
            total += module.weight.numel()
        elif isinstance(module, varlen.nn.MultiheadAttention):
            total += module.in_proj_weight.numel()  # its out_proj is an nn.Linear, counted above
    return total


def attention_flops(lengths: list[int], hidden: int, layers: int) -> int:
    """Causal attention FLOPs of forward + backward: 3 x (4 * L * L * hidden / 2) per document and layer."""
    return 3 * layers * sum(2 * n * n * hidden for n in lengths)


def model_flops(model: nn.Module, preset: Preset, batch: Batch) -> int:
    return 6 * matmul_parameters(model) * batch.real_tokens + attention_flops(batch.lengths, preset.hidden,
                                                                                preset.layers)


# ------------------------------------------------------------------------------------------------ steps
def flex_inputs(batch: Batch) -> dict:
    """The packed row without the flash-attention kwargs: transformers derives the documents from position_ids."""
    return {k: batch.packed[k] for k in ("input_ids", "labels", "position_ids")}


def hf_packed_step(model, inputs_of):
    def step(batch: Batch) -> torch.Tensor:
        loss = model(**inputs_of(batch)).loss
        loss.backward()
        return loss.detach()
    return step


def hf_padded_step(model):
    def step(batch: Batch) -> torch.Tensor:
        total = None
        for micro in batch.micro_batches:
            # Sum over the micro-batch, divided by the whole batch's label count: the packed paths' mean loss.
            loss = model(**micro, num_items_in_batch=batch.label_count).loss
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
        return total
    return step


def jagged_step(model):
    def step(batch: Batch) -> torch.Tensor:
        loss = model(batch.jagged_ids, batch.targets)
        loss.backward()
        return loss.detach()
    return step


def with_optimizer(step, model, use_optimizer: bool, device: torch.device):
    """Gradients cleared before each step (no accumulation kernels); an AdamW step after it if asked."""
    optimizer = None
    if use_optimizer:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

    def full_step(batch: Batch) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        loss = step(batch)
        if optimizer is not None:
            optimizer.step()
        return loss
    return full_step


# ------------------------------------------------------------------------------------------ measurement
@dataclasses.dataclass
class Result:
    path: str
    tokens_per_s: float | None = None
    peak_gib: float | None = None
    tflops: float | None = None
    ms_per_step: float | None = None
    host_syncs: int | None = None
    first_loss: float | None = None
    note: str = ""


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def count_host_syncs(step, batch: Batch) -> int:
    """Synchronizing CUDA calls made by one step, as reported by the sync debug mode. (Switching the mode on
    warns once by itself, the first time in a process: not the step's, so not recorded.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(batch)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return sum("synchroniz" in str(w.message) for w in caught)


def measure(path: str, step, flops: list[int], batches: list[Batch], steps: int, device: torch.device,
            note: str) -> Result:
    """Time ``steps`` steps over the batches in turn; ``flops[i]``: the model FLOPs of ``batches[i]``."""
    # Warm-up: every batch once, so that each shape's kernels and graphs are compiled before timing.
    losses = [step(batch) for batch in batches]
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timed = [i % len(batches) for i in range(steps)]
    start = time.perf_counter()
    for i in timed:
        step(batches[i])
    synchronize(device)
    elapsed = time.perf_counter() - start
    result = Result(path, tokens_per_s=sum(batches[i].real_tokens for i in timed) / elapsed,
                    tflops=sum(flops[i] for i in timed) / elapsed / 1e12, ms_per_step=1e3 * elapsed / steps,
                    first_loss=float(losses[0]), note=note)
    if device.type == "cuda":
        result.peak_gib = torch.cuda.max_memory_allocated() / 2**30
        result.host_syncs = count_host_syncs(step, batches[0])
    return result


def run_path(path: str, args, preset: Preset, batches: list[Batch], device: torch.device) -> Result:
    """Build the path's model and time it; a failure (e.g. out of memory) becomes the row's note."""
    if path == "flex_packed" and device.type == "cpu":
        return Result(path, note="skipped: FlexAttention has no backward on the CPU (torch raises)")
    try:
        note = ""
        if path == "varlen_nn":
            model = build_jagged_decoder(preset, args.seed, device)
            note = "varlen.nn Llama layers (RMSNorm, rotary, SwiGLU) with the same weights"
        else:
            model = build_hf_path_model(path, preset, args.seed, device)
        if path == "varlen_kernels":
            note = "varlen_packed + use_varlen_kernels (RMSNorm, SwiGLU, rotary, loss)"
        runner = torch.compile(model) if args.compile else model
        if path in ("varlen_packed", "varlen_kernels"):
            step = hf_packed_step(runner, lambda b: b.packed)
        elif path == "flex_packed":
            step = hf_packed_step(runner, flex_inputs)
        elif path == "sdpa_padded":
            step = hf_padded_step(runner)
            micro = sum(len(b.micro_batches) for b in batches) / len(batches)
            padding = 1 - sum(b.real_tokens for b in batches) / sum(b.padded_tokens for b in batches)
            note = (f"{micro:.1f} micro-batches per step (at most {args.padded_tokens} padded tokens each), "
                    f"{100 * padding:.0f}% padding")
        else:
            step = jagged_step(runner)
        step = with_optimizer(step, model, args.optimizer, device)
        flops = [model_flops(model, preset, b) for b in batches]
        return measure(path, step, flops, batches, preset.steps, device, note)
    except torch.OutOfMemoryError:
        return Result(path, note=f"out of memory ({torch.cuda.get_device_properties(device).total_memory / 2**30:.0f}"
                                 " GiB device)")
    except Exception as exc:  # a path that can't run here: say why in its row, keep the others
        return Result(path, note="failed: " + f"{type(exc).__name__}: {exc}".replace("\n", " ")[:160])


# -------------------------------------------------------------------------------------------- profiling
LABEL_PREFIX = "train_llm::"
# Kernel names that say what they compute, checked before the launching module's label (a projection inside
# the attention module is a matmul). The aten names cover the CPU smoke run, where ops stand in for kernels.
NAMED_CATEGORIES = (
    ("norms", re.compile(r"_norm_(fwd|bwd|sum_parts)_")),  # (before attention's "_bwd_")
    ("rotary", re.compile(r"_rotary_")),
    ("swiglu", re.compile(r"_swiglu_")),
    ("loss", re.compile(r"_cross_entropy_")),
    ("attention", re.compile(r"_attn_|_bwd_|flash|fmha|attention")),
    ("matmul", re.compile(r"gemm|cutlass|nvjet|xmma|^aten::(mm|addmm|bmm|baddbmm)$")),
)
# For kernels the module labels don't place (e.g. launched outside any labelled module).
FALLBACK_CATEGORIES = (
    ("norms", re.compile(r"rms_?norm|layer_?norm|GammaBeta", re.IGNORECASE)),
    ("loss", re.compile(r"log_softmax|nll_loss|cross_entropy", re.IGNORECASE)),
)
CATEGORIES = ("attention", "matmul", "norms", "rotary", "swiglu", "loss", "elementwise/other")


def module_label(module: nn.Module) -> str | None:
    name = type(module).__name__
    if name.endswith("RMSNorm") or isinstance(module, nn.LayerNorm):
        return "norms"
    if name.endswith("RotaryEmbedding"):
        return "rotary"
    if name.endswith("MLP"):  # its matmuls are told apart by name: what is left is the SwiGLU's elementwise work
        return "swiglu"
    if name.endswith("Attention"):  # what runs inside that isn't a matmul or rotary: attention's own work
        return "attention"
    return None


@contextlib.contextmanager
def labelled_scopes(model: nn.Module):
    """Profiler ranges named after what each part of the forward pass computes (norms, rotary, attention, the MLP's
    SwiGLU, loss), so that the elementwise kernels of eager RMSNorm, rotary and SwiGLU can be told apart from the
    others."""
    open_ranges, handles, restore = [], [], []

    def enter(label):
        def hook(module, args):
            scope = torch.profiler.record_function(LABEL_PREFIX + label)
            scope.__enter__()
            open_ranges.append(scope)
        return hook

    def leave(module, args, output):
        open_ranges.pop().__exit__(None, None, None)

    def labelled(fn, label):
        def call(*args, **kwargs):
            with torch.profiler.record_function(LABEL_PREFIX + label):
                return fn(*args, **kwargs)
        return call

    for module in model.modules():
        label = module_label(module)
        if label is not None:
            handles += [module.register_forward_pre_hook(enter(label)), module.register_forward_hook(leave)]
        # transformers applies the rotary embedding with a function of the model's module, not a submodule.
        namespace = sys.modules[type(module).__module__]
        if (label == "attention" and callable(getattr(namespace, "apply_rotary_pos_emb", None))
                and not any(ns is namespace for ns, _ in restore)):
            restore.append((namespace, namespace.apply_rotary_pos_emb))
            namespace.apply_rotary_pos_emb = labelled(namespace.apply_rotary_pos_emb, "rotary")
    model.loss_function = labelled(model.loss_function, "loss")
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        for namespace, fn in restore:
            namespace.apply_rotary_pos_emb = fn
        if isinstance(model, LlamaForCausalLM):
            del model._loss_function  # back to transformers' loss_function property
        else:
            del model.loss_function  # back to JaggedDecoder's method


def scope_label(event) -> str | None:
    """The innermost label range around a profiler event."""
    while event is not None:
        if event.name.startswith(LABEL_PREFIX):
            return event.name[len(LABEL_PREFIX):]
        event = event.cpu_parent
    return None


def kernel_records(events, device: torch.device) -> list[tuple[str, float, str, int]]:
    """``(kernel name, microseconds, category, calls)`` of the kernels (CPU: of every aten op's own time).

    A backward kernel takes the label of the forward op that recorded its autograd node: both carry the
    node's sequence number.
    """
    label_of_node = {}
    for event in events:
        if event.sequence_nr >= 0 and not event.name.startswith("autograd::engine"):
            label = scope_label(event)
            if label is not None:
                label_of_node.setdefault(event.sequence_nr, label)

    def label_of(event) -> str | None:
        label = scope_label(event)
        while label is None and event is not None:
            if event.name.startswith("autograd::engine::evaluate_function"):
                return label_of_node.get(event.sequence_nr)
            event = event.cpu_parent
        return label

    def category(name: str, label: str | None) -> str:
        for cat, pattern in NAMED_CATEGORIES:
            if pattern.search(name):
                return cat
        if label is not None:
            return label
        for cat, pattern in FALLBACK_CATEGORIES:
            if pattern.search(name):
                return cat
        return "elementwise/other"

    records = []
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CPU:
            continue
        if device.type == "cuda":
            records += [(k.name, k.duration, category(k.name, label_of(event)), 1) for k in event.kernels]
        elif event.name.startswith("aten::") and event.self_cpu_time_total > 0:
            records.append((event.name, event.self_cpu_time_total, category(event.name, label_of(event)), 1))
    if device.type == "cuda":
        # Kernels the profiler linked to no CPU op (launched outside any): categorised by their names alone.
        linked, launched = defaultdict(lambda: [0.0, 0]), defaultdict(lambda: [0.0, 0])
        for name, us, _, _ in records:
            linked[name][0] += us
            linked[name][1] += 1
        for event in events:
            # The GPU's copies of the label ranges (and any other user annotation) span kernels; they aren't any.
            annotation = getattr(event, "is_user_annotation", False) or event.name.startswith(LABEL_PREFIX)
            if event.device_type == torch.autograd.DeviceType.CUDA and not annotation:
                launched[event.name][0] += event.time_range.elapsed_us()
                launched[event.name][1] += 1
        records += [(name, us - linked[name][0], category(name, None), calls - linked[name][1])
                    for name, (us, calls) in launched.items() if calls > linked[name][1]]
    return records


def profile_path(path: str, args, preset: Preset, batches: list[Batch], device: torch.device) -> list[str]:
    """Markdown lines: the top kernels and the time per category of two eager steps of ``path`` (varlen_packed,
    varlen_kernels or varlen_nn); its Chrome trace to ``args.profile`` with the path's name before the extension."""
    from torch.profiler import ProfilerActivity, profile

    if path == "varlen_nn":
        model = build_jagged_decoder(preset, args.seed, device)
        step = with_optimizer(jagged_step(model), model, args.optimizer, device)
    else:
        model = build_hf_path_model(path, preset, args.seed, device)
        step = with_optimizer(hf_packed_step(model, lambda b: b.packed), model, args.optimizer, device)
    stem, ext = os.path.splitext(args.profile)
    trace = f"{stem}_{path}{ext}"
    for batch in batches:
        step(batch)
    profiled = [batches[i % len(batches)] for i in range(2)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with labelled_scopes(model), profile(activities=activities) as prof:
        synchronize(device)
        start = time.perf_counter()
        for batch in profiled:
            step(batch)
        synchronize(device)
        step_us = 1e6 * (time.perf_counter() - start) / len(profiled)
    prof.export_chrome_trace(trace)
    records = kernel_records(prof.events(), device)
    del model, step
    gc.collect()

    per_step = 1 / len(profiled)
    by_kernel = defaultdict(lambda: [0.0, 0])
    by_category = dict.fromkeys(CATEGORIES, 0.0)
    for name, us, cat, calls in records:
        by_kernel[(name, cat)][0] += us * per_step
        by_kernel[(name, cat)][1] += calls
        by_category[cat] += us * per_step
    unit = "CUDA kernels" if device.type == "cuda" else "aten ops (CPU: their own time stands in for kernels)"
    lines = [f"\n### Profile: {path}, eager, {len(profiled)} steps ({step_us / 1e3:.1f} ms per profiled step)",
             f"\nTime per step by category ({unit}); the chrome trace is {trace}.\n",
             "| category | ms per step | share of step |", "|---|---|---|"]
    for cat, us in by_category.items():
        lines.append(f"| {cat} | {us / 1e3:.2f} | {100 * us / step_us:.1f}% |")
    busy = sum(by_category.values())
    idle = "GPU idle (host-bound gaps)" if device.type == "cuda" else "outside aten ops (Python, dispatch)"
    lines.append(f"| {idle} | {max(0.0, step_us - busy) / 1e3:.2f} | {100 * max(0.0, step_us - busy) / step_us:.1f}% |")
    lines += [f"\nTop 25 {'CUDA kernels' if device.type == 'cuda' else 'aten ops'} by time:\n",
              "| kernel | category | calls per step | ms per step | share of step |", "|---|---|---|---|---|"]
    top = sorted(by_kernel.items(), key=lambda item: -item[1][0])[:25]
    for (name, cat), (us, calls) in top:
        shown = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"| `{shown}` | {cat} | {calls * per_step:g} | {us / 1e3:.3f} | {100 * us / step_us:.1f}% |")
    return lines


# ---------------------------------------------------------------------------------------------- report
def fmt(value, spec: str) -> str:
    return "" if value is None else format(value, spec)


def data_summary(batches: list[Batch], padded_budget: int) -> str:
    lengths = sorted(n for b in batches for n in b.lengths)
    real = sum(lengths)
    # Padding if each batch were one padded batch (n_docs, longest), and with the micro-batches sdpa_padded runs.
    one_padded = sum(len(b.lengths) * max(b.lengths) for b in batches)
    micro = sum(b.padded_tokens for b in batches)
    return (f"Data: {len(batches)} batches of {batches[0].real_tokens} tokens, {len(lengths)} documents "
            f"(lengths min {lengths[0]}, median {lengths[len(lengths) // 2]}, mean {real / len(lengths):.0f}, "
            f"max {lengths[-1]}; {100 * sum(n for n in lengths if n >= 1024) / real:.0f}% of the tokens in documents "
            f"of 1024 or more). Padding if padded: {100 * (1 - real / one_padded):.0f}% as one padded batch per step, "
            f"{100 * (1 - real / micro):.0f}% in micro-batches of at most {padded_budget} padded tokens.")


def report(args, preset: Preset, batches: list[Batch], results: list[Result], device: torch.device) -> list[str]:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    with torch.device("meta"):  # shapes only: no memory, no init time
        llama = LlamaForCausalLM(llama_config(preset))
    n_params = sum(p.numel() for p in llama.parameters())
    head = (f"{where}, torch {torch.__version__}, triton {triton_version}, transformers {transformers.__version__}, "
            f"varlen {varlen.__version__}, {datetime.date.today()}. bf16, forward + loss + backward per step"
            + (", AdamW step" if args.optimizer else "") + (", torch.compile" if args.compile else "")
            + f"; {preset.steps} timed steps after one warm-up step per batch.")
    model_line = (f"Model: LlamaForCausalLM, random init, {n_params:,} parameters ({matmul_parameters(llama):,} in "
                  f"matmuls), hidden {preset.hidden}, {preset.layers} layers, {preset.heads} heads / "
                  f"{preset.kv_heads} kv heads, SwiGLU {preset.intermediate}, vocab {preset.vocab}.")
    lines = [f"## End-to-end training steps ({'tiny CPU smoke test' if args.tiny else 'Llama-style, ~150M'})", "",
             head, "", model_line, "", data_summary(batches, args.padded_tokens), "",
             "Model TFLOP/s: (6 x matmul parameters x real tokens + 3 x causal attention FLOPs of the real documents) "
             "/ time; padding earns nothing. Host syncs: on one extra step, CUDA sync debug mode.", "",
             "| path | real tokens/s | varlen_packed speed-up | peak GiB | model TFLOP/s | ms/step | host syncs/step "
             "| loss (batch 0) | notes |", "|---|---|---|---|---|---|---|---|---|"]
    reference = next((r.tokens_per_s for r in results if r.path == "varlen_packed"), None)
    for r in results:
        speedup = f"{reference / r.tokens_per_s:.2f}x" if reference and r.tokens_per_s else ""
        lines.append(f"| {r.path} | {fmt(r.tokens_per_s, ',.0f')} | {speedup} | {fmt(r.peak_gib, '.1f')} | "
                     f"{fmt(r.tflops, '.3g')} | {fmt(r.ms_per_step, '.1f')} | {fmt(r.host_syncs, 'd')} | "
                     f"{fmt(r.first_loss, '.4f')} | {r.note} |")
    lines.append("")
    by_path = {r.path: r.tokens_per_s for r in results}
    for peer, target in (("flex_packed", 1.3), ("sdpa_padded", 4.0)):
        if reference and by_path.get(peer):
            ratio = reference / by_path[peer]
            lines.append(f"Target: varlen_packed / {peer} = {ratio:.2f}x (target >= {target}x: "
                         f"{'met' if ratio >= target else 'not met'}).  ")
        else:
            lines.append(f"Target: varlen_packed / {peer}: not measured in this run.  ")
    if by_path.get("varlen_kernels") and by_path.get("flex_packed"):
        lines.append(f"varlen_kernels / flex_packed = {by_path['varlen_kernels'] / by_path['flex_packed']:.2f}x (the "
                     "same transformers model with varlen's RMSNorm, SwiGLU, rotary and loss kernels too).  ")
    return lines


# ------------------------------------------------------------------------------------------------ main
def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny model and documents (CPU smoke test)")
    ap.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    ap.add_argument("--tokens", type=int, help=f"tokens per batch (default {FULL.tokens}; tiny {TINY.tokens})")
    ap.add_argument("--batches", type=int, help=f"distinct batches (default {FULL.batches})")
    ap.add_argument("--steps", type=int, help=f"timed steps (default {FULL.steps})")
    ap.add_argument("--min-len", type=int, help=f"shortest document (default {FULL.min_len})")
    ap.add_argument("--max-len", type=int, help=f"longest document (default {FULL.max_len})")
    ap.add_argument("--padded-tokens", type=int,
                    help="sdpa_padded: most padded tokens per micro-batch (default: --tokens, the packed row's size)")
    ap.add_argument("--compile", action="store_true", help="torch.compile each model")
    ap.add_argument("--optimizer", action="store_true", help="add an AdamW step to each timed step")
    ap.add_argument("--profile", metavar="PATH",
                    help="profile two varlen_packed and two varlen_nn steps; Chrome traces to PATH_<path>")
    ap.add_argument("--out", metavar="FILE", help="also write the markdown report to FILE")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    preset = TINY if args.tiny else FULL
    overrides = dict(tokens=args.tokens, batches=args.batches, steps=args.steps, min_len=args.min_len,
                     max_len=args.max_len)
    args.preset = dataclasses.replace(preset, **{k: v for k, v in overrides.items() if v is not None})
    if args.padded_tokens is None:
        args.padded_tokens = args.preset.tokens
    if args.padded_tokens < args.preset.max_len:
        ap.error(f"--padded-tokens {args.padded_tokens} can't hold one document of --max-len {args.preset.max_len}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    preset, device = args.preset, torch.device(args.device)
    if args.compile:
        # Every batch has its own document lengths; past dynamo's default of 8 recompiles a model would run
        # eagerly without saying so.
        torch._dynamo.config.cache_size_limit = 64
    batches = make_batches(preset, args.padded_tokens, args.seed, device)
    print(data_summary(batches, args.padded_tokens), flush=True)
    results = []
    for path in args.paths:
        with own_rotary_function():
            results.append(run_path(path, args, preset, batches, device))
        # The path's model, gradients and any failed step's tensors (held by the traceback) go before the next.
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        r = results[-1]
        peak = "" if r.peak_gib is None else f", peak {r.peak_gib:.1f} GiB"
        print(f"{path}: {fmt(r.tokens_per_s, ',.0f')} tokens/s, {fmt(r.ms_per_step, '.1f')} ms/step{peak}. {r.note}",
              flush=True)
    lines = report(args, preset, batches, results, device)
    if args.profile:
        for path in ("varlen_packed", "varlen_kernels", "varlen_nn"):
            with own_rotary_function():
                lines += profile_path(path, args, preset, batches, device)
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
