"""torch.compile over varlen: one graph (fullgraph=True), eager's outputs and gradients, no recompile for
new lengths, and torch.library.opcheck of every custom op.

Compiles are slow on the CPU, so the models are tiny and most tests use the ``aot_eager`` backend (dynamo
and AOTAutograd trace everything, including the custom ops' fake implementations and autograd; only the
code generation is skipped). One test per model runs TorchInductor (marked ``inductor``).
"""

import dataclasses
import importlib
import re

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import varlen
from conftest import DEVICE, ON_GPU
from utils import REL_TOL, assert_close, random_jagged
from varlen import _backend
from varlen.attn import api, function
from varlen.attn.options import Problem
from varlen.nn import TransformerEncoderLayer

# The attention runs through one custom op pair whatever the backend; the Triton one runs on the GPU, or
# through the interpreter here (slow, so only in the opcheck tests, with tiny shapes).
TRITON_RUNS = _backend.triton_unsupported_reason(DEVICE) is None
BACKENDS = ["torch", "triton"] if TRITON_RUNS else ["torch"]
# SwiGLU and the norms call their custom ops on the Triton path only (the torch path is torch ops, with their own
# autograd).
ROW_BACKEND = "triton" if TRITON_RUNS else "torch"

E, HEADS = 8, 2


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _values(out):
    return out.values if isinstance(out, varlen.JaggedTensor) else out


def _loss(outs, weights):
    return sum((_values(o) * w).sum() for o, w in zip(outs, weights, strict=True))


def _check_compiled_matches_eager(fn, inputs, params, dtype, backend="aot_eager"):
    """Compile ``fn`` with fullgraph=True; outputs and gradients w.r.t. inputs' values and ``params``
    must equal eager's. Returns the compile counter."""
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    leaves = [_values(x) for x in inputs] + list(params)
    eager_outs = fn(*inputs)
    weights = [torch.randn_like(_values(o)) for o in eager_outs]
    want = torch.autograd.grad(_loss(eager_outs, weights), leaves)
    outs = compiled(*inputs)
    got = torch.autograd.grad(_loss(outs, weights), leaves)
    for i, (o, e) in enumerate(zip(outs, eager_outs, strict=True)):
        assert type(o) is type(e)
        assert_close(_values(o), _values(e), tol=REL_TOL[dtype], name=f"output {i}")
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert_close(g, w, tol=REL_TOL[dtype], name=f"gradient {i}")
    assert counter.frame_count == 1
    return counter


# ------------------------------------------------------------------------------------------ models
def attention_block(x, w_qkv, w_out, norm_weight):
    """Pre-norm causal self-attention and activations on a jagged (B, j, E) batch."""
    h = varlen.layer_norm(x, E, norm_weight, backend=ROW_BACKEND)
    qkv = varlen.linear(h, w_qkv)
    rows = qkv.values.unflatten(-1, (3, HEADS, -1))
    q, k, v = (qkv.with_values(rows[:, i]) for i in range(3))
    o = varlen.attention(q, k, v, causal=True)
    o = varlen.linear(o.with_values(o.values.flatten(-2)), w_out)
    return varlen.silu(varlen.gelu(varlen.relu(o))), varlen.swiglu(o, backend=ROW_BACKEND)


def ragged_ops(x, w, w_seq):
    """The ops that reduce or mix along the ragged dim (each behind a custom op)."""
    y = varlen.matmul(varlen.matmul(x, w), w_seq)
    s = varlen.softmax(y, 1)
    return varlen.sum(s, 1), varlen.mean(y, 1), y.to_padded(), s, varlen.transposed_matmul(x, y)


def dense_attention(q, k, v):
    return (varlen.attention(q, k, v, window=(2, 1)),)


def _attention_params(dtype):
    return [torch.randn(3 * E, E, dtype=dtype, device=DEVICE) / E ** 0.5,
            torch.randn(E, E, dtype=dtype, device=DEVICE) / E ** 0.5,
            1 + 0.1 * torch.randn(E, dtype=dtype, device=DEVICE)]


