"""Wrong metadata (offsets, cu_seqlens, max lengths): a clear error where it is checked, and never an
access outside the tensors where it is trusted.

Checked: always on the CPU, and on a GPU in the checking mode (``varlen.set_checks``). Trusted: on a GPU
outside it, which the tests reach on every device by building the jagged tensors with
``JaggedTensor._trusted`` (what an unchecked GPU call builds). There, each kernel (Triton, or the PyTorch
path) runs forward and backward with inputs that sit between NaN guards and outputs allocated between NaN
guards: a read past an input shows up as a NaN in the results (unwritten rows read 0 here), a write past
an output as a changed guard. The sequences the metadata still describes correctly must come out exact.
"""

import math
import os
import subprocess
import sys

import pytest
import torch

import varlen
from utils import assert_close
from varlen.flash_attn_interface import flash_attn_varlen_func
from varlen.jagged import JaggedTensor
from varlen.padding import padded_to_jagged

LENGTHS = [5, 17, 3]  # offsets [0, 5, 22, 25]
TOTAL, LONGEST = sum(LENGTHS), max(LENGTHS)
GUARD = 256  # elements of NaN on each side of every guarded buffer (keeps 16-byte alignment)

# name: (offsets, max_len, the sequences they still describe exactly)
BAD_METADATA = {
    "end_past_rows": ([0, 5, 22, 30], LONGEST, (0, 1)),
    "end_far_past_rows": ([0, 5, 2**30, 2**30 + 7], LONGEST, (0,)),
    "end_before_rows": ([0, 5, 22, 23], LONGEST, (0, 1)),
    "decreasing": ([0, 22, 5, 25], LONGEST, ()),
    "negative_start": ([-4, 5, 22, 25], LONGEST, (1, 2)),
    "max_too_small": ([0, 5, 22, 25], 10, (0, 2)),
}
BACKENDS = ["torch", "triton"]


@pytest.fixture
def checking(device):
    """The checking mode on GPUs (the CPU always checks)."""
    varlen.set_checks(device.type != "cpu")
    yield
    varlen.set_checks(False)


# ------------------------------------------------------------------------------------- clear errors
@pytest.mark.parametrize("case", BAD_METADATA)
def test_flash_attn_varlen_names_cu_seqlens_and_max_seqlen(case, device, checking):
    cu, max_len, _ = BAD_METADATA[case]
    q = torch.randn(TOTAL, 2, 8, device=device)
    cu = torch.tensor(cu, dtype=torch.int32, device=device)
    match = "max_seqlen_q: got 10, but sequence 1 has length 17" if case == "max_too_small" else "cu_seqlens_q: must"
    with pytest.raises(ValueError, match=match):
        flash_attn_varlen_func(q, q, q, cu, cu, max_len, max_len)
    good = torch.tensor([0, 5, 22, 25], dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="cu_seqlens_k: must|max_seqlen_k: got"):
        flash_attn_varlen_func(q, q, q, good, cu, LONGEST, max_len)


@pytest.mark.parametrize("case", BAD_METADATA)
def test_jagged_tensor_names_offsets_and_max_len(case, device, checking):
    offsets, max_len, _ = BAD_METADATA[case]
    with pytest.raises(ValueError, match="offsets: must|max_len: got 10, but sequence 1 has length 17"):
        JaggedTensor(torch.randn(TOTAL, 4, device=device), torch.tensor(offsets, device=device), max_len,
                     validate=False)


def test_a_larger_max_len_is_legal(device, checking):
    values, offsets = torch.randn(TOTAL, 4, device=device), torch.tensor([0, 5, 22, 25], device=device)
    x = JaggedTensor(values, offsets, 40, validate=False)
    assert x.max_len == 40
    assert_close(varlen.sum(x, 1), torch.stack([p.sum(0) for p in values.split(LENGTHS)]), name="sum")
    q = values.view(TOTAL, 1, 4)
    out = flash_attn_varlen_func(q, q, q, offsets.int(), offsets.int(), 40, 64)
    ref = torch.cat([varlen.attention_reference(p[None], p[None], p[None])[0][0] for p in q.split(LENGTHS)])
    assert_close(out, ref, name="attention")


