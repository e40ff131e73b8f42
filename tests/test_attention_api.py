"""Every input error of ``varlen.attention`` gives a clear ValueError / TypeError naming the argument."""

import re

import pytest
import torch

import varlen
from utils import record_calls
from varlen.attn import api, cpu_fused
from varlen.attn.options import AttentionOptions, Problem
from varlen.attn.reference import attention_reference
from varlen.jagged import JaggedTensor

B, S, H, HKV, D = 2, 5, 4, 2, 8


def _dense(batch=B, seq=S, heads=H, dim=D, dtype=torch.float32, device="cpu"):
    return torch.randn(batch, seq, heads, dim, dtype=dtype, device=device)


def _qkv():
    return _dense(), _dense(heads=HKV), _dense(heads=HKV)


def _jagged(lengths, heads=H, dim=D):
    return varlen.jagged([torch.randn(n, heads, dim) for n in lengths])


def _call(q=None, k=None, v=None, **kwargs):
    dq, dk, dv = _qkv()
    return varlen.attention(dq if q is None else q, dk if k is None else k, dv if v is None else v,
                            backend="torch", **kwargs)


LAYOUT_ERRORS = [  # (q, k, v, exception, message)
    ("dense q, jagged k, v", lambda: (_dense(), _jagged([5, 5], HKV), _jagged([5, 5], HKV)), TypeError,
     "q, k, v: mix dense tensors and jagged"),
    ("q not a tensor", lambda: ([[1.0]], _dense(), _dense()), TypeError, "q: expected a torch.Tensor"),
    ("q with 3 dims", lambda: (_dense()[0], _dense(), _dense()), ValueError, "q: expected 4 dims"),
    ("v with 5 dims", lambda: (_dense(), _dense(), _dense()[None]), ValueError, "v: expected 4 dims"),
    ("k batch", lambda: (_dense(), _dense(batch=3), _dense(batch=3)), ValueError,
     "k, v: batch sizes 3, 3 must equal q's 2"),
    ("v sequence", lambda: (_dense(), _dense(seq=6), _dense(seq=7)), ValueError,
     "v: sequence length 7 differs from k's 6"),
    ("k head dim", lambda: (_dense(), _dense(dim=16), _dense()), ValueError, "k: head dim 16 differs from q's 8"),
    ("v heads", lambda: (_dense(), _dense(heads=2), _dense(heads=4)), ValueError,
     "v: 4 heads differ from k's 2"),
    ("H % Hkv", lambda: (_dense(heads=4), _dense(heads=3), _dense(heads=3)), ValueError,
     "q: 4 heads are not a multiple of k/v's 3 heads"),
    ("no kv heads", lambda: (_dense(), _dense(heads=0), _dense(heads=0)), ValueError,
     "q: 4 heads are not a multiple of k/v's 0 heads"),
    ("integer dtype", lambda: (_dense().long(), _dense().long(), _dense().long()), TypeError,
     "q: dtype int64 is not supported"),
    ("dtype mismatch", lambda: (_dense(), _dense(dtype=torch.float64), _dense()), TypeError,
     "k: dtype torch.float64 differs from q's torch.float32"),
    ("device mismatch", lambda: (_dense(), _dense(device="meta"), _dense(device="meta")), ValueError,
     "k: on device meta, but q is on cpu"),
    ("jagged k batch", lambda: (_jagged([3, 4]), _jagged([3, 4, 5], HKV), _jagged([3, 4, 5], HKV)),
     ValueError, "k: batch size 3 differs from q's 2"),
    ("jagged v lengths", lambda: (_jagged([3, 4]), _jagged([3, 4], HKV), _jagged([4, 3], HKV)), ValueError,
     "v: lengths differ from k's"),
    ("jagged v batch", lambda: (_jagged([3, 4]), _jagged([3, 4], HKV), _jagged([3, 4, 0], HKV)), ValueError,
     "v: batch size 3 differs from k's 2"),
    ("jagged 2-dim values", lambda: (varlen.jagged([torch.randn(3, 8)]),) * 3, ValueError,
     "q: expected a jagged tensor of logical shape"),
]


