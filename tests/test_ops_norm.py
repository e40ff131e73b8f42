"""varlen.layer_norm and varlen.rms_norm (both backends) against per-sequence float64 references."""

import re
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F

import varlen
from conftest import DEVICE, ON_GPU
from utils import ROW_LAYOUTS, assert_close, check_jagged_op, random_jagged, rel_err, strided_rows
from varlen.ops import _norm_kernels
from varlen.ops.norm import layer_norm, normalize, rms_norm

LENGTHS = {"mixed": [0, 1, 17, 300 if ON_GPU else 60, 4], "batch1": [1]}
DTYPES = [torch.float32, torch.float64] + ([torch.float16, torch.bfloat16] if ON_GPU else [])
BACKENDS = ["torch", "triton"]


def _id(dtype):
    return str(dtype).replace("torch.", "")


# (inner shape of x, normalized_shape)
SHAPES = [((1,), 1), ((17,), (17,)), ((96,), [96]), ((3, 40), (40,)), ((3, 40), (3, 40))]


def _affine(shape, dtype, on):
    if not on:
        return None
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return (1 + 0.5 * torch.randn(shape, dtype=dtype, device=DEVICE)).requires_grad_(True)


def _rms_norm64(x, w, eps, dims=(-1,)):
    """RMS norm over ``dims`` in float64, from its definition."""
    x = x.double()
    out = x / (x.square().mean(dims, keepdim=True) + eps).sqrt()
    return out if w is None else out * w.double()


def _layer_norm64(x, w, b, eps=1e-5):
    """Layer norm of the last dim in float64, from its definition."""
    x = x.double()
    out = (x - x.mean(-1, keepdim=True)) / (x.var(-1, unbiased=False, keepdim=True) + eps).sqrt()
    out = out if w is None else out * w.double()
    return out if b is None else out + b.double()