# ------------------------------------------------------------------------------ compiled == eager
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_attention_block_compiles_to_one_graph(dtype):
    params = [p.requires_grad_() for p in _attention_params(dtype)]
    x = random_jagged([3, 0, 7, 1, 5], (E,), dtype=dtype, requires_grad=True)
    _check_compiled_matches_eager(lambda x: attention_block(x, *params), [x], params, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_dense_attention_compiles_to_one_graph(dtype):
    q, k, v = (torch.randn(2, 6, HEADS, 4, dtype=dtype, device=DEVICE, requires_grad=True) for _ in range(3))
    _check_compiled_matches_eager(dense_attention, [q, k, v], [], dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_ragged_ops_compile_to_one_graph(dtype):
    lengths = [3, 0, 7, 1, 5]
    x = random_jagged(lengths, (E,), dtype=dtype, requires_grad=True)
    w = torch.randn(E, 4, dtype=dtype, device=DEVICE, requires_grad=True)
    w_seq = torch.randn(len(lengths), 4, 4, dtype=dtype, device=DEVICE, requires_grad=True)
    _check_compiled_matches_eager(ragged_ops, [x, w, w_seq], [w, w_seq], dtype)


@pytest.mark.inductor
def test_encoder_layer_compiles_with_inductor():
    """TorchInductor (C++ on the CPU): eval-mode outputs and gradients equal eager's; training mode with
    dropout (attention included) compiles to one graph too."""
    dtype = torch.float64
    layer = TransformerEncoderLayer(E, HEADS, 16, dropout=0.2, activation="gelu", norm_first=True, device=DEVICE,
                                    dtype=dtype)
    layer.eval()
    x = random_jagged([3, 0, 7, 1, 5], (E,), dtype=dtype, requires_grad=True)
    _check_compiled_matches_eager(lambda x: (layer(x),), [x], list(layer.parameters()), dtype, backend="inductor")
    layer.train()
    compiled = torch.compile(layer, fullgraph=True, backend="inductor")
    out = compiled(x)
    assert isinstance(out, varlen.JaggedTensor) and out.offsets is x.offsets
    out.values.sum().backward()
    assert torch.isfinite(x.values.grad).all() and torch.isfinite(layer.self_attn.in_proj_weight.grad).all()


# --------------------------------------------------------------------------------- recompilation
BATCHES = [[3, 5, 2], [4, 2, 7, 2], [6, 6], [2, 9, 3, 3, 3], [5, 5, 5]]  # B, total and max_len all change


def _compiles_per_batch(fn, make_inputs, dynamic) -> list[int]:
    """How many graphs were compiled so far, after each batch of BATCHES (forward and backward)."""
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, fullgraph=True, backend=counter, dynamic=dynamic)
    counts = []
    for lengths in BATCHES:
        outs = compiled(*make_inputs(lengths))
        _loss(outs, [1.0] * len(outs)).backward()
        counts.append(counter.frame_count)
    return counts


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
def test_new_lengths_recompile_at_most_once(dynamic):
    """Automatic dynamic shapes (the default): the first batch compiles with static sizes, the first batch
    of other sizes once more with symbolic ones (batch size, rows, max_len), no later batch. dynamic=True:
    nothing compiles after the first batch."""
    params = [p.requires_grad_() for p in _attention_params(torch.float32)]
    make = lambda lengths: [random_jagged(lengths, (E,), requires_grad=True)]
    counts = _compiles_per_batch(lambda x: attention_block(x, *params), make, dynamic)
    first = counts[0]
    assert counts == [first] + [first + (dynamic is None)] * (len(BATCHES) - 1)


def test_ragged_ops_new_lengths_recompile_at_most_once():
    w = torch.randn(E, 4, device=DEVICE, requires_grad=True)

    def make(lengths):
        x = random_jagged(lengths, (E,), requires_grad=True)
        return [x, w, torch.randn(len(lengths), 4, 4, device=DEVICE, requires_grad=True)]

    counts = _compiles_per_batch(ragged_ops, make, None)
    assert counts == [1] + [2] * (len(BATCHES) - 1)


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic", "dynamic"])
def test_max_lengths_passed_as_ints_recompile_at_most_once(dynamic):
    """flash_attn_varlen_func's max_seqlen (the transformers packed path passes it) and pad_input's sizes are host
    ints: symbolic under torch.compile, they stay symbolic (host_int fixed them to each batch's value, and every new
    max length compiled a graph of its own, 7 for 7 batches: stop 59's compile fuzz)."""
    from varlen.bert_padding import pad_input
    from varlen.flash_attn_interface import flash_attn_varlen_func

    def fn(q, cu, longest, indices, rows):
        out = flash_attn_varlen_func(q, q, q, cu, cu, longest, longest, causal=True)
        return pad_input(out, indices, rows, 1)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, fullgraph=True, backend=counter, dynamic=dynamic)
    counts = []
    for lengths in BATCHES + [[8, 1], [10, 3]]:
        total = sum(lengths)
        cu = torch.tensor([0, *lengths], device=DEVICE).cumsum(0).to(torch.int32)
        q = torch.randn(total, HEADS, 4, device=DEVICE)
        indices = torch.arange(total, device=DEVICE)
        got = compiled(q, cu, max(lengths), indices, total)
        assert_close(got, fn(q, cu, max(lengths), indices, total))
        counts.append(counter.frame_count)
    assert counts[2:] == [counts[1]] * (len(counts) - 2), counts  # (nothing after the second batch)


def _unbacked(x):
    """``x`` with its rows and its offsets marked unbacked for torch.compile (README, "torch.compile")."""
    torch._dynamo.decorators.mark_unbacked(x.values, 0)
    torch._dynamo.decorators.mark_unbacked(x.offsets, 0)
    return x


UNBACKED_BATCHES = ([3, 5, 2], [1], [0, 0], [7], [4, 9])  # (10 rows, 1 row, none, one sequence, 13 rows)


