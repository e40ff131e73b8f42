"""varlen.linear, varlen.matmul, varlen.transposed_matmul against per-sequence float64 references."""

import math
from itertools import pairwise

import pytest
import torch

import varlen
from conftest import DEVICE, ON_GPU
from utils import REL_TOL, assert_close, checkable_dtypes, random_jagged, rel_err
from varlen._amp import float32_matmul_precision
from varlen.capabilities import JAGGED_KERNELS
from varlen.ops.linear import linear, matmul, transposed_matmul

LONG = 700 if ON_GPU else 150  # > 2 row tiles of 64: several tiles, and a partly filled last one
LENGTHS = {
    "mixed": [0, 1, 17, LONG, 5],
    "batch1": [17],
    "all-empty": [0, 0],
}
SIZES = [(1, 17), (40, 80), (96, 1)]  # (K, N): single columns, a partial second tile, a third K step
BACKENDS = ["torch", "triton"]


def _dtypes(backend):
    """The matmul family's declared dtypes (``JAGGED_KERNELS["matmul"]``), less what can't be checked here; the
    PyTorch path takes float64 too, which the Triton kernels don't (tensor-core dots)."""
    if backend == "triton":
        return checkable_dtypes(JAGGED_KERNELS["matmul"])
    return [*checkable_dtypes(JAGGED_KERNELS["matmul"], half_on_cpu=False), torch.float64]


def _id(dtype):
    return str(dtype).replace("torch.", "")


KERNEL_CASES = [
    pytest.param(backend, dtype, name, K, N, id=f"{backend}-{_id(dtype)}-{name}-K{K}-N{N}")
    for backend in BACKENDS for dtype in _dtypes(backend) for name in LENGTHS for K, N in SIZES
]


def _bounds(x: varlen.JaggedTensor):
    host = x.host_offsets().tolist()
    return list(pairwise(host))


def _leaf64(t):
    return t.detach().to(torch.float64).requires_grad_(True)


def _ref_grouped(x64, bounds, w64):
    return torch.cat([x64[s:e] @ w64[b] for b, (s, e) in enumerate(bounds)])


def _ref_transposed(x64, y64, bounds):
    return torch.stack([x64[s:e].T @ y64[s:e] for s, e in bounds])


# ----------------------------------------------------------------------- per-sequence matmul
@pytest.mark.parametrize("backend, dtype, lengths, K, N", KERNEL_CASES)
def test_matmul_per_sequence(backend, dtype, lengths, K, N, poison_empty):
    x = random_jagged(LENGTHS[lengths], (K,), dtype=dtype, requires_grad=True)
    w = torch.randn(x.batch_size, K, N, dtype=dtype, device=DEVICE, requires_grad=True)
    with varlen.use_backend(backend):
        out = matmul(x, w)
        dy = torch.randn_like(out.values)
        out.values.backward(dy)
    assert out.offsets is x.offsets and out.values.shape == (x.total, N) and out.dtype == dtype
    x64, w64 = _leaf64(x.values), _leaf64(w)
    ref = _ref_grouped(x64, _bounds(x), w64)
    ref.backward(dy.to(torch.float64))
    assert_close(out.values, ref, dtype, name="out")
    assert_close(x.values.grad, x64.grad, dtype, name="dx")
    assert_close(w.grad, w64.grad, dtype, name="dw")


