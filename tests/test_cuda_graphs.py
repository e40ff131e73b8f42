"""CUDA graphs: a forward + backward captured with ``torch.cuda.graph`` replays what eager computes on the inputs
copied in before each replay (attention dense and jagged, in cases that select the Gluon kernels on Hopper and
cases that select the Triton ones, and the jagged ops; jagged tensors built with ``validate=False``, whose
offsets check would sync), so does ``torch.compile(mode="reduce-overhead")``; with dropout the capture draws its
key on the GPU, so each replay applies a new mask; host reads of offsets (a JaggedTensor validated or without
max_len) refuse to be captured. Capture needs a GPU (tests/test_capture_errors.py checks the refusals anywhere)."""

import pytest
import torch

import varlen
from utils import assert_close, record_calls
from varlen.attn import api

pytestmark = pytest.mark.gpu_only

LENGTHS = [0, 1, 17, 1000, 300, 129]  # jagged cases: empty, single-row and long sequences, tile edges

CASES = {
    # (batch, length or None for jagged, H, Hkv, D, options): the Gluon kernels take the plain bf16 D64/128
    # calls, the Triton kernels the bias, deterministic and D40 ones.
    "dense D128 causal": (2, 512, 4, 4, 128, dict(causal=True)),
    "dense D64 GQA window": (2, 300, 8, 2, 64, dict(window=(64, 16))),
    "jagged D64 causal": (len(LENGTHS), None, 4, 4, 64, dict(causal=True)),
    "jagged D40 deterministic": (len(LENGTHS), None, 4, 2, 40, dict(causal=True, deterministic=True)),
    "dense D64 bias with grad": (2, 200, 4, 4, 64, dict(bias=True)),
}


def _inputs(case, seed):
    """Fresh (q, k, v, bias, dout) values of one case, bf16 on the GPU (the bias None unless the case has one)."""
    B, S, H, Hkv, D, opts = CASES[case]
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = (B, S) if S is not None else (sum(LENGTHS),)
    make = lambda *shape: torch.randn(*shape, generator=g, device="cuda").to(torch.bfloat16)  # noqa: E731
    q, k, v, dout = make(*rows, H, D), make(*rows, Hkv, D), make(*rows, Hkv, D), make(*rows, H, D)
    bias = make(1, H, S, S) if opts.get("bias") else None
    return q, k, v, bias, dout


def _attend(case, q, k, v, bias, offsets, dropout_p=0.0):
    opts = {n: o for n, o in CASES[case][5].items() if n != "bias"}
    if offsets is not None:
        q, k, v = (varlen.JaggedTensor(t, offsets, max(LENGTHS), validate=False) for t in (q, k, v))
    out = varlen.attention(q, k, v, bias=bias, dropout_p=dropout_p, **opts)
    return out if offsets is None else out.values


def _eager(case, values, offsets, dropout_p=0.0):
    """Output and gradients of q, k, v (and the bias) computed eagerly."""
    q, k, v, bias, dout = (t if t is None else t.clone().requires_grad_(i < 4) for i, t in enumerate(values))
    leaves = [t for t in (q, k, v, bias) if t is not None]
    out = _attend(case, q, k, v, bias, offsets, dropout_p)
    return [out.detach(), *torch.autograd.grad(out, leaves, dout)]


def _offsets(case):
    """The jagged cases' offsets (None for dense ones)."""
    if CASES[case][1] is not None:
        return None
    return torch.tensor([0, *LENGTHS], device="cuda").cumsum(0).to(torch.int32)