def test_rows_marked_unbacked_keep_one_graph_for_batches_of_zero_and_one_row():
    """torch.compile gives sizes 0 and 1 graphs of their own (its 0/1 specialization) unless the size is marked
    unbacked. With the values' rows and the offsets marked so, batches of 0 and 1 rows and of one sequence reuse the
    graph (the attention's int32 bound on the rows, which compared the unbacked total on the host and raised, is
    checked as the graph runs)."""
    params = [p.requires_grad_() for p in _attention_params(torch.float32)]
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda x: attention_block(x, *params), fullgraph=True, backend=counter, dynamic=True)
    counts = []
    for lengths in UNBACKED_BATCHES:
        x = _unbacked(random_jagged(lengths, (E,), requires_grad=True))
        outs = compiled(x)
        for got, want in zip(outs, attention_block(x, *params), strict=True):
            assert_close(_values(got), _values(want))
        _loss(outs, [1.0] * len(outs)).backward()
        counts.append(counter.frame_count)
    assert counts == [counts[0]] * len(counts), counts


@pytest.mark.parametrize("name", ["sum", "alibi"])
def test_sums_and_alibi_keep_one_graph_for_one_sequence_where_the_offsets_are_unbacked(name):
    """A sum over the ragged dim and (H,) ALiBi slopes broadcast over the batch: a batch of one sequence compiles a
    graph of its own (torch's 0/1 specialization of the batch size, as in its own ops), unless the offsets too are
    marked unbacked."""
    slopes = torch.tensor([0.5, 0.25], device=DEVICE)
    fns = {"sum": lambda x: varlen.sum(x, 1),
           "alibi": lambda x: varlen.attention(x, x, x, alibi_slopes=slopes).values}
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fns[name], fullgraph=True, backend=counter, dynamic=True)
    counts = []
    for lengths in UNBACKED_BATCHES:
        x = _unbacked(random_jagged(lengths, (HEADS, 16)))  # (16: no size of the first batch's, for duck sizing)
        assert_close(compiled(x), fns[name](x))
        counts.append(counter.frame_count)
    assert counts == [counts[0]] * len(counts), counts


def test_a_jagged_bias_wider_than_the_longest_sequence_keeps_the_graph():
    """A jagged call's bias may be wider than its longest sequence. Checking its width against max_len as "equal, or
    wider where jagged" guarded on the equality: one graph for a bias as wide as max_len, another for a wider one."""
    compiled = torch.compile(lambda x, bias: varlen.attention(x, x, x, bias=bias).values, fullgraph=True,
                             backend=(counter := CompileCounterWithBackend("aot_eager")))
    counts = []
    for lengths, extra in (([3, 5, 2], 0), ([4, 6, 1, 2], 0), ([2, 7, 3], 2), ([5, 3], 0), ([6, 2, 2, 1, 4], 3)):
        x = random_jagged(lengths, (HEADS, 4))
        width = max(lengths) + extra
        bias = torch.randn(len(lengths), HEADS, width, width, device=DEVICE)
        assert_close(compiled(x, bias), varlen.attention(x, x, x, bias=bias).values)
        counts.append(counter.frame_count)
    assert counts[2:] == [counts[1]] * (len(counts) - 2), counts  # (nothing after the second batch)


def test_a_changing_scale_keeps_one_graph():
    """A softmax scale that changes between calls (symbolic from the second call on, as a module's float attribute is
    under dynamic shapes) is checked without math.isfinite, which broke the graph there (fullgraph=True raised)."""
    compiled = torch.compile(lambda x, scale: varlen.attention(x, x, x, scale=scale).values, fullgraph=True,
                             backend="aot_eager")
    x = random_jagged([3, 5], (HEADS, 4))
    for scale in (0.3, 0.4, 1.5):
        assert_close(compiled(x, scale), varlen.attention(x, x, x, scale=scale).values)


@pytest.mark.parametrize("name", ["sum", "sum over two dims", "inner sum", "softmax", "select"])
def test_dims_as_dynamic_int_arguments_keep_one_graph(name):
    """A dim passed as an int argument of a function compiled with dynamic shapes is symbolic; the ops take it as a
    constant (the graph guards on it). Sets, sorts and `in` over symbolic dims failed the sum's fullgraph trace."""
    fns = {"sum": lambda x, d: varlen.sum(x, d), "sum over two dims": lambda x, d: varlen.sum(x, (d, d + 1)),
           "inner sum": lambda x, d: varlen.sum(x, d + 1).values, "softmax": lambda x, d: varlen.softmax(x, d).values,
           "select": lambda x, d: varlen.select(x, d, -1, fill_value=0.0)}
    compiled = torch.compile(fns[name], fullgraph=True, backend="aot_eager", dynamic=True)
    x = random_jagged([3, 0, 5], (4, 2), device=DEVICE)
    assert_close(compiled(x, 1), fns[name](x, 1))


