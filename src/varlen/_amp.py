"""Mixed precision: varlen's ops follow ``torch.autocast`` as the torch ops they stand for do.

Inside ``torch.autocast(device_type, dtype)`` torch casts the inputs of the ops on its lists: matmul-like
ops (``mm``, ``bmm``, ``linear``, ``scaled_dot_product_attention``) run in the autocast dtype on every
device; ``softmax`` and ``sum`` run in float32 on CUDA (on the CPU they keep their input dtype). Tensors
of dtype float64 are never cast. varlen's ops that are torch ops underneath (``linear``, the pointwise
activations) get torch's casts as they are; the ops that run varlen's own kernels (attention, the per-sequence
matmuls, the ragged-dim softmax and sum, ``layer_norm``) apply the same rule through :func:`cast`, so that a model
keeps the precision it would have with the matching torch ops (``rms_norm`` too, where this torch has a rule for it).
The casts are ordinary ``Tensor.to`` calls: gradients flow back to the parameters in their own dtype.
"""

from __future__ import annotations

import contextlib

import torch

# The rule of the torch op that a varlen op stands for, and the device types where torch applies it.
LOWER_PRECISION = "lower_precision"  # torch.matmul, bmm, linear, scaled_dot_product_attention
FLOAT32 = "float32"  # torch.softmax, torch.sum
_DEVICES = {LOWER_PRECISION: ("cpu", "cuda"), FLOAT32: ("cuda",)}
# Whether torch's autocast runs rms_norm in float32 on CUDA, as it does layer_norm: from torch 2.12 on (2.11 has no
# rule for it: a 16-bit input with a float32 weight gives the input's dtype).
RMS_NORM_AUTOCASTS = torch._C._dispatch_has_kernel_for_dispatch_key("aten::rms_norm", "AutocastCUDA")


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The autocast dtype active for ``device``'s type, or None when autocast is off there."""
    if device.type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device.type):
        return None
    return torch.get_autocast_dtype(device.type)


def _target(policy: str, device: torch.device) -> torch.dtype | None:
    """The dtype autocast casts an op of ``policy`` on ``device``'s floating inputs to; None where it casts none."""
    active = autocast_dtype(device)
    if active is None or device.type not in _DEVICES[policy]:
        return None
    return active if policy == LOWER_PRECISION else torch.float32


def cast(policy: str, device: torch.device, *tensors):
    """``tensors`` as torch's autocast would hand them to an op of ``policy`` on ``device``.

    Floating tensors other than float64 are cast (to the autocast dtype, or to float32); None, integer
    tensors and float64 tensors pass unchanged, as do all of them when autocast is off.
    """
    target = _target(policy, device)
    if target is None:
        return tensors
    return tuple(t.to(target) if t is not None and t.is_floating_point() and t.dtype != torch.float64 else t
                 for t in tensors)


def cast_dtype(policy: str, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype :func:`cast` gives a floating tensor of ``dtype``."""
    target = _target(policy, device)
    return dtype if target is None or dtype == torch.float64 else target


def float32_matmul_uses_tf32() -> bool:
    """Whether float32 matmuls on CUDA may use TF32 matrix units: torch's own switch
    (``torch.backends.cuda.matmul.fp32_precision``, which ``allow_tf32`` and
    ``torch.set_float32_matmul_precision`` also set). varlen's float32 kernels follow it: TF32 when allowed,
    else full float32 accuracy."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
    if precision is None:  # torch < 2.9 has only the global setting
        return torch.get_float32_matmul_precision() != "highest"
    return precision == "tf32"


@contextlib.contextmanager
def float32_matmul_precision(precision: str):
    """torch's float32 matmul precision on CUDA (``torch.backends.cuda.matmul.fp32_precision``, which varlen's
    float32 kernels follow) set to ``precision`` ("ieee" or "tf32") inside the block, restored after it: for
    tests and benchmarks that compare both."""
    saved = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = precision
    try:
        yield
    finally:
        torch.backends.cuda.matmul.fp32_precision = saved


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision`` for inputs of ``dtype`` in varlen's kernels.

    float32: ``"tf32"`` when torch allows TF32 (:func:`float32_matmul_uses_tf32`), else ``"tf32x3"``: three
    TF32 products that split each operand into a high and a low part, about float32's accuracy at tensor-core
    speed (plain float32 ``"ieee"`` dots run on the CUDA cores, many times slower, and spill registers in the
    attention kernels). 16-bit inputs multiply exactly either way. (Under ``"tf32x3"`` the attention forward and
    the backward's kv kernel compute their products from three bf16 parts of each operand instead where they can:
    ``attn.triton.configs.splits_bf16``.)
    """
    if dtype == torch.float32 and not float32_matmul_uses_tf32():
        return "tf32x3"
    return "tf32"


def disabled(device: torch.device):
    """A context without autocast on ``device``: varlen's kernels run in the dtypes they were given."""
    if autocast_dtype(device) is None:  # nothing to switch off (and torch.autocast() costs ~10 us to enter)
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)
