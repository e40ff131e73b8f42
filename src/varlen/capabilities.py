"""What each implementation can run, declared as data, and the one function that reads it.

An implementation (an attention backend, the fused CPU attention path inside the PyTorch backend, the
jagged ops' Triton kernels) declares a :class:`Capabilities`: the dtypes, device types and head dims it
takes and the attention features it implements. A call is described by the features it uses
(:data:`FEATURES`, each with a predicate on the call); :func:`unsupported_reasons` compares the two and
says in words what doesn't fit. Predicates are evaluated only for features an implementation lacks, so
a declaration that supports everything costs nothing (and never reads a device tensor). The tests build
their dtype lists from these declarations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from ._backend import BACKENDS, scoped, triton_unsupported_reason
from ._checks import FLOAT_DTYPES, check_choice


@dataclasses.dataclass(frozen=True)
class Call:
    """What :func:`unsupported_reasons` looks at: the validated attention call (``attn/options.py``)."""

    q: torch.Tensor
    bias: torch.Tensor | None
    alibi: torch.Tensor | None
    problem: object  # attention.options.Problem
    opts: object  # attention.options.AttentionOptions


def _same_lengths(problem) -> bool:
    if problem.dense:
        return problem.max_q == problem.max_k
    return problem.cu_q is problem.cu_k or torch.equal(problem.cu_q, problem.cu_k)  # a host read on a GPU


# Feature name: (how a reason names it, whether a call uses it).
FEATURES: dict[str, tuple[str, Callable[[Call], bool]]] = {
    "empty": ("an empty batch, head or sequence dim",
              lambda c: 0 in (c.problem.batch, c.problem.heads, c.problem.max_q, c.problem.max_k)),
    "jagged": ("a jagged batch", lambda c: not c.problem.dense),
    "causal": ("a causal mask", lambda c: c.opts.causal),
    "window": ("a window", lambda c: c.opts.window_left >= 0 or c.opts.window_right >= 0),
    "unequal_bottom_right": ("a bottom-right causal mask between different q and k lengths",
                             lambda c: c.opts.causal and c.opts.bottom_right and not _same_lengths(c.problem)),
    "gqa": ("grouped-query heads (Hkv < H)", lambda c: c.problem.kv_heads != c.problem.heads),
    "value_dim": ("a V head dim that differs from Q/K's", lambda c: c.problem.head_dim != c.problem.head_dim_v),
    "bias": ("an additive bias", lambda c: c.bias is not None),
    "jagged_bias": ("a bias on a jagged batch", lambda c: c.bias is not None and not c.problem.dense),
    "alibi": ("ALiBi", lambda c: c.alibi is not None),
    "softcap": ("softcap", lambda c: c.opts.softcap > 0),
    "dropout": ("dropout (varlen's Philox mask)", lambda c: c.opts.dropout_p > 0),
    "prefix": ("a prefix (prefix_len)", lambda c: c.opts.prefix_len is not None),
    "documents": ("documents (document_ids)", lambda c: c.opts.documents is not None),
    "query_offset": ("query positions (query_offset)", lambda c: c.opts.query_offset is not None),
    "deterministic": ("deterministic mode", lambda c: c.opts.deterministic),
    "negative_scale": ("a negative scale", lambda c: c.opts.scale < 0),
}
ALL_FEATURES = frozenset(FEATURES)


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What one implementation runs.

    ``devices``: device types; ``device_check`` (optional) refines them (the Triton kernels also run on CPU
    tensors under Triton's interpreter, and not at all without Triton): it returns why a device can't be
    used, or None. ``max_head_dim``: the largest Q/K or V head dim, None for any.
    """

    name: str
    dtypes: tuple[torch.dtype, ...]
    devices: tuple[str, ...]
    features: frozenset[str] = ALL_FEATURES
    max_head_dim: int | None = None
    device_check: Callable[[torch.device], str | None] | None = None

    def device_reason(self, device: torch.device) -> str | None:
        """Why this implementation can't run on ``device``, or None."""
        if self.device_check is not None:
            return self.device_check(device)
        if device.type not in self.devices:
            return f"tensors on {device.type} (it runs on {', '.join(self.devices)})"
        return None

    def dtype_reason(self, dtype: torch.dtype) -> str | None:
        if dtype in self.dtypes:
            return None
        names = ", ".join(str(d).replace("torch.", "") for d in self.dtypes)
        return f"dtype {str(dtype).replace('torch.', '')} (allowed: {names})"


def unsupported_reasons(caps: Capabilities, call: Call) -> list[str]:
    """Why ``caps``' implementation can't run ``call`` (empty when it can). On a device it can't use, the
    features are not examined: some predicates read tensors (``_same_lengths``), a host sync on a GPU."""
    device_reason = caps.device_reason(call.q.device)
    reasons = [r for r in (device_reason, caps.dtype_reason(call.q.dtype)) if r]
    dims = (call.problem.head_dim, call.problem.head_dim_v)
    if caps.max_head_dim is not None and max(dims) > caps.max_head_dim:
        reasons.append(f"head dims {dims} (at most {caps.max_head_dim})")
    if device_reason:
        return reasons
    for name in sorted(ALL_FEATURES - caps.features):
        text, uses = FEATURES[name]
        if uses(call):
            reasons.append(text)
    return reasons


# The jagged ops' Triton kernels, by family (the PyTorch path takes every dtype on every device):
# - copy: padded conversion and select, which move elements (any of these types);
# - ragged: softmax and sum/mean along the ragged dim;
# - matmul: matmul with per-sequence weights and transposed_matmul (tensor-core dots: no float64).
_COPY_DTYPES = FLOAT_DTYPES + (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool)
JAGGED_KERNELS = {
    "copy": Capabilities("triton", _COPY_DTYPES, ("cuda",), device_check=triton_unsupported_reason),
    "ragged": Capabilities("triton", FLOAT_DTYPES, ("cuda",), device_check=triton_unsupported_reason),
    "matmul": Capabilities("triton", (torch.float16, torch.bfloat16, torch.float32), ("cuda",),
                           device_check=triton_unsupported_reason),
}
# The attention backends declare theirs beside their code: attn/triton/backend.py,
# attn/torch_backend.py and its fused CPU path, attn/cpu_fused.py.


def resolve(device: torch.device, dtype: torch.dtype, kernels: str, requested: str | None = None,
            other_reason: str | None = None) -> str:
    """The backend (``"triton"`` or ``"torch"``) that runs a jagged op on ``device`` and ``dtype``.

    ``kernels``: the family of Triton kernels the op would run (:data:`JAGGED_KERNELS`). ``requested`` (an
    op's ``backend=``) overrides the scoped choice of ``varlen.use_backend``. ``other_reason``: why this op's
    kernels can't take this call, beyond device and dtype (None: they can). ``"auto"``: Triton on CUDA where the
    kernels take the call, else PyTorch; ``"triton"`` where they can't raises ValueError saying why.
    """
    name = scoped() if requested is None else requested
    check_choice("backend", name, BACKENDS)
    if name == "torch":
        return "torch"
    caps = JAGGED_KERNELS[kernels]
    reasons = [r for r in (caps.device_reason(device), caps.dtype_reason(dtype), other_reason) if r]
    if name == "auto":
        return "triton" if device.type == "cuda" and not reasons else "torch"
    if reasons:
        raise ValueError(f"backend='triton' can't take {', '.join(reasons)}")
    return "triton"