# ------------------------------------------------------------------------------- dropout compiled
def test_compiled_dropout_backward_replays_the_forward_mask():
    """out = A v for the dropped attention matrix A, so <out, dout> = <v, dv> exactly when the backward
    applies the forward's mask; the graph draws its seed from the default generator."""
    q = random_jagged([3, 6, 2], (HEADS, 4), dtype=torch.float64)
    k, v = (q.with_values(torch.randn_like(q.values)) for _ in range(2))
    v.values.requires_grad_()
    compiled = torch.compile(lambda q, k, v: varlen.attention(q, k, v, dropout_p=0.4).values, fullgraph=True,
                             backend="aot_eager")
    torch.manual_seed(5)
    out = compiled(q, k, v)
    torch.manual_seed(5)
    assert torch.equal(compiled(q, k, v), out)
    assert not torch.equal(compiled(q, k, v), out)
    dout = torch.randn_like(out)
    (dv,) = torch.autograd.grad(out, v.values, dout)
    assert torch.allclose((out * dout).sum(), (v.values * dv).sum(), rtol=1e-12, atol=0)
    assert not torch.allclose(out, varlen.attention(q, k, v).values)


def test_compiled_dropout_with_a_generator_runs_the_draw_eagerly():
    """A generator can't be drawn from inside a graph: fullgraph=True says so; otherwise dynamo breaks the
    graph there and the draw runs eagerly, giving eager's mask."""
    q = random_jagged([3, 2], (HEADS, 4), dtype=torch.float64)
    g = torch.Generator(device=DEVICE)
    fn = lambda q: varlen.attention(q, q, q, dropout_p=0.3, generator=g).values
    with pytest.raises(Exception, match="generator: not supported inside torch.compile"):
        torch.compile(fn, fullgraph=True, backend="aot_eager")(q)
    g.manual_seed(3)
    want = fn(q)
    g.manual_seed(3)
    assert torch.equal(torch.compile(fn, backend="aot_eager")(q), want)


# ------------------------------------------------------------------------------------ opcheck
def _opchecks(backend: str) -> tuple[str, ...]:
    """All of opcheck's checks; under the Triton interpreter only the fake-vs-real one (shapes, strides,
    dtypes of the outputs): the others test the op's registration, which the torch backend covers."""
    if backend == "triton" and not ON_GPU:
        return ("test_faketensor",)
    return ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _attention_args(q, k, v, *, bias=None, causal=False, window=None, backend="torch"):
    """The op's arguments for one ``varlen.attention`` call, as ``attention_function`` builds them."""
    call = api.prepare(q, k, v, causal=causal, window=window, align="top_left", scale=None, bias=bias,
                        alibi_slopes=None, softcap=0.0, dropout_p=0.0, generator=None, deterministic=False,
                        backend=backend)
    qt, kt, vt, bias, alibi, problem, opts, impl, seed = call.args
    extras, primitives = function.flatten(alibi, problem, opts, impl.NAME, seed)
    return (qt, kt, vt, bias, extras, *primitives)


def _dense(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, device=DEVICE, requires_grad=True)


ATTENTION_CASES = {
    "dense": lambda: (_dense(2, 5, 2, 8), _dense(2, 6, 2, 8), _dense(2, 6, 2, 4)),
    "jagged_gqa": lambda: (random_jagged([3, 0, 5], (4, 8), requires_grad=True),
                           random_jagged([2, 4, 1], (2, 8), requires_grad=True),
                           random_jagged([2, 4, 1], (2, 8), requires_grad=True)),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["dense", "jagged_gqa", "dense_bias", "jagged_causal_window"])
def test_attention_ops_opcheck(case, backend):
    kwargs = {}
    if case == "dense_bias":
        q, k, v = ATTENTION_CASES["dense"]()
        kwargs["bias"] = _dense(2, 1, 5, 6)
    elif case == "jagged_causal_window":
        q, k, v = ATTENTION_CASES["jagged_gqa"]()
        kwargs.update(causal=True, window=(1, None))
    else:
        q, k, v = ATTENTION_CASES[case]()
    if not isinstance(q, torch.Tensor):
        v = k.with_values(v.values)  # v shares k's offsets
    args = _attention_args(q, k, v, backend=backend, **kwargs)
    checks = _opchecks(backend)
    torch.library.opcheck(torch.ops.varlen.attention_forward.default, args, test_utils=checks)

    out, lse = torch.ops.varlen.attention_forward(*args)
    assert out.shape == (*args[0].shape[:-1], args[2].shape[-1]) and lse.dtype == torch.float32
    detach = lambda a: a.detach() if isinstance(a, torch.Tensor) else a  # noqa: E731
    q, k, v, bias, extras, *primitives = args
    need_bias = bias is not None
    for dlse in (None, torch.randn_like(lse)):
        backward_args = (torch.randn_like(out), dlse, detach(q), detach(k), detach(v), out.detach(), lse.detach(),
                         detach(bias), [detach(e) for e in extras], *primitives, [True, True, True, need_bias])
        torch.library.opcheck(torch.ops.varlen.attention_backward.default, backward_args, test_utils=checks)
    grads = torch.ops.varlen.attention_backward(*backward_args)
    assert [g.shape for g in grads] == [t.shape for t in args[:3]] + ([bias.shape] if need_bias else [])