@pytest.mark.parametrize("make,error,message", [c[1:] for c in LAYOUT_ERRORS], ids=[c[0] for c in LAYOUT_ERRORS])
def test_layout_errors(make, error, message):
    q, k, v = make()
    with pytest.raises(error, match=re.escape(message)):
        varlen.attention(q, k, v, backend="torch")


OPTION_ERRORS = [  # (keyword arguments, exception, message)
    (dict(causal=1), TypeError, "causal: expected a bool, got int"),
    (dict(align="center"), ValueError, "align: got 'center'; allowed: 'top_left', 'bottom_right'"),
    (dict(window=3), ValueError, "window: expected None or (left, right), got 3"),
    (dict(window=(1, 2, 3)), ValueError, "window: expected None or (left, right)"),
    (dict(window=(-2, 0)), ValueError, "window: left = -2; allowed: an int >= 0, or None / -1"),
    (dict(window=(0, 1.5)), ValueError, "window: right = 1.5"),
    (dict(window=(True, 0)), ValueError, "window: left = True"),
    (dict(scale=float("inf")), ValueError, "scale: expected a nonzero finite float, got inf"),
    (dict(scale=float("nan")), ValueError, "scale: expected a nonzero finite float, got nan"),
    (dict(scale="1"), ValueError, "scale: expected a nonzero finite float, got '1'"),
    (dict(scale=True), ValueError, "scale: expected a nonzero finite float, got True"),
    (dict(scale=0.0), ValueError, "scale: expected a nonzero finite float, got 0.0"),
    (dict(scale=0), ValueError, "scale: expected a nonzero finite float, got 0"),
    (dict(scale=1e-46), ValueError, "scale: expected a nonzero finite float, got 1e-46: its magnitude must lie in"),
    (dict(scale=-1e31), ValueError, "scale: expected a nonzero finite float, got -1e+31: its magnitude"),
    (dict(softcap=-1.0), ValueError, "softcap: expected a finite float >= 0"),
    (dict(softcap=float("inf")), ValueError, "softcap: expected a finite float >= 0"),
    (dict(softcap=True), ValueError, "softcap: expected a finite float >= 0"),
    (dict(dropout_p=1.0), ValueError, "dropout_p: expected a float in [0, 1), got 1.0"),
    (dict(dropout_p=-0.1), ValueError, "dropout_p: expected a float in [0, 1), got -0.1"),
    (dict(dropout_p=True), ValueError, "dropout_p: expected a float in [0, 1), got True"),
    (dict(dropout_p="0.1"), ValueError, "dropout_p: expected a float in [0, 1)"),
    (dict(dropout_p=0.1, generator=0), TypeError, "generator: expected a torch.Generator or None, got int"),
    (dict(deterministic="yes"), TypeError, "deterministic: expected a bool, got str"),
    (dict(return_lse=1), TypeError, "return_lse: expected a bool, got int"),
    (dict(backend="cuda"), ValueError, "backend: got 'cuda'; allowed: 'auto', 'triton', 'torch'"),
]


@pytest.mark.parametrize("kwargs,error,message", OPTION_ERRORS, ids=[repr(kw) for kw, *_ in OPTION_ERRORS])
def test_option_errors(kwargs, error, message):
    q, k, v = _qkv()
    kwargs = {"backend": "torch", **kwargs}
    with pytest.raises(error, match=re.escape(message)):
        varlen.attention(q, k, v, **kwargs)



def _id(entry) -> str:
    """The start of an error list entry's message."""
    values = entry.values if hasattr(entry, "values") else entry
    return values[-1][:40]


