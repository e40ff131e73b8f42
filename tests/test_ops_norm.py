"""varlen.layer_norm and varlen.rms_norm against per-sequence float64 references."""

import re
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F

import varlen
from conftest import DEVICE, ON_GPU
from utils import check_jagged_op, random_jagged
from varlen.ops.norm import layer_norm, rms_norm

LENGTHS = {"mixed": [0, 1, 17, 300 if ON_GPU else 60, 4], "batch1": [1]}
DTYPES = [torch.float32, torch.float64] + ([torch.float16, torch.bfloat16] if ON_GPU else [])


def _id(dtype):
    return str(dtype).replace("torch.", "")


# (inner shape of x, normalized_shape)
SHAPES = [((1,), 1), ((17,), (17,)), ((96,), [96]), ((3, 40), (40,)), ((3, 40), (3, 40))]


def _affine(shape, dtype, on):
    if not on:
        return None
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return (1 + 0.5 * torch.randn(shape, dtype=dtype, device=DEVICE)).requires_grad_(True)


# Normalizing a single element gives x_hat = 0: weight's gradient is 0 and both sides hold only
# rounding noise (float64 ~1e-13, float32 ~1e-5), so that pair isn't compared.
CASES = [
    pytest.param(dtype, lengths, inner, normalized_shape, affine,
                 id=f"{_id(dtype)}-{lengths}-{inner}-{normalized_shape}-{affine}")
    for dtype in DTYPES for lengths in LENGTHS for inner, normalized_shape in SHAPES
    for affine in ["weight+bias", "weight", "none"]
    if not (normalized_shape == 1 and affine != "none")
]


@pytest.mark.parametrize("dtype, lengths, inner, normalized_shape, affine", CASES)
def test_forward_backward(dtype, lengths, inner, normalized_shape, affine):
    # One implementation serves every backend (PyTorch's fused layer norm on the flat values).
    x = random_jagged(LENGTHS[lengths], inner, dtype=dtype, requires_grad=True)
    weight = _affine(normalized_shape, dtype, affine != "none")
    bias = _affine(normalized_shape, dtype, affine == "weight+bias")
    out = layer_norm(x, normalized_shape, weight, bias, eps=1e-5)
    dy = torch.randn_like(out.values)

    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    leaf = lambda t: None if t is None else t.detach().double().requires_grad_(True)
    x64, w64, b64 = leaf(x.values), leaf(weight), leaf(bias)
    host = x.host_offsets().tolist()
    ref = torch.cat([F.layer_norm(x64[s:e], shape, w64, b64, 1e-5) for s, e in pairwise(host)])
    check_jagged_op(x, out, dy, ref, dtype, {"x": (x.values, x64), "weight": (weight, w64),
                                                       "bias": (bias, b64)})


RMS_CASES = [
    pytest.param(dtype, lengths, inner, normalized_shape, affine, eps,
                 id=f"{_id(dtype)}-{lengths}-{inner}-{normalized_shape}-{affine}-eps{eps}")
    for dtype in DTYPES for lengths in LENGTHS for inner, normalized_shape in SHAPES
    for affine in ["weight", "none"] for eps in [None, 1e-5]
    if normalized_shape != 1  # one element: y = x / sqrt(x^2 + eps) ~ sign(x), its dx pure cancellation noise
]


@pytest.mark.parametrize("dtype, lengths, inner, normalized_shape, affine, eps", RMS_CASES)
def test_rms_norm_forward_backward(dtype, lengths, inner, normalized_shape, affine, eps):
    x = random_jagged(LENGTHS[lengths], inner, dtype=dtype, requires_grad=True)
    weight = _affine(normalized_shape, dtype, affine == "weight")
    out = rms_norm(x, normalized_shape, weight, eps)
    dy = torch.randn_like(out.values)

    dims = tuple(range(-(1 if isinstance(normalized_shape, int) else len(normalized_shape)), 0))
    x64 = x.values.detach().double().requires_grad_(True)
    w64 = None if weight is None else weight.detach().double().requires_grad_(True)
    eps64 = torch.finfo(dtype).eps if eps is None else eps  # torch's default: the input dtype's epsilon
    ref = x64 / (x64.square().mean(dims, keepdim=True) + eps64).sqrt()
    ref = ref if w64 is None else ref * w64
    check_jagged_op(x, out, dy, ref, dtype, {"x": (x.values, x64), "weight": (weight, w64)})