def test_attention_op_boundary_rebuilds_problem_and_options():
    """Every Problem/AttentionOptions field crosses the op boundary: function.flatten/rebuild are inverses."""
    q, k, v = ATTENTION_CASES["jagged_gqa"]()
    v = k.with_values(v.values)
    bias = torch.randn(3, 1, 5, 4, device=DEVICE)
    call = api.prepare(q, k, v, causal=True, window=(3, None), align="bottom_right", scale=0.3, bias=bias,
                        alibi_slopes=torch.rand(4, device=DEVICE), softcap=2.0, dropout_p=0.25, generator=None,
                        deterministic=True, backend="torch")
    qt, kt, vt, bias, alibi, problem, opts, impl, seed = call.args
    extras, primitives = function.flatten(alibi, problem, opts, impl.NAME, seed)
    assert len(extras) == len(function.EXTRA_TENSORS)
    got_alibi, got_problem, got_opts, backend, got_seed = function.rebuild(qt, kt, vt, extras, primitives)
    assert got_alibi is alibi and got_opts == opts and backend == impl.NAME
    for field in dataclasses.fields(Problem):
        got, want = getattr(got_problem, field.name), getattr(problem, field.name)
        assert got is want or got == want, field.name
    assert (got_seed.seed, got_seed.offset) == tuple(seed.tolist())


def _jagged_op_cases(backend):
    x = random_jagged([3, 0, 6], (4,))
    offsets, total, max_len = x.offsets, x.total, x.max_len
    values = x.values
    padded = torch.randn(3, max_len, 4, device=DEVICE)
    y = torch.softmax(torch.randn_like(values), 0)
    return {
        "jagged_to_padded": (values, offsets, max_len + 1, -1.5, backend),
        "padded_to_jagged": (padded, offsets, total, max_len, backend),
        "ragged_softmax_forward": (values, offsets, max_len, backend),
        "ragged_softmax_backward": (y, torch.randn_like(y), offsets, max_len, backend),
        "segment_sum": (values, offsets, max_len, False, backend),
        "segment_mean": (y, torch.tensor([0, 4, 5, 9], dtype=torch.int32, device=DEVICE), 4, True, backend),
        "broadcast_rows": (torch.randn(3, 4, device=DEVICE), offsets, total, max_len, False, backend),
        "gather_position": (values, offsets, -1, 7.0, backend),
        "scatter_position": (torch.randn(3, 4, device=DEVICE), offsets, total, 1, backend),
        "grouped_matmul": (values, offsets, max_len, torch.randn(3, 4, 5, device=DEVICE), backend),
        "transposed_matmul": (values, torch.randn(total, 5, device=DEVICE), offsets, max_len, backend),
        "rotary": (values.view(-1, 1, 4), torch.arange(total, device=DEVICE), torch.tensor([1.0, 0.1], device=DEVICE),
                   -1, backend, 0),
        # positions counted from the offsets (varlen.rotary's call)
        "rotary_offsets": (values.view(-1, 1, 4), offsets, torch.tensor([1.0, 0.1], device=DEVICE), 1, backend,
                           max_len),
        # heads-major rows (the kernel's output, and the fake's, are contiguous whatever the input's layout)
        "rotary_heads_major": (torch.randn(2, total, 4, device=DEVICE).transpose(0, 1),
                               torch.arange(total, device=DEVICE), torch.tensor([1.0, 0.1], device=DEVICE), 1,
                               backend, 0),
    }