def _capture(step, leaves):
    """A CUDA graph of ``step()`` and what that returned, by PyTorch's recipe: warm-up steps on a side stream first
    (Triton compiles on the first calls; the allocator settles), and ``leaves``' gradients set to None before each
    step and the capture, so that the graph's backward makes them in its own memory."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for t in leaves:
                t.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    return graph, result


def _replay_on(graph, static, fresh):
    """Copy ``fresh`` values into the captured tensors ``static`` (None where a case has none), replay, wait."""
    with torch.no_grad():
        for t, new in zip(static, fresh, strict=True):
            if t is not None:
                t.copy_(new)
    graph.replay()
    torch.cuda.synchronize()


@pytest.mark.parametrize("case", list(CASES))
def test_captured_attention_replays_eager(case):
    """Capture once; each replay on new inputs gives eager's output and gradients (bitwise where the kernels are
    deterministic; within bf16 rounding where dQ is added atomically in any order)."""
    offsets = _offsets(case)
    static = [t if t is None else t.requires_grad_(i < 4) for i, t in enumerate(_inputs(case, 0))]
    q, k, v, bias, dout = static
    leaves = [t for t in (q, k, v, bias) if t is not None]

    def step():
        out = _attend(case, q, k, v, bias, offsets)
        out.backward(dout)
        return out

    graph, out = _capture(step, leaves)
    deterministic = CASES[case][5].get("deterministic", False)
    for seed in (1, 2):
        fresh = _inputs(case, seed)
        _replay_on(graph, static, fresh)
        got = [out.detach(), *(t.grad for t in leaves)]
        names = ("out", "dq", "dk", "dv", "dbias")[:len(got)]
        for name, a, b in zip(names, got, _eager(case, fresh, offsets), strict=True):
            if deterministic:
                assert torch.equal(a, b), f"{name}: replay differs from eager"
            else:
                assert_close(a, b, tol=4e-3, name=name)  # (bf16 rounding of sums added in another order)


def test_captured_jagged_ops_replay_eager():
    """Softmax over the ragged dim and a per-sequence sum, forward and backward, captured and replayed."""
    offsets = torch.tensor([0, *LENGTHS], device="cuda").cumsum(0)
    x = torch.randn(sum(LENGTHS), 8, 16, device="cuda", requires_grad=True)
    dy = torch.randn(len(LENGTHS), 8, 16, device="cuda")

    def run(values):
        y = varlen.softmax(varlen.JaggedTensor(values, offsets, max(LENGTHS), validate=False), dim=1)
        return varlen.sum(varlen.JaggedTensor(y.values * values, offsets, max(LENGTHS), validate=False), dim=1)

    def step():
        out = run(x)
        out.backward(dy)
        return out

    graph, out = _capture(step, [x])
    for _ in range(2):
        with torch.no_grad():
            x.copy_(torch.randn_like(x))
            dy.copy_(torch.randn_like(dy))
        graph.replay()
        torch.cuda.synchronize()
        leaf = x.detach().clone().requires_grad_(True)
        want = run(leaf)
        (want_grad,) = torch.autograd.grad(want, leaf, dy)
        assert_close(out, want, tol=1e-6, name="sum")  # (float32; a long sequence's sum may add in any order)
        assert_close(x.grad, want_grad, tol=1e-6, name="grad")


def test_compiled_with_cuda_graphs_matches_eager():
    """``torch.compile(mode="reduce-overhead")`` (CUDA graphs through Inductor) records the attention forward and
    backward without skipping, and its steps give eager's output and gradients."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    q, k, v = (torch.randn(2, 256, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def attend(q, k, v):
        return varlen.attention(q, k, v, causal=True)

    compiled = torch.compile(attend, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # (the first steps warm up; the later ones replay)
        torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            for t in (q, k, v):
                t.copy_(torch.randn_like(t))
        dout = torch.randn_like(q)
        out = compiled(q, k, v)
        got = [out.detach().clone(), *torch.autograd.grad(out, (q, k, v), dout)]
        want = _eager_plain(q, k, v, dout)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            assert_close(a, b, tol=4e-3, name=name)  # (bf16 rounding of dQ added in another order)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def _eager_plain(q, k, v, dout):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = varlen.attention(*leaves, causal=True)
    return [out.detach(), *torch.autograd.grad(out, leaves, dout)]


@pytest.mark.parametrize("case", ["dense D128 causal", "jagged D64 causal", "jagged D40 deterministic"])
def test_captured_dropout_draws_a_new_mask_each_replay(case, monkeypatch):
    """With dropout the capture draws its key on the GPU (from the default generator, which each replay advances):
    each replay applies another mask, and gives eager's output and gradients with that replay's key, read back from
    the graph's memory (the Gluon kernels and, at D40, the Triton ones)."""
    offsets = _offsets(case)
    static = [t if t is None else t.requires_grad_(i < 4) for i, t in enumerate(_inputs(case, 0))]
    q, k, v, bias, dout = static
    leaves = [t for t in (q, k, v, bias) if t is not None]
    drawn = record_calls(monkeypatch, api, "dropout_seed")

    def step():
        out = _attend(case, q, k, v, bias, offsets, dropout_p=0.2)
        out.backward(dout)
        return out

    graph, out = _capture(step, leaves)
    key_memory = drawn[-1]  # (the capture's own draw: the warm-up steps drew host keys)
    assert key_memory.is_cuda and key_memory.shape == (1,)
    keys = []
    for seed in (1, 2):
        fresh = _inputs(case, seed)
        _replay_on(graph, static, fresh)
        keys.append(int(key_memory))
        got = [out.detach(), *(t.grad for t in leaves)]
        with monkeypatch.context() as m:
            m.setattr(api, "dropout_seed", lambda *args: torch.tensor([keys[-1], 0]))  # that key, on the host
            want = _eager(case, fresh, offsets, dropout_p=0.2)
        for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
            if CASES[case][5].get("deterministic") or name == "out":
                assert torch.equal(a, b), f"{name}: replay differs from eager with its key"
            else:
                assert_close(a, b, tol=4e-3, name=name)  # (bf16 rounding of dQ added in another order)
    assert keys[0] != keys[1]


def test_captured_dropout_draws_from_a_registered_generator(monkeypatch):
    """A CUDA generator registered with the graph is the one each replay draws the key from (its seed then
    reproduces the replays' keys); one not registered, or reading a mask ahead, raises a ValueError naming the way
    out."""
    q = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        varlen.attention(q, q, q, dropout_p=0.3, generator=g)  # (warm-up outside the capture)
    torch.cuda.current_stream().wait_stream(side)
    unregistered = r"generator: this CUDA generator is not registered.*register_generator_state"
    with pytest.raises(ValueError, match=unregistered), torch.cuda.graph(torch.cuda.CUDAGraph()):
        varlen.attention(q, q, q, dropout_p=0.3, generator=g)
    ahead = r"dropout_p: 0\.3 while a CUDA graph is being captured.*outside the capture"
    with pytest.raises(ValueError, match=ahead), torch.cuda.graph(torch.cuda.CUDAGraph()):
        varlen.attention_dropout_mask(q, q, 0.3)
    drawn = record_calls(monkeypatch, api, "dropout_seed")
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(g)
    with torch.cuda.graph(graph):
        out = varlen.attention(q, q, q, dropout_p=0.3, generator=g)
    keys, outs = [], []
    for seed in (7, 7, None):
        if seed is not None:
            g.manual_seed(seed)
        graph.replay()
        torch.cuda.synchronize()
        keys.append(int(drawn[-1]))
        outs.append(out.clone())
    assert keys[0] == keys[1] != keys[2] and torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["float64", "bfloat16"])
