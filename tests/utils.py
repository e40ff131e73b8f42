"""Helpers shared by the tests: tolerances, error measures, random jagged batches, rows not 16 elements apart, a call
recorder."""

import math

import torch

import varlen
from conftest import DEVICE, ON_GPU

# Relative error ||out - ref|| / ||ref|| allowed against a float64 reference, per compute dtype.
# float32 on the GPU: 3e-3 is TF32's error (10-bit mantissas in the dot products), which varlen's Triton kernels
# and torch's float32 matmuls (the PyTorch backend, the padded torch modules that some tests compare with) both
# take when torch allows TF32. At torch's defaults both are float32-accurate (bf16 parts or three-pass TF32 dots
# in the kernels, IEEE in cuBLAS): the float32 checks that use this table stayed under 1e-6 in a run of most of
# the suite on an H100, so 3e-3 is loose there. The tests that hold float32 accuracy itself ask for it explicitly
# (varlen._amp.float32_matmul_precision("ieee") in test_attention.py and test_ops_linear.py).
REL_TOL = {
    torch.float64: 1e-10,
    torch.float32: 3e-3 if ON_GPU else 2e-5,
    torch.float16: 3e-3,
    torch.bfloat16: 2e-2,
}

# The Triton kernels run on the GPU, or through the interpreter here (CPU tensors).
KERNEL_DEVICE = DEVICE


def checkable_dtypes(caps, *, half_on_cpu: bool = True) -> list[torch.dtype]:
    """The float dtypes a backend declares (``varlen.capabilities``), less those this machine can't check:
    on a machine without a GPU, bf16 for kernels that run under the interpreter (those that declare no CPU
    device), and both 16-bit types where ``half_on_cpu`` is False (slow there)."""
    declared = [d for d in caps.dtypes if d.is_floating_point]
    if ON_GPU:
        return declared
    interpreted = "cpu" not in caps.devices
    allowed = [torch.float32, torch.float64]
    if half_on_cpu:
        allowed += [torch.float16] if interpreted else [torch.float16, torch.bfloat16]
    return [d for d in declared if d in allowed]


def rel_err(out: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """||out - ref|| / max(||ref||, floor) in float64; a non-finite entry where ref is finite (or the
    reverse) counts as infinite error. ``floor`` keeps a reference that vanishes exactly (where only
    rounding noise is left to compare) from turning that noise into a huge relative error."""
    out = out.detach().to(torch.float64)
    ref = ref.detach().to(out.device, torch.float64)
    if out.shape != ref.shape:
        raise AssertionError(f"shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    if not torch.equal(torch.isfinite(out), torch.isfinite(ref)):
        return float("inf")
    mask = torch.isfinite(ref)
    diff = (out - ref)[mask].norm()
    scale = ref[mask].norm()
    scale = max(float(scale), floor)
    return float(diff / scale) if scale > 0 else float(diff)


def assert_close(out, ref, dtype=None, *, tol=None, name="output", floor=0.0):
    dtype = out.dtype if dtype is None else dtype
    tol = REL_TOL[dtype] if tol is None else tol
    err = rel_err(out, ref, floor)
    assert err <= tol, f"{name}: relative error {err:.3g} > {tol:.3g} ({dtype})"


def random_lengths(batch: int, max_len: int, *, include=(0, 1), generator=None) -> list[int]:
    """Random lengths in [0, max_len] that include the given special lengths where batch allows."""
    lengths = torch.randint(0, max_len + 1, (batch,), generator=generator).tolist()
    for i, special in enumerate(include):
        if i < batch and special <= max_len:
            lengths[i] = special
    return lengths


def random_jagged(lengths, inner=(), *, dtype=torch.float32, device=DEVICE, requires_grad=False,
                  offsets_dtype=torch.int32) -> varlen.JaggedTensor:
    parts = [torch.randn(n, *inner, dtype=dtype) for n in lengths]
    x = varlen.jagged(parts, device=device, offsets_dtype=offsets_dtype)
    if requires_grad:
        x.values.requires_grad_(True)
    return x


# Rows not 16 elements apart, as (columns, row stride, first column): 40 columns (rows 8 apart), 20 (4 apart), 40
# columns of rows 44 apart (4), 24 columns of rows 40 apart from 8 elements in (8). The jagged-op kernels load
# ROW_ALIGN elements of a row at once (varlen.tiling.row_align); a larger ROW_ALIGN than the rows allow would read the
# wrong rows.
ROW_LAYOUTS = [(40, 40, 0), (20, 20, 0), (40, 44, 0), (24, 40, 8)]


def strided_rows(n_rows, layout, dtype, device):
    """A ``(n_rows, columns)`` view of random values in a NaN-filled ``(n_rows, row stride)`` tensor (``layout``: one
    of ROW_LAYOUTS)."""
    n_cols, row_stride, first = layout
    big = torch.full((n_rows, row_stride), math.nan, dtype=dtype, device=device)
    big[:, first:first + n_cols] = torch.randn(n_rows, n_cols, dtype=dtype, device=device)
    return big[:, first:first + n_cols]


def _record(monkeypatch, module, name: str, entry) -> list:
    """``entry(args, result)`` of every call of ``module.<name>`` from now on (it keeps working), in a list."""
    calls = []
    function = getattr(module, name)

    def recorded(*args, **kwargs):
        result = function(*args, **kwargs)
        calls.append(entry(args, result))
        return result

    monkeypatch.setattr(module, name, recorded)
    return calls


def record_calls(monkeypatch, module, name: str) -> list:
    """The results of every call of ``module.<name>`` from now on (it keeps working), in a list."""
    return _record(monkeypatch, module, name, lambda args, result: result)


def record_args(monkeypatch, module, name: str) -> list:
    """The positional arguments of every call of ``module.<name>`` from now on (it keeps working), in a list."""
    return _record(monkeypatch, module, name, lambda args, result: args)


def rotary_reference(part: torch.Tensor, base: float) -> torch.Tensor:
    """One sequence ``(S, ..., D)`` rotated in float64, positions 0..S-1: the pair (x[i], x[i + D/2]) as the
    complex number x[i] + 1j x[i + D/2], times exp(1j * position * base ** (-2 i / D))."""
    part = part.double()
    half = part.shape[-1] // 2
    pos = torch.arange(part.shape[0], dtype=torch.float64, device=part.device)
    freq = torch.tensor([base ** (-2 * i / part.shape[-1]) for i in range(half)], dtype=torch.float64,
                        device=part.device)
    turn = torch.polar(torch.ones(part.shape[0], half, dtype=torch.float64, device=part.device),
                       pos[:, None] * freq[None, :])
    z = torch.complex(part[..., :half], part[..., half:]) * turn.view(part.shape[0], *(1,) * (part.dim() - 2), half)
    return torch.cat([z.real, z.imag], -1)


def check_jagged_op(x, out, dy, ref, dtype, leaves) -> None:
    """A jagged op's result ``out`` (from ``x``) against its float64 reference ``ref``, and, after the same backward
    of ``dy`` through both, each ``leaves`` pair's gradients (name: (tensor or None, its float64 copy))."""
    out.values.backward(dy)
    ref.backward(dy.double())
    assert out.offsets is x.offsets and out.values.shape == ref.shape and out.values.dtype == dtype
    assert_close(out.values, ref, dtype, name="out")
    for name, (leaf, leaf64) in leaves.items():
        if leaf is not None:
            assert_close(leaf.grad, leaf64.grad, dtype, name=f"d{name}")