JAGGED_OPS = ["jagged_to_padded", "padded_to_jagged", "ragged_softmax_forward", "ragged_softmax_backward",
              "segment_sum", "segment_mean", "broadcast_rows", "gather_position", "scatter_position",
              "grouped_matmul", "transposed_matmul", "rotary", "rotary_offsets", "rotary_heads_major"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", JAGGED_OPS)
def test_jagged_ops_opcheck(name, backend):
    args = _jagged_op_cases(backend)[name]
    # (a mean over no rows is NaN: no empty sequence)
    op = {"segment_mean": "segment_sum", "rotary_offsets": "rotary", "rotary_heads_major": "rotary"}.get(name, name)
    torch.library.opcheck(getattr(torch.ops.varlen, op).default, args, test_utils=_opchecks(backend))


@pytest.mark.skipif(not TRITON_RUNS, reason="these custom ops are the ops' Triton paths")
@pytest.mark.parametrize("name", ["swiglu_forward", "swiglu_backward", "silu_mul_forward", "silu_mul_backward",
                                  "rotary_tables", "cross_entropy_forward", "cross_entropy_backward", "norm_forward",
                                  "norm_backward", "rms_norm_forward", "rms_norm_backward"])
def test_triton_only_ops_opcheck(name):
    rows = torch.randn(7, 3, 10, device=DEVICE)[:, 1]  # rows 30 apart
    half, grad = rows[:, :5], torch.randn(7, 5, device=DEVICE)
    targets = torch.tensor([0, 9, -100, 3, 3, 1, 2], device=DEVICE)
    args = {"swiglu_forward": (rows,), "swiglu_backward": (rows, grad), "silu_mul_forward": (half, rows[:, 5:]),
            "silu_mul_backward": (half, rows[:, 5:], torch.randn(5, 7, device=DEVICE).t()),  # a transposed grad
            "rotary_tables": (torch.randn(7, 2, 10, device=DEVICE)[..., :8], torch.rand(7, 8, device=DEVICE),
                              torch.rand(7, 8, device=DEVICE), -1),
            "cross_entropy_forward": (rows, targets, -100),
            "cross_entropy_backward": (rows, targets, torch.rand(7, device=DEVICE), torch.rand(7, device=DEVICE) + 2,
                                       torch.tensor(0.5, device=DEVICE).expand(7), -100),
            "norm_forward": (rows, torch.rand(10, device=DEVICE), torch.rand(10, device=DEVICE), 1e-5, True),
            "norm_backward": (rows, torch.rand(10, device=DEVICE), torch.randn(10, 7, device=DEVICE).t(),
                              torch.randn(7, device=DEVICE), torch.rand(7, device=DEVICE) + 1, True, True, True),
            # RMS norm without a weight (no mean; the bias's gradient alone is not asked for)
            "rms_norm_forward": (rows, None, None, 1e-5, False),
            "rms_norm_backward": (rows, None, grad.repeat(1, 2), torch.empty(0, device=DEVICE),
                                  torch.rand(7, device=DEVICE) + 1, False, False, False)}[name]
    op = name.removeprefix("rms_")
    torch.library.opcheck(getattr(torch.ops.varlen, op).default, args, test_utils=_opchecks("triton"))


REFUSED = [
    ("swiglu_forward", lambda: (torch.randn(4, 5),), "x: expected (N, 2F) rows, got shape (4, 5)"),
    ("silu_mul_forward", lambda: (torch.randn(4, 5), torch.randn(4, 6)), "up: expected gate's (N, F) shape (4, 5)"),
    ("silu_mul_backward", lambda: (torch.randn(4, 5), torch.randn(4, 5), torch.randn(3, 5)), "grad: expected gate's"),
    ("rotary_tables", lambda: (torch.randn(4, 2, 6), torch.randn(2, 6), torch.randn(4, 6), 1),
     "cos: expected a table of shape (4, >= 3)"),
    ("cross_entropy_forward", lambda: (torch.randn(3, 4), torch.zeros(2, dtype=torch.int64), -100),
     "targets: expected shape (3,), one entry per row of logits; got (2,)"),
    ("cross_entropy_backward", lambda: (torch.randn(3, 4), torch.zeros(3, dtype=torch.int64), torch.zeros(3),
                                        torch.zeros(3), torch.ones(1), -100), "row_scale: expected shape (3,)"),
    ("norm_forward", lambda: (torch.randn(3, 4), torch.ones(5), None, 1e-5, False), "weight: expected shape (4,)"),
    ("norm_forward", lambda: (torch.randn(3, 9000), None, None, 1e-5, False), "x: expected (N, F) rows with 0 < F"),
    ("norm_forward", lambda: (torch.randn(8), None, None, 1e-5, False), "x: expected (N, F) rows with 0 < F"),
    ("norm_backward", lambda: (torch.randn(3, 4), None, torch.randn(3, 4), torch.zeros(3), torch.ones(2), True,
                               False, False), "rstd: expected shape (3,)"),
    ("rotary_tables", lambda: (torch.randn(2, 1, 5), torch.ones(2, 2), torch.zeros(2, 2), 1),
     "x: rotary embeddings turn pairs of the last dim, which must be even"),
    # The jagged ops' Triton paths (each op also has a torch one): operands that disagree with the offsets or with
    # each other.
    ("rotary", lambda: (torch.randn(5, 2, 8), torch.arange(2), torch.ones(4), 1, "triton", 0),
     "positions: expected a 1-D tensor of one position per row of x; got shape (2,)"),
    ("rotary", lambda: (torch.randn(5, 2, 8), torch.tensor([0]), torch.ones(4), 1, "triton", 0),
     "positions: expected a 1-D tensor of one position per row of x"),
    ("rotary", lambda: (torch.randn(5, 2, 8), torch.zeros(0, dtype=torch.int64), torch.ones(4), 1, "triton", 3),
     "positions: expected a 1-D tensor of offsets (width > 0)"),
    ("rotary", lambda: (torch.randn(5, 2, 8), torch.arange(5), torch.ones(3), 1, "triton", 0),
     "inv_freq: expected one frequency per pair of the last dim, at least 4; got shape (3,)"),
    ("rotary", lambda: (torch.randn(5, 2, 7), torch.arange(5), torch.ones(4), 1, "triton", 0),
     "x: rotary embeddings turn pairs of the last dim, which must be even"),
    ("padded_to_jagged", lambda: (torch.randn(1, 3, 4), torch.tensor([0, 2, 5]), 5, 3, "triton"),
     "padded: expected 2 rows, one per sequence of offsets; got shape (1, 3, 4)"),
    ("ragged_softmax_backward", lambda: (torch.rand(5, 4), torch.rand(2, 4), torch.tensor([0, 2, 5]), 3, "triton"),
     "dy: expected y's shape (5, 4), got (2, 4)"),
    ("grouped_matmul", lambda: (torch.rand(5, 4), torch.tensor([0, 2, 5]), 3, torch.rand(2, 2, 3), "triton"),
     "w: expected (B, K, N) matrices with K = 4, x's columns; got shape (2, 2, 3)"),
    ("grouped_matmul", lambda: (torch.rand(5, 4), torch.tensor([0, 2, 5]), 3, torch.rand(1, 4, 3), "triton"),
     "w: expected 2 rows, one (K, N) matrix per sequence of offsets; got shape (1, 4, 3)"),
    ("transposed_matmul", lambda: (torch.rand(5, 4), torch.rand(2, 3), torch.tensor([0, 2, 5]), 3, "triton"),
     "y: expected 5 rows, one per row of x; got shape (2, 3)"),
    ("grouped_matmul", lambda: (torch.rand(5, 4), torch.tensor([0, 2, 5]), 3, torch.rand(2, 4), "triton"),
     "w: expected 3 dims (B, K, N), got shape (2, 4)"),
    ("broadcast_rows", lambda: (torch.ones(1, 4), torch.tensor([0, 2, 5]), 5, 3, False, "triton"),
     "g: expected 2 rows, one per sequence of offsets; got shape (1, 4)"),
    ("scatter_position", lambda: (torch.ones(4, 1), torch.tensor([0, 2, 5]), 5, 0, "triton"),
     "g: expected 2 rows, one per sequence of offsets; got shape (4, 1)"),
]


@pytest.mark.parametrize("name, args, message", REFUSED, ids=[case[0] for case in REFUSED])
def test_custom_ops_refuse_operands_the_kernels_would_read_past(name, args, message):
    """Called directly (torch.ops.varlen.*), the custom ops check the shapes their kernels index by."""
    with pytest.raises(ValueError, match=re.escape(message)):
        getattr(torch.ops.varlen, name)(*args())


def test_cross_entropy_ops_refuse_float_targets():
    for name, args in (("cross_entropy_forward", (torch.randn(2, 4), torch.zeros(2), -100)),
                       ("cross_entropy_backward", (torch.randn(2, 4), torch.zeros(2), torch.zeros(2), torch.zeros(2),
                                                   torch.ones(2), -100))):
        with pytest.raises(TypeError, match=re.escape("targets: expected integer class indices, got dtype "
                                                      "torch.float32")):
            getattr(torch.ops.varlen, name)(*args)


# Metadata and operands as views with other strides than the public API passes (offsets and tables it makes
# contiguous): each custom op's Triton path against its torch path, or against the same call on contiguous copies.
STRIDED_OFFSETS = [("segment_sum", lambda x, g, off: (x, off, 3, False)),
                   ("broadcast_rows", lambda x, g, off: (g, off, 5, 3, False)),
                   ("ragged_softmax_forward", lambda x, g, off: (x, off, 3)),
                   ("ragged_softmax_backward", lambda x, g, off: (x.softmax(0), x, off, 3)),
                   ("gather_position", lambda x, g, off: (x, off, 1, 0.0)),
                   ("scatter_position", lambda x, g, off: (g, off, 5, 1)),
                   ("jagged_to_padded", lambda x, g, off: (x, off, 3, 0.0)),
                   ("padded_to_jagged", lambda x, g, off: (torch.randn(2, 3, 3, device=DEVICE), off, 5, 3)),
                   ("grouped_matmul", lambda x, g, off: (x, off, 3, torch.randn(2, 3, 4, device=DEVICE))),
                   ("transposed_matmul", lambda x, g, off: (x, x, off, 3))]


@pytest.mark.skipif(not TRITON_RUNS, reason="the Triton paths")
@pytest.mark.parametrize("name, make", STRIDED_OFFSETS, ids=[case[0] for case in STRIDED_OFFSETS])
def test_custom_ops_take_strided_offsets(name, make):
    offsets = torch.tensor([0, 99, 2, 99, 5], device=DEVICE)[::2]  # (0, 2, 5), every other element
    x, g = torch.randn(5, 3, device=DEVICE), torch.randn(2, 3, device=DEVICE)
    op = getattr(torch.ops.varlen, name)
    args = make(x, g, offsets)
    assert_close(op(*args, "triton"), op(*args, "torch"))


@pytest.mark.skipif(not TRITON_RUNS, reason="the Triton paths")
def test_custom_ops_take_strided_operands():
    """A transposed softmax output into the backward, tables and frequencies read at a stride of 2."""
    offsets = torch.tensor([0, 3, 7], device=DEVICE)
    y, dy = torch.rand(4, 7, device=DEVICE).t(), torch.randn(7, 4, device=DEVICE)
    ops = torch.ops.varlen
    assert_close(ops.ragged_softmax_backward(y, dy, offsets, 4, "triton"),
                 ops.ragged_softmax_backward(y, dy, offsets, 4, "torch"))
    x = torch.randn(5, 2, 8, device=DEVICE)
    cos, sin = (torch.randn(5, 8, device=DEVICE)[:, ::2] for _ in range(2))
    assert torch.equal(ops.rotary_tables(x, cos, sin, 1), ops.rotary_tables(x, cos.contiguous(), sin.contiguous(), 1))
    inv_freq = torch.tensor([1.0, 9, 0.1, 9, 0.01, 9, 0.001, 9], device=DEVICE)[::2]
    positions = torch.arange(5, device=DEVICE)
    assert_close(ops.rotary(x, positions, inv_freq, 1, "triton", 0), ops.rotary(x, positions, inv_freq, 1, "torch", 0))


def test_norm_ops_refuse_integers():
    with pytest.raises(TypeError, match=re.escape("x: dtype int32 is not supported")):
        torch.ops.varlen.norm_forward(torch.ones(2, 4, dtype=torch.int32), None, None, 1e-5, False)
    with pytest.raises(TypeError, match=re.escape("weight: dtype int64 is not supported")):
        torch.ops.varlen.norm_forward(torch.ones(2, 4), torch.ones(4, dtype=torch.int64), None, 1e-5, False)


def test_eager_jagged_ops_skip_the_custom_ops_and_dispatch_modes_see_them(monkeypatch):
    """The jagged ops call their implementations directly in eager (the custom ops' Python dispatch costs host
    time); under a dispatch mode (fake tensors, tracing, FLOP counters) they go through the custom ops."""
    from torch.utils._python_dispatch import TorchDispatchMode

    x = random_jagged([3, 0, 5], (2,), requires_grad=True)
    w = torch.randn(3, 2, 4, device=DEVICE, requires_grad=True)
    custom_ops = {  # module: the custom ops it calls
        "varlen.ops.softmax": ("_softmax_fwd_op", "_softmax_bwd_op"),
        "varlen.ops.reduce": ("_segment_sum_op", "_broadcast_rows_op"),
        "varlen.padding": ("_to_padded_op", "_from_padded_op"),
        "varlen.ops.select": ("_gather_op", "_scatter_op"),
        "varlen.ops.linear": ("_grouped_matmul_op", "_transposed_matmul_op"),
        "varlen.ops.rotary": ("_rotate_op",),
        "varlen.ops.swiglu": ("_swiglu_fwd_op", "_swiglu_bwd_op"),
        "varlen.ops._norm_kernels": ("_norm_fwd_op", "_norm_bwd_op"),
    }
    ops = {"ragged_softmax_forward", "ragged_softmax_backward", "segment_sum", "broadcast_rows", "jagged_to_padded",
           "padded_to_jagged", "gather_position", "scatter_position", "grouped_matmul", "transposed_matmul",
           "rotary"} | ({"swiglu_forward", "swiglu_backward", "norm_forward", "norm_backward"}
                        if ROW_BACKEND == "triton" else set())
    seen = set()

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func.name().removeprefix("varlen::"))
            return func(*args, **(kwargs or {}))

    def run():
        x.values.grad = w.grad = None
        back = varlen.padding.padded_to_jagged(x.to_padded(), x.offsets, x.total, x.max_len)
        loss = (varlen.sum(x, 1).sum() + varlen.softmax(x, 1).values[:, 0].sum() + back.square().sum()
                + varlen.select(x, 1, -1, fill_value=0.0).sum() + varlen.matmul(x, w).values.square().sum()
                + varlen.rotary(x).values[:, 0].sum() + varlen.swiglu(x, backend=ROW_BACKEND).values.sum()
                + varlen.rms_norm(x, 2, backend=ROW_BACKEND).values[:, 0].sum())
        loss.backward()
        return x.values.grad, w.grad

    with Recorder():
        want = run()
    assert ops <= seen, ops - seen
    for module, names in custom_ops.items():
        for name in names:
            monkeypatch.setattr(importlib.import_module(module), name, None)  # a call through them would fail
    got = run()
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])


