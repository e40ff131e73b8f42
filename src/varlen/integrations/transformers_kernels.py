"""varlen's kernels in Hugging Face transformers' Llama-family models: RMSNorm, SwiGLU MLP, rotary embeddings, loss.

Usage::

    from varlen.integrations.transformers_kernels import use_varlen_kernels
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="varlen")
    use_varlen_kernels(model)

What it replaces, in the architectures whose layers compute what these kernels compute (Llama, Mistral, Qwen2,
Qwen3; other modules are left alone):

- each RMSNorm module's forward: varlen's norm kernels (``varlen.ops.norm.normalize``: one kernel each way, the
  weight's gradient summed in the same backward pass, where transformers' float32 math takes several elementwise
  kernels; torch's fused ``rms_norm`` where varlen's ops run PyTorch, and under ``torch.compile``, where Inductor
  fuses it with its neighbours). It rounds once where transformers rounds the normalized value before the weight's
  product: results within one rounding of transformers'.
- each MLP module's forward (``gate_proj``, ``up_proj``, ``down_proj``, SiLU): ``silu(gate) * up`` in one varlen
  kernel each way (:func:`varlen.ops.swiglu.silu_mul`), the projections as before.
- a causal language model's ``loss_function`` (transformers' ``ForCausalLMLoss``, which takes a float32 copy of the
  logits first): :func:`causal_lm_loss`, the same loss through :func:`varlen.cross_entropy` on the logits as they
  are (float32 arithmetic, the gradient in the logits' dtype).
- the architecture's ``apply_rotary_pos_emb``, a function of its modeling module, so for every model of that
  architecture in the process: q and k each turned by one varlen kernel that reads transformers' cosine and sine
  tables (computed as before, by the model's rotary module), with float32 arithmetic rounded once; odd head dims keep
  transformers' code.

Where varlen's jagged ops run PyTorch (CPU tensors, unless ``varlen.use_backend("triton")`` runs the kernels
through Triton's interpreter) the rotary embeddings are transformers' own code and the MLP computes ``silu(gate) *
up`` in torch ops. Transformers' own code also runs for a norm whose input and weight dtypes differ, for tables in
another dtype than q (autocast keeps them float32 while q is 16-bit) and for other argument forms.
Nothing here reads the device on the host; the replaced functions compile with ``torch.compile``.
"""

from __future__ import annotations

import functools
import sys
import types

import torch
import torch.nn.functional as F

from .. import capabilities
from ..ops.cross_entropy import cross_entropy
from ..ops.norm import normalize
from ..ops.rotary import rotate_with_tables
from ..ops.swiglu import silu_mul

# The transformers classes whose computation is the one the kernels compute (checked in
# tests/test_transformers_kernels.py against the unpatched model).
ARCHITECTURES = ("Llama", "Mistral", "Qwen2", "Qwen3")
_SILU_CLASSES = ("SiLU", "SiLUActivation")


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if hidden_states.dtype != self.weight.dtype:  # transformers' product then promotes: keep its result dtype
        return type(self).forward(self, hidden_states)
    # (autocast may run rms_norm in float32, torch >= 2.12: transformers' norm returns the input's dtype)
    return normalize(hidden_states, tuple(self.weight.shape), self.weight, None, self.variance_epsilon,
                     centered=False).to(hidden_states.dtype)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


def _turn(x: torch.Tensor, cos_rows: torch.Tensor, sin_rows: torch.Tensor) -> torch.Tensor:
    """``x`` ``(B, H, S, D)`` turned by tables of one row per (batch, position), in ``x``'s layout."""
    batch, heads, seq, dim = x.shape
    rows = x.transpose(1, 2).reshape(batch * seq, heads, dim)  # a view for a projection's (B, S, H, D) rows
    return rotate_with_tables(rows, cos_rows, sin_rows).view(batch, seq, heads, dim).transpose(1, 2)