BIAS_ERRORS = [  # (jagged, bias, exception, message)
    pytest.param(False, [[0.0]], TypeError, "bias: expected a torch.Tensor, got list"),
    (False, torch.zeros(S, S, dtype=torch.int64), TypeError, "bias: dtype int64 is not supported"),
    (False, torch.zeros(1, B, H, S, S), ValueError, "bias: expected at most 4 dims (B, H, Sq, Sk)"),
    (False, torch.zeros(B, H, S + 1, S), ValueError,
     "bias: shape (2, 4, 6, 5) does not broadcast to (B, H, Sq, Sk) = (2, 4, 5, 5): dim Sq is 6, "
     "allowed 1 or 5"),
    (False, torch.zeros(3, 1, 1, S), ValueError, "dim B is 3, allowed 1 or 2"),
    (False, torch.zeros(2, S, S), ValueError, "dim H is 2, allowed 1 or 4"),
    (True, torch.zeros(B, H, 4, 7), ValueError, "dim Sq is 4, allowed 1 or 5 (or more, jagged)"),
    (True, torch.zeros(B, H, 5, 3), ValueError, "dim Sk is 3, allowed 1 or 7 (or more, jagged)"),
]


@pytest.mark.parametrize("jagged,bias,error,message", BIAS_ERRORS, ids=[_id(e) for e in BIAS_ERRORS])
def test_bias_errors(jagged, bias, error, message):
    if jagged:
        q, k = _jagged([5, 2]), _jagged([7, 1], HKV)
        v = k.with_values(torch.randn(k.total, HKV, D))
    else:
        q, k, v = _qkv()
    with pytest.raises(error, match=re.escape(message)):
        varlen.attention(q, k, v, bias=bias, backend="torch")


ALIBI_ERRORS = [  # (slopes, exception, message)
    pytest.param("0.5", TypeError, "alibi_slopes: expected a torch.Tensor, got str"),
    (torch.ones(H, dtype=torch.int32), TypeError, "alibi_slopes: dtype int32 is not supported"),
    (torch.ones(H, requires_grad=True), ValueError, "alibi_slopes: gradients with respect to the slopes"),
    (torch.ones(HKV), ValueError, "alibi_slopes: expected shape (4,) or (2, 4), got (2,)"),
    (torch.ones(1, H), ValueError, "alibi_slopes: expected shape (4,) or (2, 4), got (1, 4)"),
]


@pytest.mark.parametrize("slopes,error,message", ALIBI_ERRORS, ids=[_id(e) for e in ALIBI_ERRORS])
def test_alibi_errors(slopes, error, message):
    with pytest.raises(error, match=re.escape(message)):
        _call(alibi_slopes=slopes)


def test_bias_and_alibi_on_another_device():
    with pytest.raises(ValueError, match="bias: on device meta, but q is on cpu"):
        _call(bias=torch.zeros(S, S, device="meta"))
    with pytest.raises(ValueError, match="alibi_slopes: on device meta, but q is on cpu"):
        _call(alibi_slopes=torch.ones(H, device="meta"))