def test_plain_backward_of_jagged_ops_applies_no_autograd_function(monkeypatch):
    """A backward whose gradient is another jagged op calls it directly unless autograd records (create_graph):
    the nested Function's apply costs host time; a double backward still goes through it (gradgradcheck in the
    op tests)."""
    x = random_jagged([3, 0, 5], (2,), requires_grad=True)
    w = torch.randn(3, 2, 4, device=DEVICE, requires_grad=True)
    padded = x.to_padded().detach().requires_grad_(True)
    outs = [varlen.sum(x, 1), varlen.select(x, 1, -1, fill_value=0.0), x.to_padded(),
            varlen.padding.padded_to_jagged(padded, x.offsets, x.total, x.max_len), varlen.matmul(x, w).values,
            varlen.rotary(x).values]
    applied = []
    apply = torch.autograd.Function.apply.__func__
    monkeypatch.setattr(torch.autograd.Function, "apply",
                        classmethod(lambda cls, *args: applied.append(cls.__name__) or apply(cls, *args)))
    loss = sum(out.square().sum() for out in outs)
    grads = torch.autograd.grad(loss, (x.values, w, padded), create_graph=True)
    assert {"_BroadcastRows", "_ScatterPosition", "_PaddedToJagged", "_JaggedToPadded", "_GroupedMatmul",
            "_TransposedMatmul", "_Rotary"} <= set(applied)
    applied.clear()
    plain = torch.autograd.grad(loss, (x.values, w, padded))
    assert applied == []
    for got, want in zip(plain, grads, strict=True):
        assert_close(got, want.detach())
