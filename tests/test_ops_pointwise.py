"""varlen.gelu/relu/silu/threshold against per-sequence float64 references."""

import re
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F

import varlen
from conftest import ON_GPU
from utils import assert_close, random_jagged
from varlen.ops.pointwise import gelu, relu, silu, threshold

LENGTHS = {"mixed": [0, 1, 17, 300 if ON_GPU else 60, 4], "batch1": [1]}
DTYPES = [torch.float32, torch.float64] + ([torch.float16, torch.bfloat16] if ON_GPU else [])

# (id, varlen op, the same op on one dense sequence)
OPS = [
    ("gelu", lambda x: gelu(x), lambda t: F.gelu(t)),
    ("gelu-tanh", lambda x: gelu(x, approximate="tanh"), lambda t: F.gelu(t, approximate="tanh")),
    ("relu", relu, F.relu),
    ("silu", silu, F.silu),
    ("threshold", lambda x: threshold(x, 0.25, -2.0), lambda t: F.threshold(t, 0.25, -2.0)),
]


def _id(dtype):
    return str(dtype).replace("torch.", "")


@pytest.mark.parametrize("inner", [(17,), (3, 40)], ids=["Bj17", "Bj3x40"])
@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=_id)
@pytest.mark.parametrize("name, op, ref_op", OPS, ids=[o[0] for o in OPS])
def test_forward_backward(name, op, ref_op, dtype, lengths, inner):
    # One implementation serves every backend (PyTorch's fused kernels on the flat values).
    x = random_jagged(LENGTHS[lengths], inner, dtype=dtype, requires_grad=True)
    out = op(x)
    dy = torch.randn_like(out.values)
    out.values.backward(dy)
    host = x.host_offsets().tolist()
    x64 = x.values.detach().double().requires_grad_(True)
    ref = torch.cat([ref_op(x64[s:e]) for s, e in pairwise(host)])
    ref.backward(dy.double())
    assert isinstance(out, varlen.JaggedTensor) and out.offsets is x.offsets and out.max_len == x.max_len
    assert out.values.shape == x.values.shape and out.dtype == dtype
    assert_close(out.values, ref, dtype, name="out")
    assert_close(x.values.grad, x64.grad, dtype, name="dx")


@pytest.mark.parametrize("name, op, ref_op", OPS, ids=[o[0] for o in OPS])
def test_gradcheck(name, op, ref_op):
    # Random normal values lie within gradcheck's eps (1e-6) of relu's or threshold's kink with
    # negligible probability, and the seed is fixed per test.
    x = random_jagged([2, 0, 3], (5,), dtype=torch.float64)
    values = x.values.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda v: op(x.with_values(v)).values, (values,))


def test_nested_input():
    x = random_jagged([3, 0, 5], (4,))
    out = gelu(x.to_nested())
    assert isinstance(out, varlen.JaggedTensor)
    assert torch.equal(out.values, F.gelu(x.values))


BAD = [
    pytest.param(lambda x: gelu(x, approximate="erf"), ValueError, "approximate: got 'erf'; allowed: 'none', 'tanh'",
                 id="gelu-approximate"),
    pytest.param(lambda x: gelu(x.values), TypeError, "x: expected a varlen.JaggedTensor", id="gelu-plain"),
    pytest.param(lambda x: relu(x.values), TypeError, "x: expected a varlen.JaggedTensor", id="relu-plain"),
    pytest.param(lambda x: silu([x.values]), TypeError, "x: expected a varlen.JaggedTensor", id="silu-list"),
    pytest.param(lambda x: threshold(x.values, 0.0, 0.0), TypeError, "x: expected", id="threshold-plain"),
    pytest.param(lambda x: threshold(x, "0", 0.0), TypeError, "threshold: expected a real number",
                 id="threshold-type"),
    pytest.param(lambda x: threshold(x, 0.0, torch.tensor(1.0)), TypeError, "value: expected a real number",
                 id="value-type"),
    pytest.param(lambda x: relu(x.to(torch.int32)), TypeError, "x.values: dtype int32 is not supported",
                 id="int-dtype"),
]


@pytest.mark.parametrize("call, error, message", BAD)
def test_bad_input(call, error, message):
    x = random_jagged([2, 3], (4,))
    with pytest.raises(error, match=re.escape(message)):
        call(x)