def _rotary_pos_emb(original):
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        unsqueeze_dim = kwargs.get("unsqueeze_dim", args[0] if args else 1)
        if (unsqueeze_dim != 1 or len(args) + len(kwargs) > 1 or set(kwargs) - {"unsqueeze_dim"} or q.dim() != 4
                or q.shape[-1] % 2
                or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape or cos.shape[-1] != q.shape[-1]
                or k.shape[-1] != q.shape[-1] or not q.dtype == k.dtype == cos.dtype == sin.dtype
                or cos.requires_grad or sin.requires_grad or cos.shape[1] != q.shape[2] or k.shape[2] != q.shape[2]
                or cos.shape[0] not in (1, q.shape[0]) or k.shape[0] != q.shape[0]
                or capabilities.resolve(q.device, q.dtype, "ragged") != "triton"):
            return original(q, k, cos, sin, *args, **kwargs)
        batch, _, seq, dim = q.shape
        tables = [t.expand(batch, seq, dim).reshape(batch * seq, dim) for t in (cos, sin)]
        return _turn(q, *tables), _turn(k, *tables)

    apply_rotary_pos_emb.varlen_original = original
    return apply_rotary_pos_emb


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                   num_items_in_batch: torch.Tensor | int | None = None, ignore_index: int = -100,
                   shift_labels: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` (the same label shift, ignore index and normalization: the mean over the
    labels, or the sum over ``num_items_in_batch``) through :func:`varlen.cross_entropy`, without its float32 copy
    of the logits. (Float64 logits give a float64 loss, where transformers' upcast gives float32.)"""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    logits = logits.reshape(-1, vocab_size)
    shift_labels = shift_labels.reshape(-1).to(logits.device)
    if num_items_in_batch is None:
        return cross_entropy(logits, shift_labels, ignore_index=ignore_index)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(logits.device)
    return cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction="sum") / num_items_in_batch


def _family(module: torch.nn.Module, kind: str) -> bool:
    name = type(module).__name__
    return any(name == arch + kind for arch in ARCHITECTURES)


def use_varlen_kernels(model: torch.nn.Module) -> dict[str, int]:
    """Route ``model``'s RMSNorm, SwiGLU MLP and rotary embeddings through varlen's kernels (see the module's
    docstring for what is replaced and when each falls back).

    Args:
        model: a transformers model (or any module holding such layers).

    Returns the number of modules replaced per kind: ``{"rms_norm": ..., "mlp": ..., "rotary": ..., "loss": ...}``
    (rotary: attention modules whose architecture's ``apply_rotary_pos_emb`` now runs the kernel; loss: causal
    language models whose ``loss_function`` is now :func:`causal_lm_loss`). Calling it again replaces nothing twice.
    Raises TypeError when ``model`` is not a ``torch.nn.Module``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module (a transformers model), got {type(model).__name__}")
    counts = {"rms_norm": 0, "mlp": 0, "rotary": 0, "loss": 0}
    for module in model.modules():
        if (getattr(module, "loss_type", None) == "ForCausalLM" and hasattr(module, "lm_head")
                and "loss_function" in dir(type(module))):
            module.loss_function = causal_lm_loss
            counts["loss"] += 1
        if _family(module, "RMSNorm"):
            module.forward = types.MethodType(_rms_norm_forward, module)
            counts["rms_norm"] += 1
        elif _family(module, "MLP") and type(getattr(module, "act_fn", None)).__name__ in _SILU_CLASSES:
            module.forward = types.MethodType(_mlp_forward, module)
            counts["mlp"] += 1
        elif _family(module, "Attention"):
            modeling = sys.modules[type(module).__module__]
            current = getattr(modeling, "apply_rotary_pos_emb", None)
            if current is None:
                continue
            if not hasattr(current, "varlen_original"):
                modeling.apply_rotary_pos_emb = _rotary_pos_emb(current)
            counts["rotary"] += 1
    return counts
