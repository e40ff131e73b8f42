"""varlen.swiglu against a float64 reference: silu(gate) * up from the halves of the last dim."""

import importlib
import re

import pytest
import torch

import varlen
from conftest import DEVICE, ON_GPU
from utils import assert_close, check_jagged_op, random_jagged, rel_err, strided_rows
from varlen.ops.swiglu import silu_mul, swiglu_values

LENGTHS = {"mixed": [0, 1, 17, 1000 if ON_GPU else 60, 4], "batch1": [1]}
DTYPES = [torch.float32, torch.float64, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
# Last dims: a width under one tile, odd halves (17), head-sized ones (80, 96 features per half) with more inner dims.
INNER = [(8,), (34,), (2, 160), (1, 192), (3000,)]
BACKENDS = ["torch", "triton"]


def reference(values: torch.Tensor) -> torch.Tensor:
    gate, up = values.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inner", INNER, ids=str)
@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_backward(dtype, lengths, inner, backend):
    x = random_jagged(LENGTHS[lengths], inner, dtype=dtype, requires_grad=True)
    out = varlen.swiglu(x, backend=backend)
    x64 = x.values.detach().double().requires_grad_(True)
    check_jagged_op(x, out, torch.randn_like(out.values), reference(x64), dtype, {"x": (x.values, x64)})


@pytest.mark.skipif(not ON_GPU, reason="bf16 and fp16 kernels checked against torch's own rounding on the GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_kernels_err_no_more_than_torch(dtype):
    """flash-attn's rule: the fused kernels' error against float64 at most twice torch's ops' at the same precision
    (the kernels round once; torch rounds silu(gate), the product and each gradient half)."""
    x = random_jagged([700, 3, 1300], (2, 688), dtype=dtype, requires_grad=True)
    dy = torch.randn(x.values.shape[:-1] + (344,), dtype=dtype, device=DEVICE)
    results = {}
    for backend in BACKENDS:
        x.values.grad = None
        out = varlen.swiglu(x, backend=backend).values
        out.backward(dy)
        results[backend] = out, x.values.grad
    x64 = x.values.detach().double().requires_grad_(True)
    ref = reference(x64)
    ref.backward(dy.double())
    for i, want in enumerate((ref, x64.grad)):
        ours, torchs = rel_err(results["triton"][i], want), rel_err(results["torch"][i], want)
        assert ours <= 2 * torchs, f"{'out' if i == 0 else 'dx'}: {ours:.3g} against torch's {torchs:.3g}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck(backend):
    x = random_jagged([2, 0, 3], (2, 6), dtype=torch.float64)
    values = x.values.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda v: varlen.swiglu(x.with_values(v), backend=backend).values, (values,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_any_gradient_layout_and_no_rows(backend):
    # .sum()'s gradient is expanded (every stride 0); a transposed one has a last-dim stride other than 1.
    x = random_jagged([3, 0, 4], (2, 8), dtype=torch.float64, requires_grad=True)
    x64 = x.values.detach().clone().requires_grad_(True)
    varlen.swiglu(x, backend=backend).values.sum().backward()
    reference(x64).sum().backward()
    assert_close(x.values.grad, x64.grad)
    g = torch.randn(4, 2, 7, dtype=torch.float64, device=DEVICE).transpose(0, 2)
    x.values.grad = x64.grad = None
    varlen.swiglu(x, backend=backend).values.backward(g)
    reference(x64).backward(g)
    assert_close(x.values.grad, x64.grad)
    # 2-D values: the transposed gradient reaches the kernel as it is (no view's copy in between)
    flat = random_jagged([3, 0, 4], (8,), dtype=torch.float64, requires_grad=True)
    flat64 = flat.values.detach().clone().requires_grad_(True)
    g = torch.randn(4, 7, dtype=torch.float64, device=DEVICE).t()
    varlen.swiglu(flat, backend=backend).values.backward(g)
    reference(flat64).backward(g)
    assert_close(flat.values.grad, flat64.grad)
    for inner in [(2, 8), (0,)]:  # no rows; no features
        empty = random_jagged([0, 0], inner, requires_grad=True)
        out = varlen.swiglu(empty, backend=backend)
        assert out.values.shape == (0, *inner[:-1], inner[-1] // 2)
        out.values.sum().backward()
        assert empty.values.grad.shape == empty.values.shape


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_of_a_wider_projection(backend):
    # The gate and up halves as a view of a larger projection: rows further apart than 2F.
    projection = torch.randn(21, 40, device=DEVICE)
    x = varlen.JaggedTensor(projection[:, 4:28], torch.tensor([0, 5, 21], device=DEVICE), 16)
    got = varlen.swiglu(x, backend=backend).values
    assert torch.equal(got, varlen.swiglu(x.with_values(x.values.contiguous()), backend=backend).values)
    assert_close(got, reference(x.values))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_of_two_projections(dtype, backend):
    # gate and up as views of two wider projections (rows 40 apart), leading dims (3, 7)
    gate = torch.randn(3, 7, 40, dtype=dtype, device=DEVICE)[..., 3:20]
    up = torch.randn(3, 7, 40, dtype=dtype, device=DEVICE)[..., 11:28]
    gate.requires_grad_(True)
    up.requires_grad_(True)
    out = silu_mul(gate, up, backend=backend)
    dy = torch.randn_like(out)
    out.backward(dy)
    g64, u64 = (t.detach().double().requires_grad_(True) for t in (gate, up))
    ref = reference(torch.cat([g64, u64], dim=-1))
    ref.backward(dy.double())
    assert out.shape == gate.shape and out.dtype == dtype
    assert_close(out, ref, dtype, name="out")
    assert_close(gate.grad, g64.grad, dtype, name="d gate")
    assert_close(up.grad, u64.grad, dtype, name="d up")


@pytest.mark.parametrize("layout", [(80, 84, 0), (48, 56, 8), (40, 40, 0)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float64] + ([torch.float32, torch.bfloat16] if ON_GPU else []), ids=str)
def test_rows_not_16_apart(layout, dtype):
    """(N, 2F) rows not 16 elements apart, as (columns, row stride, first column): halves of 40 columns 84 apart, of 24
    columns 56 apart, of 20 columns (the kernels load ROW_ALIGN elements at once), and a gradient 44 apart."""
    x = strided_rows(300, layout, dtype, DEVICE).requires_grad_(True)
    g = strided_rows(300, (layout[0] // 2, layout[0] // 2 + 4, 0), dtype, DEVICE)
    out = swiglu_values(x, backend="triton")
    out.backward(g)
    x64 = x.detach().double().requires_grad_(True)
    ref = reference(x64)
    ref.backward(g.double())
    assert_close(out, ref, dtype, name="out")
    assert_close(x.grad, x64.grad, dtype, name="dx")


@pytest.mark.parametrize("backend", BACKENDS)
def test_silu_mul_transposed_gradient(backend):
    # a gradient that reaches the kernel transposed (last stride N): gradients written by rows all the same
    gate, up = (torch.randn(6, 9, dtype=torch.float64, device=DEVICE, requires_grad=True) for _ in range(2))
    w = torch.randn(9, 6, dtype=torch.float64, device=DEVICE)
    (silu_mul(gate, up, backend=backend).t() * w).sum().backward()
    g64, u64 = (t.detach().clone().requires_grad_(True) for t in (gate, up))
    (reference(torch.cat([g64, u64], dim=-1)).t() * w).sum().backward()
    assert_close(gate.grad, g64.grad, name="d gate")
    assert_close(up.grad, u64.grad, name="d up")
    assert gate.grad.is_contiguous()


def test_double_backward_raises():
    """A gradient penalty through the kernels raises (the torch backend differentiates twice)."""
    x = random_jagged([3, 4], (6,), dtype=torch.float64, requires_grad=True)
    gate, up = (torch.randn(4, 3, dtype=torch.float64, device=DEVICE, requires_grad=True) for _ in range(2))
    for out, inputs in [(varlen.swiglu(x, backend="triton").values, (x.values,)),
                        (silu_mul(gate, up, backend="triton"), (gate, up))]:
        grads = torch.autograd.grad(out.sum(), inputs, create_graph=True)
        with pytest.raises(NotImplementedError, match="the Triton path has no double backward"):
            sum((g * i).sum() for g, i in zip(grads, inputs, strict=True)).backward()
    (g,) = torch.autograd.grad(varlen.swiglu(x, backend="torch").values.sum(), x.values, create_graph=True)
    (g * x.values).sum().backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_silu_mul_gradcheck(backend):
    gate, up = (torch.randn(5, 6, dtype=torch.float64, device=DEVICE, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(lambda a, b: silu_mul(a, b, backend=backend), (gate, up))


def test_silu_mul_and_swiglu_values_bad_input():
    with pytest.raises(TypeError, match="gate: expected a tensor of at least one dim, got a 0-dim tensor"):
        silu_mul(torch.tensor(1.0), torch.tensor(2.0))
    with pytest.raises(TypeError, match="up: expected a tensor of at least one dim, got list"):
        silu_mul(torch.ones(3), [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=re.escape("x: SwiGLU splits the last dim into a gate and an input of equal "
                                                   "widths, so it must be even; got shape (4, 5)")):
        swiglu_values(torch.randn(4, 5, device=DEVICE))
    gate = torch.randn(5, 6, device=DEVICE)
    with pytest.raises(ValueError, match=re.escape("up: expected gate's shape, dtype and device (5, 6)")):
        silu_mul(gate, torch.randn(5, 7, device=DEVICE))
    with pytest.raises(ValueError, match="up: expected gate's shape, dtype and device"):
        silu_mul(gate, gate.double())


def test_nn_swiglu_layer_runs_the_op(monkeypatch):
    """varlen.nn's activation="swiglu" is this op, on jagged and dense inputs alike."""
    module = importlib.import_module("varlen.ops.swiglu")  # the module, not varlen.ops.swiglu the function
    calls = []
    real = module._SwiGLU.apply
    monkeypatch.setattr(module._SwiGLU, "apply", lambda *a: calls.append(1) or real(*a))
    layer = varlen.nn.TransformerEncoderLayer(8, 2, 12, 0.0, activation="swiglu", device=DEVICE)
    x = random_jagged([3, 5], (8,))
    with varlen.use_backend("triton"):
        jagged = layer(x)
        dense = layer(x.to_padded()[:1, :3])
    assert len(calls) == 2
    assert_close(dense[0], jagged.values[:3])


def test_nested_input():
    x = random_jagged([3, 0, 5], (6,))
    assert torch.equal(varlen.swiglu(x.to_nested()).values, varlen.swiglu(x).values)


@pytest.mark.parametrize("call, error, message", [
    pytest.param(lambda: varlen.swiglu(random_jagged([2, 3], (8,)).values), TypeError,
                 "x: expected a varlen.JaggedTensor", id="dense"),
    pytest.param(lambda: varlen.swiglu(random_jagged([2, 3], (2, 7))), ValueError,
                 "x: SwiGLU splits the last dim into a gate and an input of equal widths, so it must be even; got "
                 "inner shape (2, 7)", id="odd"),
    pytest.param(lambda: varlen.swiglu(random_jagged([2, 3], ())), ValueError, "got inner shape ()", id="no-inner"),
    pytest.param(lambda: varlen.swiglu(random_jagged([2, 3], (8,)).to(torch.int64)), TypeError, "x.values",
                 id="int"),
    pytest.param(lambda: varlen.swiglu(random_jagged([2, 3], (8,)), backend="cuda"), ValueError, "backend",
                 id="backend"),
])
def test_bad_input(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()