@pytest.mark.parametrize("backend, dtype, lengths, K, N", KERNEL_CASES)
def test_transposed_matmul(backend, dtype, lengths, K, N, poison_empty):
    x = random_jagged(LENGTHS[lengths], (K,), dtype=dtype, requires_grad=True)
    y = x.with_values(torch.randn(x.total, N, dtype=dtype, device=DEVICE, requires_grad=True))
    with varlen.use_backend(backend):
        out = transposed_matmul(x, y)
        dout = torch.randn_like(out)
        out.backward(dout)
    assert out.shape == (x.batch_size, K, N) and out.dtype == dtype
    x64, y64 = _leaf64(x.values), _leaf64(y.values)
    ref = _ref_transposed(x64, y64, _bounds(x))
    ref.backward(dout.to(torch.float64))
    assert_close(out, ref, dtype, name="out")
    for b, (s, e) in enumerate(_bounds(x)):
        if s == e:
            assert torch.equal(out[b], torch.zeros_like(out[b])), "an empty sequence must give zeros"
    assert_close(x.values.grad, x64.grad, dtype, name="dx")
    assert_close(y.values.grad, y64.grad, dtype, name="dy")


def test_triton_refuses_what_it_does_not_declare(device):
    """float64 is not in the matmul kernels' declaration: asking for Triton says so; "auto" runs PyTorch."""
    x = random_jagged([3, 5], (4,), dtype=torch.float64)
    w = torch.randn(2, 4, 6, dtype=torch.float64, device=device)
    with pytest.raises(ValueError, match=r"backend='triton' can't take dtype float64 \(allowed: float16, bfloat16, "
                                         r"float32\)"):
        matmul(x, w, backend="triton")
    with varlen.use_backend("triton"), pytest.raises(ValueError, match="can't take dtype float64"):
        transposed_matmul(x, x)
    assert_close(matmul(x, w).values, torch.cat([x.values[:3] @ w[0], x.values[3:] @ w[1]]), name="auto")