def test_compiled_with_cuda_graphs_and_dropout(dtype):
    """``torch.compile(mode="reduce-overhead")`` records attention with dropout too (the graph draws the key on the
    GPU): no skips, a new mask on each step of the same inputs, the same mask again under the same
    ``torch.manual_seed``, and each step's backward applies its forward's mask: out = A v for the dropped attention
    matrix A, so <out, out> = <v, dv> for dout = out (float64, the PyTorch path: up to rounding; bf16, the kernels:
    to bf16's precision)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    q, k, v = (torch.randn(2, 128, 2, 64, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    compiled = torch.compile(lambda q, k, v: varlen.attention(q, k, v, causal=True, dropout_p=0.3),
                             mode="reduce-overhead", fullgraph=True)
    outs = []
    for seed in (None, None, None, 5, 5):  # (the first steps warm up; the later ones replay)
        if seed is not None:
            torch.manual_seed(seed)
        torch.compiler.cudagraph_mark_step_begin()
        out = compiled(q, k, v)
        dout = out.detach().clone()
        (dv,) = torch.autograd.grad(out, v, dout)
        outs.append(dout)
        torch.testing.assert_close((dout.double() * dout).sum(), (v.double() * dv).sum(),
                                   rtol=1e-10 if dtype == torch.float64 else 2e-2, atol=0)
    assert not torch.equal(outs[1], outs[2]) and torch.equal(outs[3], outs[4])
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@pytest.mark.parametrize("kwargs", [dict(max_len=7), dict(validate=False)], ids=["validate", "no_max_len"])
def test_host_reads_refuse_capture(kwargs):
    """A JaggedTensor that would read its CUDA offsets on the host inside a capture (to validate them, or to find
    max_len) raises a ValueError that names the way out, before the copy that would break the capture; a capture
    after it works."""
    values = torch.randn(7, 4, device="cuda")
    offsets = torch.tensor([0, 3, 7], device="cuda")
    graph = torch.cuda.CUDAGraph()
    refused = r"offsets: reading these CUDA offsets or lengths on the host .* validate=False"
    with pytest.raises(ValueError, match=refused), torch.cuda.graph(graph):
        varlen.JaggedTensor(values, offsets, **kwargs)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        doubled = varlen.JaggedTensor(values, offsets, 4, validate=False).values * 2
    graph.replay()
    assert torch.equal(doubled, values * 2)