def test_rms_norm_gradcheck_and_nested_input():
    x = random_jagged([2, 0, 3], (2, 3), dtype=torch.float64)
    w = torch.randn(3, dtype=torch.float64, device=DEVICE)
    inputs = tuple(t.detach().clone().requires_grad_(True) for t in (x.values, w))
    assert torch.autograd.gradcheck(lambda v, w: rms_norm(x.with_values(v), 3, w, 1e-6).values, inputs)
    assert torch.equal(rms_norm(x.to_nested(), 3, w).values, F.rms_norm(x.values, (3,), w))


def test_gradcheck():
    x = random_jagged([2, 0, 3], (2, 3), dtype=torch.float64)
    w = torch.randn(3, dtype=torch.float64, device=DEVICE)
    b = torch.randn(3, dtype=torch.float64, device=DEVICE)
    inputs = tuple(t.detach().clone().requires_grad_(True) for t in (x.values, w, b))
    assert torch.autograd.gradcheck(lambda v, w, b: layer_norm(x.with_values(v), 3, w, b).values, inputs)


def test_nested_input():
    x = random_jagged([3, 0, 5], (8,))
    out = layer_norm(x.to_nested(), 8)
    assert isinstance(out, varlen.JaggedTensor)
    assert torch.equal(out.values, F.layer_norm(x.values, (8,)))


def _x(inner=(3, 4)):
    return random_jagged([2, 3], inner)


BAD = [
    pytest.param(lambda: layer_norm(_x().values, 4), TypeError, "x: expected a varlen.JaggedTensor", id="plain-x"),
    pytest.param(lambda: layer_norm(_x(), (5, 3, 4)), ValueError, "normalizing over the ragged dim j is not",
                 id="ragged-dim"),
    pytest.param(lambda: layer_norm(_x(()), 1), ValueError, "normalizing over the ragged dim", id="no-inner"),
    pytest.param(lambda: layer_norm(_x(), 3), ValueError, "(3,) must equal the last dims of x's inner shape (3, 4)",
                 id="not-suffix"),
    pytest.param(lambda: layer_norm(_x(), ()), ValueError, "normalized_shape: expected at least one dim",
                 id="empty-shape"),
    pytest.param(lambda: layer_norm(_x(), 4.0), TypeError, "normalized_shape: expected an int or a sequence",
                 id="shape-type"),
    pytest.param(lambda: layer_norm(_x(), 4, torch.ones(3, device=DEVICE)), ValueError,
                 "weight: expected shape (4,) (normalized_shape), got (3,)", id="weight-shape"),
    pytest.param(lambda: layer_norm(_x(), 4, None, torch.ones(4, 1, device=DEVICE)), ValueError,
                 "bias: expected shape (4,)", id="bias-shape"),
    pytest.param(lambda: layer_norm(_x(), 4, torch.ones(4, dtype=torch.float64, device=DEVICE)), TypeError,
                 "weight: dtype torch.float64 differs", id="weight-dtype"),
    pytest.param(lambda: layer_norm(_x(), 4, None, torch.ones(4, device="meta")), ValueError,
                 "bias: on device meta", id="bias-device"),
    pytest.param(lambda: layer_norm(_x(), 4, [1.0] * 4), TypeError, "weight: expected a torch.Tensor",
                 id="weight-type"),
    pytest.param(lambda: layer_norm(_x(), 4, eps=-1.0), ValueError, "eps: got -1.0; must be >= 0", id="eps"),
    pytest.param(lambda: layer_norm(_x(), 4, eps="1e-5"), TypeError, "eps: expected a real number",
                 id="eps-type"),
    pytest.param(lambda: layer_norm(_x().to(torch.int64), 4), TypeError, "x.values: dtype int64",
                 id="int-dtype"),
]


BAD += [
    pytest.param(lambda: rms_norm(_x().values, 4), TypeError, "x: expected a varlen.JaggedTensor", id="rms-plain-x"),
    pytest.param(lambda: rms_norm(_x(), 3), ValueError, "(3,) must equal the last dims", id="rms-not-suffix"),
    pytest.param(lambda: rms_norm(_x(), 4, torch.ones(3, device=DEVICE)), ValueError,
                 "weight: expected shape (4,) (normalized_shape), got (3,)", id="rms-weight-shape"),
    pytest.param(lambda: rms_norm(_x(), 4, eps=-1.0), ValueError, "eps: got -1.0; must be >= 0", id="rms-eps"),
    pytest.param(lambda: rms_norm(_x(), 4, eps="1e-5"), TypeError, "eps: expected a real number", id="rms-eps-type"),
]


@pytest.mark.parametrize("call, error, message", BAD)
def test_bad_input(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()