def test_triton_backend_on_cpu_without_interpreter(monkeypatch):
    """Asking for Triton on CPU tensors outside the interpreter says why it can't run."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"backend='triton'.*(CUDA|TRITON_INTERPRET)"):
        varlen.attention(q, k, v, backend="triton")


def test_jagged_rows_beyond_int32_are_rejected():
    """More than 2**31 - 1 rows (int64 offsets) overflow the int32 offsets kernels index with."""
    rows = 2**31 + 5
    values = torch.empty(rows, H, D, device="meta")
    offsets = torch.tensor([0, 5, rows], dtype=torch.int64, device="meta")
    q = JaggedTensor(values, offsets, max_len=rows - 5, validate=False)
    with pytest.raises(ValueError, match=r"2147483653.*int32"):
        varlen.attention(q, q, q)


def test_zero_head_dim_is_rejected():
    q = _dense(dim=0)
    with pytest.raises(ValueError, match="head dim"):
        varlen.attention(q, q, q, backend="torch")


# -------------------------------------------------------------------- autograd beyond first order
def _sdpa(q, k, v):
    return varlen.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True)


@pytest.mark.parametrize("entry", [varlen.attention, _sdpa], ids=["attention", "sdpa"])
def test_double_backward_raises_a_clear_error(entry):
    q, k, v = (t.double().requires_grad_() for t in _qkv())
    dq, = torch.autograd.grad(entry(q, k, v).sum(), q, create_graph=True)
    with pytest.raises(NotImplementedError, match="double backward"):
        dq.sum().backward()
    # Without create_graph, first-order gradients are unaffected.
    dq_plain, = torch.autograd.grad(entry(q, k, v).sum(), q)
    assert torch.equal(dq.detach(), dq_plain)


def test_torch_func_grad_and_vjp_match_autograd():
    q, k, v = (t.double() for t in _qkv())
    f = lambda q, k: varlen.attention(q, k, v, causal=True, backend="torch")  # noqa: E731
    dq, dk = torch.func.grad(lambda q, k: f(q, k).square().sum(), argnums=(0, 1))(q, k)
    leaves = [q.clone().requires_grad_(), k.clone().requires_grad_()]
    want = torch.autograd.grad(f(*leaves).square().sum(), leaves)
    assert torch.allclose(dq, want[0]) and torch.allclose(dk, want[1])
    out, vjp = torch.func.vjp(f, q, k)
    assert all(torch.allclose(a, b) for a, b in zip(vjp(2 * out), want, strict=True))


def test_torch_func_limits_raise_clear_errors(device):
    q, k, v = (t.to(device) for t in _qkv())
    with pytest.raises(NotImplementedError, match="vmap is not supported"):
        torch.func.vmap(lambda q: varlen.attention(q, k, v))(q[None].expand(3, -1, -1, -1, -1))
    with pytest.raises(NotImplementedError, match="PyTorch backend only"):
        torch.func.grad(lambda q: varlen.attention(q, k, v, backend="triton").sum())(q)


# ------------------------------------------------------------------------------- prefix and documents
@pytest.mark.parametrize("name", ["prefix_len", "query_offset"])
@pytest.mark.parametrize("value, error, match", [
    (-1, ValueError, r"NAME: got -1; must be in \[0, "),
    (torch.tensor([1.0, 2.0]), TypeError, "NAME: dtype float32 is not supported"),
    (torch.tensor([1, 2, 3]), ValueError, r"NAME: expected shape \(2,\)"),
    (torch.tensor([1, -2]), ValueError, r"NAME: got \[1, -2\]; each must be in \[0, "),
    ("3", TypeError, "NAME: expected an int or an integer tensor"),
])
def test_bad_per_sequence_ints(name, value, error, match):
    q, k, v = _qkv()
    with pytest.raises(error, match=match.replace("NAME", name)):
        varlen.attention(q, k, v, causal=True, **{name: value})


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("options", [
    dict(causal=True, query_offset="largest"),
    dict(causal=True, window=(2**31 - 1, None), query_offset="largest"),
    dict(window=(None, 2**31 - 2), align="bottom_right"),
    dict(window=(2**40, 0), query_offset=5),
    dict(window=(1, 2**31 - 1), query_offset=3),
    dict(window=(2**31 - 1, 2**31 - 1), align="bottom_right"),
    dict(window=(2**29 - 1, 0), query_offset="largest"),
    dict(window=(0, 2**29 - 1), query_offset="largest"),
], ids=["offset", "offset-left", "right-bottom-right", "left-2**40", "right-offset", "both", "left-below-the-cut",
        "right-below-the-cut"])
def test_positions_near_the_int32_limit(backend, options, device):
    """Key positions that int32 arithmetic would overflow (``i + shift`` plus a window side) give the reference's
    masks: the sides that reach past every key are cut to a reach that does too, and ``query_offset`` stops where a
    position plus that reach still fits (the Triton kernels masked wrongly past 2**31 - Lq, an invalid-input fuzz
    found); one more raises. Under the largest offset, a right side just below the cut: (2**29 - 1, 0)."""
    q, k, v = (t.to(device) for t in _qkv())
    q = q[:, 1:]  # (Lq < Lk: bottom-right shifts are nonzero)
    largest = api.LARGEST_QUERY_OFFSET
    if options.get("query_offset") == "largest":
        options = dict(options, query_offset=largest)
    out = varlen.attention(q, k, v, **options, backend=backend)
    ref, _ = attention_reference(*(t.double() for t in (q, k, v)), **options)
    assert (out.double() - ref).abs().max() < 1e-5
    with pytest.raises(ValueError, match=re.escape(f"query_offset: got {largest + 1}; must be in [0, {largest}]")):
        varlen.attention(q, k, v, causal=True, query_offset=largest + 1, backend=backend)
    if device.type == "cpu":
        with pytest.raises(ValueError, match=re.escape(f"each must be in [0, {largest}]")):
            varlen.attention(q, k, v, causal=True, query_offset=torch.tensor([0, largest + 1]), backend=backend)


def test_query_offset_replaces_align():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="query_offset: replaces align"):
        varlen.attention(q, k, v, causal=True, align="bottom_right", query_offset=2)
    # query_offset = Lk - Lq is bottom-right alignment
    q = q[:, 2:].double()
    k, v = k.double(), v.double()
    a = varlen.attention(q, k, v, causal=True, align="bottom_right", backend="torch")
    b = varlen.attention(q, k, v, causal=True, query_offset=k.shape[1] - q.shape[1], backend="torch")
    assert torch.equal(a, b)


def test_prefix_len_int_is_per_sequence_tensor():
    q, k, v = (t.double() for t in _qkv())
    a = varlen.attention(q, k, v, causal=True, prefix_len=3, backend="torch")
    b = varlen.attention(q, k, v, causal=True, prefix_len=torch.tensor([3, 3]), backend="torch")
    assert torch.equal(a, b)


@pytest.mark.parametrize("make, error, match", [
    (lambda q: torch.zeros(B, S + 1, dtype=torch.int64), ValueError, r"document_ids: expected shape \(B, S\)"),
    (lambda q: torch.zeros(B, S), TypeError, "document_ids: expected an integer or bool tensor"),
    (lambda q: torch.zeros(B, S, dtype=torch.int64, device="meta"), ValueError, "document_ids: on device meta"),
])
def test_bad_document_ids(make, error, match):
    q, k, v = _qkv()
    with pytest.raises(error, match=match):
        varlen.attention(q, k, v, document_ids=make(q))


def test_document_ids_need_dense_self_attention():
    q = varlen.jagged([torch.randn(3, H, D), torch.randn(2, H, D)])
    with pytest.raises(ValueError, match="document_ids: only for dense inputs"):
        varlen.attention(q, q, q, document_ids=torch.zeros(2, 3, dtype=torch.int64))
    q, k, v = _dense(), _dense(seq=S + 2, heads=HKV), _dense(seq=S + 2, heads=HKV)
    with pytest.raises(ValueError, match=r"document_ids: needs self-attention over packed rows \(Sq == Sk\)"):
        varlen.attention(q, k, v, document_ids=torch.zeros(B, S, dtype=torch.int64))


def test_documents_equal_separate_sequences():
    """Packed rows with document_ids give what the documents as jagged sequences give."""
    lengths = [3, 5, 1, 6]
    q, k, v = (torch.randn(1, sum(lengths), H, D, dtype=torch.float64) for _ in range(3))
    ids = torch.repeat_interleave(torch.tensor([7, 2, 7, 0]), torch.tensor(lengths))[None]
    packed = varlen.attention(q, k, v, causal=True, document_ids=ids, backend="torch")
    qj, kj, vj = (varlen.jagged(list(t[0].split(lengths))) for t in (q, k, v))
    separate = varlen.attention(qj, kj, vj, causal=True, backend="torch")
    assert torch.allclose(packed[0], separate.values)


# ----------------------------------------------------------------------------------- backend choice
@pytest.mark.parametrize("scope,argument,expected", [
    ("torch", None, "torch"), ("triton", None, "triton"), ("triton", "torch", "torch"), ("auto", None, None)])
def test_use_backend_scopes_attention_too(scope, argument, expected, device, monkeypatch):
    """``varlen.use_backend`` picks attention's backend as it does the jagged ops'; ``backend=`` overrides it."""
    from varlen.attn import backends

    ran = []
    for name in ("torch", "triton"):
        module = backends.module(name)
        monkeypatch.setattr(module, "forward", lambda *a, _f=module.forward, _n=name: ran.append(_n) or _f(*a))
    q, k, v = (t.to(device, torch.float16 if device.type == "cuda" else torch.float32) for t in _qkv())
    with varlen.use_backend(scope):
        varlen.attention(q, k, v, backend=argument)
    assert ran == [expected or ("triton" if device.type == "cuda" else "torch")]


def test_backend_reasons_come_from_the_declarations():
    """The error lists what the declared capabilities exclude, for each backend tried."""
    q = torch.randn(1, 4, 2, 300, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"backend='triton' can't take .*dtype float64 \(allowed: float16, "
                                         r"bfloat16, float32\), head dims \(300, 300\) \(at most 256\)"):
        varlen.attention(q, q, q, backend="triton")


def test_features_are_not_examined_on_a_device_the_backend_cannot_use():
    """A backend that can't take the device lists the device, dtype and head dims, and never evaluates a
    feature predicate (some read device tensors: a host sync per call)."""
    from types import SimpleNamespace

    from varlen import capabilities

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"a feature predicate read opts.{name}")

    caps = capabilities.Capabilities("gpu_only", (torch.float16,), ("cuda",), frozenset(), max_head_dim=64)
    problem = SimpleNamespace(head_dim=80, head_dim_v=80)
    call = capabilities.Call(torch.empty(0, dtype=torch.float32, device="meta"), None, None, problem, Untouchable())
    assert capabilities.unsupported_reasons(caps, call) == [
        "tensors on meta (it runs on cuda)", "dtype float32 (allowed: float16)", "head dims (80, 80) (at most 64)"]


def test_int64_cpu_offsets_converted_once(monkeypatch):
    """Every layer passes its batch's int64 offsets: the fused CPU path plans the batch once, not per call; offsets
    changed in place are converted again (the output follows the new sequences)."""
    plans = record_calls(monkeypatch, cpu_fused, "_build_plan")
    offsets = torch.tensor([0, 3, 7], dtype=torch.int64)
    values = torch.randn(7, 2, 4, dtype=torch.float64)
    x = JaggedTensor(values, offsets)
    first = varlen.attention(x, x, x, backend="torch").values
    assert torch.equal(varlen.attention(x, x, x, backend="torch").values, first)
    assert len(plans) == 1
    with torch.no_grad():
        offsets[1] = 5
    y = JaggedTensor(values, offsets)
    got = varlen.attention(y, y, y, backend="torch").values
    want = torch.cat([varlen.attention_reference(s[None], s[None], s[None])[0][0] for s in (values[:5], values[5:])])
    torch.testing.assert_close(got, want)
    assert len(plans) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", ["q", "k"])
def test_fused_cpu_kernel_declines_queries_and_keys_that_are_not_finite(where, value, dtype):
    """The fused CPU kernel gives a query whose scores hold a NaN the output 0 and the lse 0: calls with a NaN or an
    infinity in q or k take the chunked path. (One non-finite entry among many rows: the check sums each tensor.)"""
    q, k = torch.randn(2, 300, 4, 16, dtype=dtype), torch.randn(2, 300, 2, 16, dtype=dtype)
    problem, opts = Problem(2, 4, 2, 16, 16, 300, 300, True), AttentionOptions(scale=0.25, causal=True)
    assert cpu_fused.takes(q, k, None, None, problem, opts)
    (q if where == "q" else k)[1, 250, 1, 5] = value
    assert not cpu_fused.takes(q, k, None, None, problem, opts)


def test_cpu_plans_kept_for_self_and_cross_attention(monkeypatch):
    """Layers alternating between two offsets tensors (self- and cross-attention) plan each batch once."""
    plans = record_calls(monkeypatch, cpu_fused, "_build_plan")
    x = JaggedTensor(torch.randn(7, 2, 4), torch.tensor([0, 3, 7]))
    memory = JaggedTensor(torch.randn(9, 2, 4), torch.tensor([0, 4, 9]))
    for _ in range(3):
        varlen.attention(x, x, x, backend="torch")
        varlen.attention(x, memory, memory, backend="torch")
    assert len(plans) == 2


def test_cpu_jagged_attention_in_inference_mode():
    """Offsets made under torch.inference_mode (no version counter) work inside it and outside it."""
    with torch.inference_mode():
        offsets = torch.tensor([0, 3, 3, 8])
        values = torch.randn(8, 2, 4, dtype=torch.float64)
        x = JaggedTensor(values, offsets)
        got = varlen.attention(x, x, x, causal=True, backend="torch").values
    want = torch.cat([varlen.attention_reference(s[None], s[None], s[None], causal=True)[0][0]
                      for s in (values[:3], values[3:3], values[3:])])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(varlen.attention(x, x, x, causal=True, backend="torch").values, want)


def test_cpu_no_sequence_with_both_queries_and_keys():
    """Every sequence lacks queries or keys: output 0, lse -inf, zero gradients."""
    q = JaggedTensor(torch.randn(2, 2, 4, requires_grad=True), torch.tensor([0, 2, 2]))
    k = JaggedTensor(torch.randn(1, 2, 4, requires_grad=True), torch.tensor([0, 0, 1]))
    out, lse = varlen.attention(q, k, k, return_lse=True, backend="torch")
    assert torch.equal(out.values, torch.zeros(2, 2, 4)) and bool((lse == float("-inf")).all())
    dq, dk = torch.autograd.grad(out.values.sum() + 1.0, (q.values, k.values), allow_unused=True)
    assert torch.equal(dq, torch.zeros_like(dq)) and torch.equal(dk, torch.zeros_like(dk))


@pytest.mark.parametrize("options", [{}, dict(softcap=1.0), dict(dropout_p=0.2)], ids=["fused", "chunked", "dropout"])
def test_cpu_batch_without_queries(options):
    """No sequence has a query row (the fused path and the chunked path's length buckets): empty results."""
    q = JaggedTensor(torch.randn(0, 2, 8, requires_grad=True), torch.tensor([0, 0, 0]))
    k = JaggedTensor(torch.randn(7, 2, 8, requires_grad=True), torch.tensor([0, 3, 7]))
    out, lse = varlen.attention(q, k, k, return_lse=True, backend="torch", **options)
    assert out.values.shape == (0, 2, 8) and lse.shape == (2, 0)
    (dk,) = torch.autograd.grad(out.values.sum(), k.values)
    assert torch.equal(dk, torch.zeros_like(dk))


def test_cpu_output_takes_in_place_ops():
    """The output is no view of a spare-row buffer: in-place ops on it, with grad mode on, work."""
    x = JaggedTensor(torch.randn(7, 2, 4), torch.tensor([0, 3, 7]))
    w = torch.randn(4, requires_grad=True)
    out = varlen.attention(x, x, x, backend="torch").values
    out.mul_(w)
    (dw,) = torch.autograd.grad(out.sum(), w)
    assert dw.shape == (4,)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_bool_mask_becomes_an_additive_bias_of_the_inputs_dtype(dtype):
    # 0 where True and -inf where False are exact in every float dtype; a bias of the inputs' dtype is what the Gluon
    # backward takes (its tiles share the ring with Q and dO).
    q = torch.randn(2, 5, 2, 8, dtype=dtype)
    mask = torch.rand(5, 5, generator=torch.Generator().manual_seed(0)) < 0.7
    call = api.prepare(q, q, q, causal=False, window=None, align="top_left", scale=None, bias=mask, alibi_slopes=None,
                       softcap=0.0, dropout_p=0.0, generator=None, deterministic=False, backend=None)
    bias = call.args[3]
    assert bias.dtype == dtype and bias.shape == (1, 1, 5, 5)
    assert torch.equal(bias[0, 0], torch.zeros(5, 5, dtype=dtype).masked_fill(~mask, float("-inf")))