@pytest.mark.parametrize("op", ["attention", "softmax", "sum", "sdpa"])
def test_nested_tensor_max_seqlen_hint_too_small(op, device, checking):
    values = torch.randn(TOTAL, 2, 8, device=device)
    nt = torch.nested.nested_tensor_from_jagged(values, torch.tensor([0, 5, 22, 25], device=device), max_seqlen=9)
    match = "nt's max_seqlen hint: got 9, but sequence 1 has length 17"
    with pytest.raises(ValueError, match=match):
        if op == "attention":
            varlen.attention(nt, nt, nt)
        elif op == "softmax":
            varlen.softmax(nt, 1)
        elif op == "sum":
            varlen.sum(nt, 1)
        else:
            t = nt.transpose(1, 2)
            varlen.scaled_dot_product_attention(t, t, t)


def test_from_padded_max_len_too_small(device, checking):
    padded = torch.randn(3, 20, 4, device=device)
    lengths = torch.tensor(LENGTHS, device=device)
    with pytest.raises(ValueError, match="max_len: got 10, but lengths\\[1\\] = 17"):
        JaggedTensor.from_padded(padded, lengths, max_len=10)
    with pytest.raises(ValueError, match="lengths: lengths\\[1\\] = -3 is outside \\[0, 20\\]"):
        JaggedTensor.from_padded(padded, torch.tensor([5, -3, 3], device=device), max_len=10)
    assert JaggedTensor.from_padded(padded, lengths, max_len=20).max_len == 20  # larger is legal