# Normalizing a single element gives x_hat = 0: weight's gradient is 0 and both sides hold only
# rounding noise (float64 ~1e-13, float32 ~1e-5), so that pair isn't compared.
CASES = [
    pytest.param(dtype, lengths, inner, normalized_shape, affine,
                 id=f"{_id(dtype)}-{lengths}-{inner}-{normalized_shape}-{affine}")
    for dtype in DTYPES for lengths in LENGTHS for inner, normalized_shape in SHAPES
    for affine in ["weight+bias", "weight", "none"]
    if not (normalized_shape == 1 and affine != "none")
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, lengths, inner, normalized_shape, affine", CASES)
def test_forward_backward(dtype, lengths, inner, normalized_shape, affine, backend):
    x = random_jagged(LENGTHS[lengths], inner, dtype=dtype, requires_grad=True)
    weight = _affine(normalized_shape, dtype, affine != "none")
    bias = _affine(normalized_shape, dtype, affine == "weight+bias")
    out = layer_norm(x, normalized_shape, weight, bias, eps=1e-5, backend=backend)
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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, lengths, inner, normalized_shape, affine, eps", RMS_CASES)
def test_rms_norm_forward_backward(dtype, lengths, inner, normalized_shape, affine, eps, backend):
    x = random_jagged(LENGTHS[lengths], inner, dtype=dtype, requires_grad=True)
    weight = _affine(normalized_shape, dtype, affine == "weight")
    out = rms_norm(x, normalized_shape, weight, eps, backend=backend)
    dy = torch.randn_like(out.values)

    dims = tuple(range(-(1 if isinstance(normalized_shape, int) else len(normalized_shape)), 0))
    x64 = x.values.detach().double().requires_grad_(True)
    w64 = None if weight is None else weight.detach().double().requires_grad_(True)
    # torch's default: the epsilon of the dtype it computes in (float32's for 16-bit inputs)
    eps64 = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps if eps is None else eps
    ref = _rms_norm64(x64, w64, eps64, dims)
    check_jagged_op(x, out, dy, ref, dtype, {"x": (x.values, x64), "weight": (weight, w64)})


@pytest.mark.parametrize("backend", BACKENDS)
def test_rms_norm_gradcheck_and_nested_input(backend):
    x = random_jagged([2, 0, 3], (2, 3), dtype=torch.float64)
    w = torch.randn(3, dtype=torch.float64, device=DEVICE)
    inputs = tuple(t.detach().clone().requires_grad_(True) for t in (x.values, w))
    assert torch.autograd.gradcheck(lambda v, w: rms_norm(x.with_values(v), 3, w, 1e-6, backend=backend).values,
                                    inputs)
    assert_close(rms_norm(x.to_nested(), 3, w, backend=backend).values, F.rms_norm(x.values, (3,), w))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck(backend):
    x = random_jagged([2, 0, 3], (2, 3), dtype=torch.float64)
    w = torch.randn(3, dtype=torch.float64, device=DEVICE)
    b = torch.randn(3, dtype=torch.float64, device=DEVICE)
    inputs = tuple(t.detach().clone().requires_grad_(True) for t in (x.values, w, b))
    assert torch.autograd.gradcheck(lambda v, w, b: layer_norm(x.with_values(v), 3, w, b, backend=backend).values,
                                    inputs)


def test_nested_input():
    x = random_jagged([3, 0, 5], (8,))
    out = layer_norm(x.to_nested(), 8)
    assert isinstance(out, varlen.JaggedTensor)
    assert_close(out.values, F.layer_norm(x.values, (8,)))


@pytest.mark.skipif(not ON_GPU, reason="bf16 and fp16 kernels checked against torch's own rounding on the GPU")
@pytest.mark.parametrize("centered", [True, False], ids=["layer", "rms"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_kernels_err_no_more_than_torch(dtype, centered):
    """flash-attn's rule: the kernels' error against float64 at most twice torch's at the same precision, on rows
    of a language model's width (and of the widest the kernels take)."""
    for n_cols in (768, _norm_kernels.max_cols(dtype)):
        x = (3 * torch.randn(2000, n_cols, dtype=dtype, device=DEVICE) + 1).requires_grad_(True)
        w = (1 + 0.5 * torch.randn(n_cols, dtype=dtype, device=DEVICE)).requires_grad_(True)
        b = torch.randn(n_cols, dtype=dtype, device=DEVICE).requires_grad_(True) if centered else None
        leaves = [t for t in (x, w, b) if t is not None]
        dy = torch.randn_like(x)
        results = {}
        for backend in BACKENDS:
            out = normalize(x, (n_cols,), w, b, 1e-5, centered=centered, backend=backend)
            results[backend] = (out, *torch.autograd.grad(out, leaves, dy))
        leaves64 = [t.detach().double().requires_grad_(True) for t in leaves]
        ref = normalize(leaves64[0], (n_cols,), *leaves64[1:], *([] if centered else [None]), 1e-5,
                        centered=centered, backend="torch")
        want = (ref, *torch.autograd.grad(ref, leaves64, dy.double()))
        names = ("out", "dx", "dweight", "dbias")[:len(want)]
        for name, ours, torchs, ref in zip(names, results["triton"], results["torch"], want, strict=True):
            assert rel_err(ours, ref) <= 2 * rel_err(torchs, ref), f"F{n_cols} {name}: {rel_err(ours, ref):.3g} " \
                f"against torch's {rel_err(torchs, ref):.3g}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_layouts_and_partial_gradients(backend):
    """A strided weight, rows of a wider tensor, a transposed gradient, a bias without a weight, and gradients asked
    for any one input alone (the kernel skips the others), against the float64 definition."""
    base = torch.randn(9, 2, 24, dtype=torch.float64, device=DEVICE)
    values = base[:, 1, 2:22]  # rows 48 apart
    w = torch.randn(40, dtype=torch.float64, device=DEVICE)[::2]  # stride 2
    b = torch.randn(20, dtype=torch.float64, device=DEVICE)
    g = torch.randn(20, 9, dtype=torch.float64, device=DEVICE).t()
    for affine in ((w, b), (None, b)):
        for wants in ((True, True, True), (True, False, False), (False, True, False), (False, False, True)):
            wants = [want and t is not None for t, want in zip((values, *affine), wants, strict=True)]
            if not any(wants):
                continue
            inputs = [None if t is None else t.detach().requires_grad_(want)
                      for t, want in zip((values, *affine), wants, strict=True)]
            refs = [None if t is None else t.detach().clone().requires_grad_(want)
                    for t, want in zip((values, *affine), wants, strict=True)]
            out = normalize(inputs[0], (20,), *inputs[1:], 1e-5, centered=True, backend=backend)
            ref = _layer_norm64(*refs)
            assert_close(out, ref)
            asked = [i for i, want in enumerate(wants) if want]
            got = torch.autograd.grad(out, [inputs[i] for i in asked], g)
            want = torch.autograd.grad(ref, [refs[i] for i in asked], g)
            for i, a, r in zip(asked, got, want, strict=True):
                assert_close(a, r, name=f"gradient {i}")


@pytest.mark.parametrize("centered", [True, False], ids=["layer", "rms"])
@pytest.mark.parametrize("layout", ROW_LAYOUTS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float64] + ([torch.float32, torch.bfloat16] if ON_GPU else []), ids=_id)
def test_rows_not_16_apart(centered, layout, dtype):
    """Rows and gradients not 16 elements apart (the kernels load ROW_ALIGN elements at once), against the float64
    definition."""
    n_cols = layout[0]
    x = strided_rows(300, layout, dtype, DEVICE).requires_grad_(True)
    w = (1 + 0.5 * torch.randn(n_cols, dtype=dtype, device=DEVICE)).requires_grad_(True)
    g = strided_rows(300, layout, dtype, DEVICE)
    out = normalize(x, (n_cols,), w, None, 1e-5, centered=centered, backend="triton")
    x64, w64 = (t.detach().double().requires_grad_(True) for t in (x, w))
    ref = _layer_norm64(x64, w64, None) if centered else _rms_norm64(x64, w64, 1e-5)
    out.backward(g)
    ref.backward(g.double())
    assert_close(out, ref, dtype, name="out")
    assert_close(x.grad, x64.grad, dtype, name="dx")
    assert_close(w.grad, w64.grad, dtype, name="d weight")


@pytest.mark.skipif(varlen._backend.triton_unsupported_reason(DEVICE) is not None, reason="the Triton kernels")
@pytest.mark.parametrize("centered", [True, False], ids=["layer", "rms"])
def test_backward_programs_and_their_partial_sums(centered, monkeypatch):
    """The backward's programs each keep partial weight and bias gradients, summed after the launch in rows of 64:
    with many programs (a GPU's count; the interpreter's device has one SM), sums of 1 to 90 partial rows."""
    per_sm = _norm_kernels._BWD_PLANS[8][0]  # (float64's programs per SM)
    monkeypatch.setattr(_norm_kernels, "sm_count", lambda device: 92 // per_sm)  # 92 programs
    for n_rows, n_cols in ((3, 5), (97, 1000), (400, 7)):
        x = torch.randn(n_rows, n_cols, dtype=torch.float64, device=DEVICE, requires_grad=True)
        w = torch.randn(n_cols, dtype=torch.float64, device=DEVICE, requires_grad=True)
        b = torch.randn(n_cols, dtype=torch.float64, device=DEVICE, requires_grad=True) if centered else None
        leaves = [t for t in (x, w, b) if t is not None]
        g = torch.randn(n_rows, n_cols, dtype=torch.float64, device=DEVICE)
        got = torch.autograd.grad(normalize(x, (n_cols,), w, b, 1e-5, centered=centered, backend="triton"), leaves, g)
        ref = _layer_norm64(x, w, b) if centered else _rms_norm64(x, w, 1e-5)
        want = torch.autograd.grad(ref, leaves, g)
        for name, a, r in zip("xwb", got, want, strict=False):
            assert_close(a, r, name=f"F{n_cols} d{name}")


def test_eps_reaches_the_kernels_as_two_float32_halves():
    """Triton passes Python floats as float32 (the interpreter doesn't, so the float64 test below only bites on a
    GPU): eps goes as a float32 high part and the rest, whose float64 sum is eps to 48 bits; past float32's range,
    inf and 0 (not inf - inf: NaN)."""
    for eps in (1e-5, 1e-12, 0.1, 3.0, 0.0):
        high, low = _norm_kernels.float32_halves(eps)
        assert torch.tensor(high, dtype=torch.float32).item() == high
        low32 = torch.tensor(low, dtype=torch.float32).item()
        assert abs(high + low32 - eps) <= 2.0 ** -48 * eps
    for eps in (1e39, float("inf")):
        assert _norm_kernels.float32_halves(eps) == (float("inf"), 0.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_rows_of_tiny_variance(backend):
    """eps reaches the float64 kernels in full (Triton passes Python floats as float32: 1e-5 would move such rows by
    1e-8)."""
    x = 1e-3 * torch.randn(7, 50, dtype=torch.float64, device=DEVICE)
    for centered in (True, False):
        out = normalize(x, (50,), None, None, 1e-5, centered=centered, backend=backend)
        ref = _layer_norm64(x, None, None) if centered else _rms_norm64(x, None, 1e-5)
        assert_close(out, ref, tol=1e-12)


def test_rows_wider_than_the_kernels_take_torch_and_triton_says_why():
    n_cols = _norm_kernels.max_cols(torch.float64) + 1
    x = random_jagged([3, 2], (n_cols,), dtype=torch.float64)
    eps = torch.finfo(torch.float64).eps
    assert_close(rms_norm(x, n_cols).values, _rms_norm64(x.values, None, eps))
    if varlen._backend.triton_unsupported_reason(DEVICE) is None:
        with pytest.raises(ValueError, match=re.escape(f"backend='triton' can't take normalized_shape ({n_cols},)")):
            rms_norm(x, n_cols, backend="triton")


@pytest.mark.parametrize("centered", [True, False], ids=["layer", "rms"])
def test_automatic_choice_under_torch_compile_is_torchs_norm(centered, monkeypatch):
    """While torch.compile traces, the automatic backend takes torch's norm (Inductor fuses it with its neighbours);
    ``backend="triton"`` still takes the kernels. Here on any device: the choice is what is checked (the kernels'
    entry point recorded, not run)."""
    taken = []

    def kernels(rows, weight, bias, eps, centered_):
        taken.append("kernels")
        return F.layer_norm(rows, rows.shape[-1:], weight, bias, eps) if centered_ else rows
    monkeypatch.setattr(_norm_kernels.NormRows, "apply", kernels)
    monkeypatch.setattr(varlen.capabilities, "resolve", lambda *args: "triton")  # (as on a GPU)
    x = torch.randn(5, 8, dtype=torch.float64)
    for compiling, backend, expected in ((False, None, ["kernels"]), (True, None, []), (True, "auto", []),
                                         (True, "triton", ["kernels"])):
        taken.clear()
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda compiling=compiling: compiling)
        out = normalize(x, (8,), None, None, 1e-5, centered=centered, backend=backend)
        assert taken == expected, (compiling, backend)
        if not taken:
            ref = _layer_norm64(x, None, None) if centered else _rms_norm64(x, None, 1e-5)
            assert_close(out, ref, tol=1e-12)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with varlen.use_backend("triton"):  # the scoped choice counts as asked for
        taken.clear()
        normalize(x, (8,), None, None, 1e-5, centered=centered)
        assert taken == ["kernels"]


@pytest.mark.skipif(varlen._backend.triton_unsupported_reason(DEVICE) is not None, reason="the Triton path's guard")
def test_gradient_penalty_raises():
    x = random_jagged([3, 2], (8,), dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(layer_norm(x, 8, backend="triton").values.square().sum(), x.values, create_graph=True)
    with pytest.raises(NotImplementedError, match="no double backward"):
        (g * x.values).sum().backward()


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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else []), ids=str)
def test_rms_norm_defaults_and_weight_dtype_as_torch(dtype, backend):
    """eps None is the epsilon of the dtype torch computes in (float32's for 16-bit inputs: at rows of magnitude 0.01
    the input dtype's would move the result by tens of percent), and a weight of another dtype gives the input's
    dtype (as torch's rms_norm, outside autocast and under torch 2.11's, which has no rule for it)."""
    values = 0.01 * torch.randn(6, 3, 40, device=DEVICE)
    w = 1 + 0.5 * torch.randn(40, device=DEVICE)
    x = values.to(dtype)
    for weight in (None, w.to(dtype), w):
        out = normalize(x, (40,), weight, None, None, centered=False, backend=backend)
        ref = _rms_norm64(x, weight, torch.finfo(torch.float32).eps)
        assert out.dtype == dtype
        assert_close(out, ref, dtype)
        if weight is not None:
            assert out.dtype == F.rms_norm(x, (40,), weight).dtype