@pytest.mark.parametrize("rows_per_chunk", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=_id)
def test_transposed_matmul_chunked_rows(rows_per_chunk, dtype, poison_empty):
    """Long sequences split over several programs (fp32 partials summed afterwards)."""
    from varlen.ops import _linear_kernels

    x = random_jagged([0, 1, 17, LONG, 130], (40,), dtype=dtype)
    y = random_jagged([0, 1, 17, LONG, 130], (80,), dtype=dtype)
    out = _linear_kernels.transposed_matmul(x.values, y.values, x.offsets, x.max_len,
                                            rows_per_chunk=rows_per_chunk)
    ref = _ref_transposed(x.values.double(), y.values.double(), _bounds(x))
    assert out.dtype == dtype
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs_with_nan_neighbours(backend):
    """Kernels follow strides and read nothing outside their operands (all neighbours are NaN)."""
    lengths, K, N = [3, 0, LONG, 17], 40, 17
    B, total = len(lengths), sum(lengths)
    x_store = torch.full((total, K + 5), math.nan, device=DEVICE)
    x_store[:, 2:K + 2] = torch.randn(total, K)
    x = varlen.jagged([torch.zeros(n, K) for n in lengths], device=DEVICE).with_values(x_store[:, 2:K + 2])
    w_store = torch.full((B, N + 3, K + 1), math.nan, device=DEVICE)
    w_store[:, :N, :K] = torch.randn(B, N, K)
    w = w_store[:, :N, :K].transpose(1, 2)  # (B, K, N), non-contiguous
    y_store = torch.full((total, 2 * N), math.nan, device=DEVICE)
    y_store[:, ::2] = torch.randn(total, N)
    y = x.with_values(y_store[:, ::2])
    with varlen.use_backend(backend):
        out = matmul(x, w)
        t_out = transposed_matmul(x, y)
    bounds = _bounds(x)
    assert_close(out.values, _ref_grouped(x.values.double(), bounds, w.double()), torch.float32)
    assert_close(t_out, _ref_transposed(x.values.double(), y.values.double(), bounds), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_int64_offsets_and_nested_inputs(backend):
    x = random_jagged([5, 0, 17], (17,), offsets_dtype=torch.int64)
    w = torch.randn(3, 17, 40, device=DEVICE)
    with varlen.use_backend(backend):
        out = matmul(x.to_nested(), w)
        t_out = transposed_matmul(x.to_nested(), out.to_nested())
    bounds = _bounds(x)
    ref = _ref_grouped(x.values.double(), bounds, w.double())
    assert_close(out.values, ref, torch.float32)
    assert_close(t_out, _ref_transposed(x.values.double(), ref, bounds), torch.float32)


def test_per_sequence_gradcheck():
    # float64 runs the PyTorch path on every device.
    x = random_jagged([2, 0, 1], (3,), dtype=torch.float64)
    w = torch.randn(3, 3, 2, dtype=torch.float64, device=DEVICE)
    y = torch.randn(x.total, 2, dtype=torch.float64, device=DEVICE)
    grouped = lambda v, w: matmul(x.with_values(v), w).values
    transposed = lambda a, b: transposed_matmul(x.with_values(a), x.with_values(b))
    for fn, inputs in [(grouped, (x.values, w)), (transposed, (x.values, y))]:
        inputs = tuple(t.detach().requires_grad_(True) for t in inputs)
        assert torch.autograd.gradcheck(fn, inputs)
        assert torch.autograd.gradgradcheck(fn, inputs)


@pytest.mark.gpu_only
def test_float32_full_precision_on_gpu():
    """With PyTorch's default (no TF32), float32 kernels on the GPU keep float32 accuracy (three-pass TF32), not
    TF32's."""
    with float32_matmul_precision("ieee"):
        x = random_jagged([300, 1000, 0, 7], (512,))
        w = torch.randn(4, 512, 256, device=DEVICE)
        with varlen.use_backend("triton"):
            out = matmul(x, w)
            t_out = transposed_matmul(x, out)
    bounds = _bounds(x)
    ref = _ref_grouped(x.values.double(), bounds, w.double())
    assert rel_err(out.values, ref) < 1e-5
    assert rel_err(t_out, _ref_transposed(x.values.double(), out.values.double(), bounds)) < 1e-5


@pytest.mark.gpu_only
def test_transposed_matmul_chunked_on_gpu():
    """A small batch with small K, N and a long sequence: the launcher splits rows across programs."""
    x = random_jagged([20000, 3], (64,), dtype=torch.bfloat16)
    y = random_jagged([20000, 3], (64,), dtype=torch.bfloat16)
    with varlen.use_backend("triton"):
        out = transposed_matmul(x, x.with_values(y.values))
    assert_close(out, _ref_transposed(x.values.double(), y.values.double(), _bounds(x)), torch.bfloat16)


# ----------------------------------------------------------------------------- dense weights
DENSE_DTYPES = [torch.float32, torch.float64] + ([torch.float16, torch.bfloat16] if ON_GPU else [])


@pytest.mark.parametrize("inner", [(), (3,)], ids=["BjK", "Bj3K"])
@pytest.mark.parametrize("K, N", SIZES, ids=[f"K{k}-N{n}" for k, n in SIZES])
@pytest.mark.parametrize("dtype", DENSE_DTYPES, ids=_id)
def test_matmul_dense_weight(dtype, K, N, inner):
    x = random_jagged(LENGTHS["mixed"], (*inner, K), dtype=dtype, requires_grad=True)
    w = torch.randn(K, N, dtype=dtype, device=DEVICE, requires_grad=True)
    out = matmul(x, w)
    dy = torch.randn_like(out.values)
    out.values.backward(dy)
    x64, w64 = _leaf64(x.values), _leaf64(w)
    ref = torch.cat([x64[s:e] @ w64 for s, e in _bounds(x)])
    ref.backward(dy.double())
    assert out.offsets is x.offsets and out.values.shape == (x.total, *inner, N)
    assert_close(out.values, ref, dtype, name="out")
    assert_close(x.values.grad, x64.grad, dtype, name="dx")
    assert_close(w.grad, w64.grad, dtype, name="dw")


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("inner", [(), (3,)], ids=["BjK", "Bj3K"])
@pytest.mark.parametrize("K, N", SIZES, ids=[f"K{k}-N{n}" for k, n in SIZES])
@pytest.mark.parametrize("dtype", DENSE_DTYPES, ids=_id)
def test_linear(dtype, K, N, inner, bias):
    x = random_jagged(LENGTHS["mixed"], (*inner, K), dtype=dtype, requires_grad=True)
    weight = torch.randn(N, K, dtype=dtype, device=DEVICE, requires_grad=True)
    b = torch.randn(N, dtype=dtype, device=DEVICE, requires_grad=True) if bias else None
    out = linear(x, weight, b)
    dy = torch.randn_like(out.values)
    out.values.backward(dy)
    x64, w64 = _leaf64(x.values), _leaf64(weight)
    b64 = _leaf64(b) if bias else None
    ref = torch.cat([x64[s:e] @ w64.T + (b64 if bias else 0) for s, e in _bounds(x)])
    ref.backward(dy.double())
    assert out.offsets is x.offsets and out.values.shape == (x.total, *inner, N)
    assert_close(out.values, ref, dtype, name="out")
    assert_close(x.values.grad, x64.grad, dtype, name="dx")
    assert_close(weight.grad, w64.grad, dtype, name="dweight")
    if bias:
        assert_close(b.grad, b64.grad, dtype, name="dbias")


def test_dense_gradcheck():
    x = random_jagged([2, 0, 3], (4,), dtype=torch.float64)
    w = torch.randn(4, 3, dtype=torch.float64, device=DEVICE)
    b = torch.randn(3, dtype=torch.float64, device=DEVICE)
    inputs = tuple(t.detach().requires_grad_(True) for t in (x.values, w, b))
    assert torch.autograd.gradcheck(lambda v, w, b: linear(x.with_values(v), w.T.contiguous(), b).values,
                                    inputs)
    assert torch.autograd.gradcheck(lambda v, w, b: matmul(x.with_values(v), w).values + b, inputs)


# ---------------------------------------------------------------------------------- bad input
def _x(inner=(4,), dtype=torch.float32):
    return random_jagged([2, 3], inner, dtype=dtype)


BAD_MATMUL = [
    pytest.param(lambda: matmul(_x().values, torch.randn(4, 3)), TypeError, "x: expected a varlen.JaggedTensor",
                 id="plain-x"),
    pytest.param(lambda: matmul(_x(), _x()), TypeError, "jagged w is not supported", id="jagged-w"),
    pytest.param(lambda: matmul(_x(), _x().to_nested()), TypeError, "supported cases", id="nested-w"),
    pytest.param(lambda: matmul(_x(), [[1.0]]), TypeError, "w: expected a dense torch.Tensor", id="list-w"),
    pytest.param(lambda: matmul(_x(), torch.randn(4, device=DEVICE)), ValueError, "expected 2 or 3 dims",
                 id="w-1d"),
    pytest.param(lambda: matmul(_x(), torch.randn(1, 2, 4, 3, device=DEVICE)), ValueError,
                 "expected 2 or 3 dims", id="w-4d"),
    pytest.param(lambda: matmul(_x(), torch.randn(5, 3, device=DEVICE)), ValueError, "x must be", id="dense-K"),
    pytest.param(lambda: matmul(_x(), torch.randn(3, 4, 5, device=DEVICE)), ValueError,
                 "need B = x's batch size 2", id="batch"),
    pytest.param(lambda: matmul(_x(), torch.randn(2, 5, 3, device=DEVICE)), ValueError, "x's K = 4",
                 id="per-seq-K"),
    pytest.param(lambda: matmul(_x((2, 4)), torch.randn(2, 4, 3, device=DEVICE)), ValueError,
                 "expected a jagged (B, j, K)", id="per-seq-x-4d"),
    pytest.param(lambda: matmul(_x(), torch.randn(2, 4, 3, device=DEVICE, dtype=torch.float64)), TypeError,
                 "differs from x.values", id="dtype"),
    pytest.param(lambda: matmul(_x(), torch.randn(2, 4, 3, device="meta")), ValueError, "w: on device meta",
                 id="device"),
    pytest.param(lambda: matmul(random_jagged([2], (4,)).to(torch.int64), torch.ones(4, 3, dtype=torch.int64,
                 device=DEVICE)), TypeError, "x.values: dtype int64 is not supported", id="int-dtype"),
]

BAD_TRANSPOSED = [
    pytest.param(lambda: transposed_matmul(_x().values, _x()), TypeError, "x: expected", id="plain-x"),
    pytest.param(lambda: transposed_matmul(_x(), _x().values), TypeError, "y: expected", id="plain-y"),
    pytest.param(lambda: transposed_matmul(_x(), random_jagged([3, 2], (4,))), ValueError, "y: lengths differ",
                 id="lengths"),
    pytest.param(lambda: transposed_matmul(_x(), random_jagged([2, 3, 1], (4,))), ValueError,
                 "y: batch size 3 differs", id="batch"),
    pytest.param(lambda: transposed_matmul(_x((2, 4)), _x()), ValueError, "x: expected a jagged (B, j, K)",
                 id="x-4d"),
    pytest.param(lambda: transposed_matmul(_x(), _x(dtype=torch.float64)), TypeError, "y.values: dtype",
                 id="dtype"),
]

BAD_LINEAR = [
    pytest.param(lambda: linear(_x().values, torch.randn(3, 4)), TypeError, "x: expected", id="plain-x"),
    pytest.param(lambda: linear(_x(()), torch.randn(3, 4, device=DEVICE)), ValueError, "at least one inner dim",
                 id="no-inner"),
    pytest.param(lambda: linear(_x(), torch.randn(4, device=DEVICE)), ValueError, "weight: expected 2 dims",
                 id="weight-1d"),
    pytest.param(lambda: linear(_x(), torch.randn(3, 5, device=DEVICE)), ValueError, "weight: expected shape (N, 4)",
                 id="weight-K"),
    pytest.param(lambda: linear(_x(), torch.randn(3, 4, device=DEVICE), torch.randn(4, device=DEVICE)),
                 ValueError, "bias: expected shape (3,)", id="bias-shape"),
    pytest.param(lambda: linear(_x(), torch.randn(3, 4, device=DEVICE, dtype=torch.float64)), TypeError,
                 "weight: dtype", id="dtype"),
    pytest.param(lambda: linear(_x(), torch.randn(3, 4, device=DEVICE), torch.randn(3, device="meta")),
                 ValueError, "bias: on device meta", id="device"),
    pytest.param(lambda: linear(_x(), "w"), TypeError, "weight: expected a torch.Tensor", id="weight-type"),
]


@pytest.mark.parametrize("call, error, message", BAD_MATMUL + BAD_TRANSPOSED + BAD_LINEAR)
def test_bad_input(call, error, message):
    with pytest.raises(error, match=__import__("re").escape(message)):
        call()


def test_fp16_reference_error_ratio():
    """The fp16 kernels are at most ~2x as far from float64 as PyTorch's own fp16 product on the
    same inputs, on top of the tolerance table."""
    x = random_jagged([0, 1, 17, LONG], (96,), dtype=torch.float16)
    w = torch.randn(4, 96, 80, dtype=torch.float16, device=DEVICE)
    bounds = _bounds(x)
    with varlen.use_backend("triton"):
        out = matmul(x, w)
    ref = _ref_grouped(x.values.double(), bounds, w.double())
    torch_fp16 = torch.cat([(x.values[s:e].float() @ w[b].float()).half() for b, (s, e) in enumerate(bounds)])
    assert rel_err(out.values, ref) <= 2 * rel_err(torch_fp16, ref) + 1e-6
    assert rel_err(out.values, ref) <= REL_TOL[torch.float16]