def test_checking_mode_switch_and_environment():
    assert varlen.checks_enabled() is False
    varlen.set_checks(True)
    try:
        assert varlen.checks_enabled() is True
    finally:
        varlen.set_checks(False)
    with pytest.raises(TypeError, match="enabled: expected a bool, got int 1"):
        varlen.set_checks(1)
    for value, expected in (("1", True), ("on", True), ("0", False), ("", False)):
        code = "import varlen; print(varlen.checks_enabled())"
        env = {**os.environ, "VARLEN_CHECKS": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == str(expected), (value, out.stderr)


@pytest.mark.gpu_only
def test_gpu_trusts_metadata_outside_the_checking_mode(device):
    """Outside the checking mode nothing is read on the host: the wrong offsets are not noticed."""
    values = torch.randn(TOTAL, 4, device=device)
    x = JaggedTensor(values, torch.tensor([0, 5, 22, 30], device=device), LONGEST, validate=False)
    assert x._host_offsets is None


# ---------------------------------------------------------------------------- no access out of bounds
@pytest.fixture
def guarded_outputs(monkeypatch):
    """``torch.empty``/``empty_like``/``new_empty`` hand out zeroed memory between NaN guards; returns the
    buffers, for :func:`_assert_guards_intact`."""
    buffers = []
    real_empty = torch.empty

    def guarded(shape, dtype, device):
        shape = torch.Size(shape[0] if len(shape) == 1 and not isinstance(shape[0], int) else shape)
        flat = real_empty(shape.numel() + 2 * GUARD, dtype=dtype, device=device)
        flat.fill_(math.nan if flat.is_floating_point() else (True if dtype == torch.bool else -7))
        buffers.append(flat)
        return flat[GUARD:GUARD + shape.numel()].view(shape).zero_()

    def empty(*shape, dtype=None, device=None, **kwargs):
        return guarded(shape, dtype or torch.get_default_dtype(), device or "cpu")

    def empty_like(t, *, dtype=None, device=None, **kwargs):
        return guarded(t.shape, dtype or t.dtype, device or t.device)

    def new_empty(self, *shape, dtype=None, device=None, **kwargs):
        return guarded(shape, dtype or self.dtype, device or self.device)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", empty_like)
    monkeypatch.setattr(torch.Tensor, "new_empty", new_empty)
    yield buffers


def _assert_guards_intact(buffers):
    for flat in buffers:
        for guard in (flat[:GUARD], flat[-GUARD:]):
            intact = guard.isnan().all() if guard.is_floating_point() else (guard == guard[0]).all()
            assert bool(intact), "a kernel wrote outside an output tensor"


def _assert_finite(name, t):
    assert bool(torch.isfinite(t).all()), f"{name}: non-finite values: a kernel read outside its inputs"


def _run_and_check(fn, inputs, good, reference, buffers):
    """Forward and backward of ``fn``: everything finite, guards intact, ``good`` sequences exact."""
    out = fn(*inputs)
    out_values = out.values if isinstance(out, JaggedTensor) else out
    _assert_finite("out", out_values)
    grads = torch.autograd.grad(out_values, [t for t in inputs if t.requires_grad], torch.ones_like(out_values))
    for g in grads:
        _assert_finite("grad", g)
    _assert_guards_intact(buffers)
    for b in good:
        torch.testing.assert_close(reference(b, out_values), reference(b, None),
                                   msg=lambda m, b=b: f"sequence {b}: {m}")


def _trusted(values, case, device):
    offsets, max_len, _ = BAD_METADATA[case]
    return JaggedTensor._trusted(values, torch.tensor(offsets, dtype=torch.int32, device=device), max_len)


def _leaf(shape, device, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Random values in the middle of a NaN-filled buffer: (the buffer, a leaf that requires grad; the values'
    view of it, taken before, outside the graph). The ops read the same view, taken again from the leaf."""
    values = torch.randn(shape, dtype=dtype, device=device)
    flat = torch.full((values.numel() + 2 * GUARD,), math.nan, dtype=dtype, device=device)
    view = flat[GUARD:GUARD + values.numel()].view(shape)
    view.copy_(values)
    return flat.requires_grad_(True), view


START = [0, 5, 22]


@pytest.mark.parametrize("case", BAD_METADATA)
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_stays_in_bounds(case, backend, device, guarded_outputs):
    leaf, q = _leaf((TOTAL, 2, 8), device)

    def fn(leaf):
        x = _trusted(leaf[GUARD:GUARD + q.numel()].view(q.shape), case, device)
        return varlen.attention(x, x, x, causal=True, backend=backend)

    def reference(b, out):
        part = q.detach()[START[b]:START[b] + LENGTHS[b]]
        if out is not None:
            return out[START[b]:START[b] + LENGTHS[b]]
        return varlen.attention_reference(part[None], part[None], part[None], causal=True)[0][0]

    _run_and_check(fn, [leaf], BAD_METADATA[case][2], reference, guarded_outputs)


@pytest.mark.parametrize("case", BAD_METADATA)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["softmax", "sum", "to_padded", "select", "matmul", "transposed_matmul"])
def test_jagged_ops_stay_in_bounds(case, backend, op, device, guarded_outputs):
    leaf, values = _leaf((TOTAL, 4), device)
    weights = torch.randn(3, 4, 6, device=device)

    def fn(leaf):
        x = _trusted(leaf[GUARD:GUARD + values.numel()].view(values.shape), case, device)
        with varlen.use_backend(backend):
            if op == "softmax":
                return varlen.softmax(x, 1)
            if op == "sum":
                return varlen.sum(x, 1)
            if op == "to_padded":
                return x.to_padded()
            if op == "select":
                return varlen.select(x, 1, -1, fill_value=0.0)
            if op == "matmul":
                return varlen.matmul(x, weights)
            return varlen.transposed_matmul(x, x)

    def per_sequence(b, part):
        if op == "softmax":
            return torch.softmax(part, 0)
        if op == "sum":
            return part.sum(0)
        if op == "to_padded":
            return part
        if op == "select":
            return part[-1]
        if op == "matmul":
            return part @ weights[b]
        return part.T @ part

    def reference(b, out):
        rows = slice(START[b], START[b] + LENGTHS[b])
        if out is None:
            return per_sequence(b, values.detach()[rows])
        if op in ("softmax", "matmul"):
            return out[rows]
        return out[b, :LENGTHS[b]] if op == "to_padded" else out[b]

    _run_and_check(fn, [leaf], BAD_METADATA[case][2], reference, guarded_outputs)


@pytest.mark.parametrize("case", BAD_METADATA)
@pytest.mark.parametrize("backend", BACKENDS)
def test_from_padded_stays_in_bounds(case, backend, device, guarded_outputs):
    """The lengths of ``from_padded`` become offsets the copy trusts (with ``max_len`` given, on a GPU)."""
    offsets, max_len, good = BAD_METADATA[case]
    leaf, padded = _leaf((3, LONGEST, 4), device)
    total = min(offsets[-1], 40)  # the row count the host takes from the offsets

    def fn(leaf):
        with varlen.use_backend(backend):
            p = leaf[GUARD:GUARD + padded.numel()].view(padded.shape)
            return padded_to_jagged(p, torch.tensor(offsets, dtype=torch.int32, device=device), total, max_len)

    def reference(b, out):
        if out is None:
            return padded.detach()[b, :LENGTHS[b]]
        return out[START[b]:START[b] + LENGTHS[b]]

    _run_and_check(fn, [leaf], [b for b in good if offsets[b + 1] <= total], reference, guarded_outputs)
