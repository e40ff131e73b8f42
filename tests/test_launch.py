"""``varlen._launch``: a kernel's launches skip Triton's binding only where Triton would launch the kernel it kept.

On the CPU: the key against Triton's specialization rules, and ``FastLaunch``'s routing with a stand-in kernel
(the interpreter has no compiled kernels to keep). On the GPU: real kernels, whose repeated launches go through
the kept kernel (no ``JITFunction.run``), new specializations (a misaligned pointer, integer classes) through
Triton again, with correct results each time.
"""

import collections
import copy
import importlib
import types

import pytest
import torch

from varlen import _launch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


def _key(*values):
    out = []
    for value in values:
        _launch._extend_key(out.append, [value])
    return tuple(out)


def test_key_tells_apart_what_triton_specializes():
    a = torch.zeros(64, dtype=torch.float16)
    # Integers: equal to 1, multiples of 16 and the rest; 32-bit, 64-bit and unsigned 64-bit widths.
    assert len({_key(v) for v in (1, 16, 17, 2**31, 2**31 + 1, 2**63 + 1)}) == 6
    assert _key(17) == _key(33) == _key(-3) and _key(16) == _key(4096)
    # Tensors: dtype and 16-byte alignment; not the size or the address beyond its alignment.
    assert _key(a) == _key(torch.zeros(1000, dtype=torch.float16))
    assert _key(a) != _key(a.float()) and _key(a) != _key(a[1:])
    assert _key(a) == _key(a[8:])
    # Floats are fp32 runtime values (any value), bools by value, None, strings and dtypes as they are.
    assert _key(0.5) == _key(3.0) != _key(1) and _key(True) != _key(False) != _key(None)
    assert _key(True) != _key(1) and _key(False) != _key(0) and _key(None) != _key(0.0)
    assert _key("zero") != _key("nan") and _key(torch.float16) != _key(torch.bfloat16)
    # Bundles: their type, length and fields; constexpr fields by value.
    pair = collections.namedtuple("Pair", "ptr stride")
    assert _key(pair(a, 64)) != _key((a, 64)) and _key(pair(a, 64)) != _key(pair(a, 65))
    assert _key((tl.constexpr(2),)) != _key((tl.constexpr(3),))
    with pytest.raises(_launch._Unkeyed):
        _key(object())


class _Compiled:
    """Stands in for a CompiledKernel: records launches through its launcher."""

    def __init__(self, backend="cuda"):
        self.launches = []
        self.function, self.packed_metadata = "function", "metadata"
        self.metadata = types.SimpleNamespace(target=types.SimpleNamespace(backend=backend))

    def run(self, *args):
        self.launches.append(args)


class _Kernel:
    """Stands in for a JITFunction ``(x, n, BLOCK: constexpr, scale=2.0)``: launches through Triton's path are
    recorded, each returning a new compiled kernel (or None, as a tool's stand-in for ``run`` does)."""

    def __init__(self, returns=True, backend="cuda"):
        def param(name, constexpr=False, default=None):
            return types.SimpleNamespace(name=name, is_constexpr=constexpr, has_default=default is not None,
                                         default=default)
        self.params = [param("x"), param("n"), param("BLOCK", constexpr=True), param("scale", default=2.0)]
        self.pre_run_hooks = []
        self.debug = None
        self.slow = []
        self.returns, self.backend = returns, backend

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.slow.append((grid, args, kwargs))
            return _Compiled(self.backend) if self.returns else None
        return run


@pytest.fixture
def stand_ins(monkeypatch):
    monkeypatch.setattr(_launch, "CompiledKernel", _Compiled)
    device = types.SimpleNamespace(current=0)
    monkeypatch.setattr(_launch, "driver", types.SimpleNamespace(active=types.SimpleNamespace(
        get_current_device=lambda: device.current, get_current_stream=lambda d: f"stream {d}")))
    return device


def test_a_key_seen_launches_the_kept_kernel_with_every_argument_in_order(stand_ins):
    kernel = _Kernel()
    fast = _launch.FastLaunch(kernel)
    x = torch.zeros(32)
    fast[(3,)](x, 17, BLOCK=64)
    assert len(kernel.slow) == 1
    compiled = next(iter(fast._kept.values()))[1]
    fast[(4, 2)](x, 33, BLOCK=64)
    assert len(kernel.slow) == 1
    # The grid padded to three dims, the stream of the current device, no launch hooks, then every parameter in
    # the kernel's order: the positional ones, the keyword ones in their places, the defaults.
    assert compiled.launches == [(4, 2, 1, "stream 0", "function", "metadata", None, None, None, x, 33, 64, 2.0)]


@pytest.mark.parametrize("change", ["int class", "alignment", "dtype", "constexpr", "constexpr type", "option",
                                    "option type", "default given", "debug knob", "kernel debug"])
def test_a_new_key_goes_through_triton(stand_ins, monkeypatch, change):
    kernel = _Kernel()
    fast = _launch.FastLaunch(kernel)
    x = torch.zeros(32)
    fast[(1,)](x, 17, BLOCK=64)
    call = {"int class": lambda: fast[(1,)](x, 16, BLOCK=64),
            "alignment": lambda: fast[(1,)](x[1:], 17, BLOCK=64),
            "dtype": lambda: fast[(1,)](x.double(), 17, BLOCK=64),
            "constexpr": lambda: fast[(1,)](x, 17, BLOCK=128),
            "constexpr type": lambda: fast[(1,)](x, 17, BLOCK=64.0),
            "option": lambda: fast[(1,)](x, 17, BLOCK=64, num_warps=8),
            "option type": lambda: fast[(1,)](x, 17, BLOCK=64, num_warps=4.0),
            "default given": lambda: fast[(1,)](x, 17, BLOCK=64, scale=1),
            "debug knob": lambda: fast[(1,)](x, 17, BLOCK=64),
            "kernel debug": lambda: fast[(1,)](x, 17, BLOCK=64)}[change]
    if change == "option type":
        fast[(1,)](x, 17, BLOCK=64, num_warps=4)
        kernel.slow.pop()
    if change == "debug knob":
        monkeypatch.setattr(triton.knobs.runtime, "debug", True)
    if change == "kernel debug":
        kernel.debug = True
    call()
    assert len(kernel.slow) == 2
    call()  # (kept now)
    assert len(kernel.slow) == 2


def test_triton_path_where_the_kept_kernel_cant_serve(stand_ins, monkeypatch):
    kernel = _Kernel()
    fast = _launch.FastLaunch(kernel)
    x = torch.zeros(32)
    fast[(1,)](x, 17, BLOCK=64)
    stand_ins.current = 1  # another current device
    fast[(1,)](x, 17, BLOCK=64)
    assert len(kernel.slow) == 2
    fast[(1,)](x, object(), BLOCK=64)  # an argument the key doesn't know
    fast[(1,)](x, 17, BLOCK=[64])  # an unhashable constexpr
    fast[(1,)](x, 17)  # a missing argument: Triton's error
    fast[(1,)](x, 17, 64, 1.0, 5)  # too many
    fast[(1,)](x, 17, BLOCK=64, x=x)  # one given twice
    assert len(kernel.slow) == 7
    fast[(1,)](x, 17, BLOCK=64)  # (kept for device 1 by its first call there: no Triton)
    assert len(kernel.slow) == 7
    fast[lambda meta: (1,)](x, 17, BLOCK=64)  # a grid given as a function
    assert len(kernel.slow) == 8
    kernel.pre_run_hooks.append(lambda *a, **k: None)
    fast[(1,)](x, 17, BLOCK=64)
    kernel.pre_run_hooks.clear()
    chain = types.SimpleNamespace(calls=[])  # (a hook chain, as Triton keeps them: empty, then one hook)
    monkeypatch.setattr(triton.knobs.runtime, "launch_exit_hook", chain)
    fast[(1,)](x, 17, BLOCK=64)
    assert len(kernel.slow) == 9  # (the pre-run hook's call; an empty chain hooks nothing)
    chain.calls.append(lambda *a: None)
    fast[(1,)](x, 17, BLOCK=64)
    monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a: None)
    fast[(1,)](x, 17, BLOCK=64)
    assert len(kernel.slow) == 11


def test_the_wrapper_passes_for_its_kernel(stand_ins):
    kernel = _Kernel()
    fast = _launch.FastLaunch(kernel)
    assert fast.params is kernel.params and fast.slow is kernel.slow  # (the kernel's attributes)
    twin = copy.copy(fast)  # (a copy starts without attributes: no endless lookup of its kernel)
    twin[(1,)](torch.zeros(4), 1, BLOCK=16)
    assert twin.kernel is kernel and len(kernel.slow) == 1


@pytest.mark.parametrize("kernel", [_Kernel(returns=False), _Kernel(backend="hip")],
                         ids=["no kernel returned", "ROCm"])
def test_nothing_kept_from_a_launch_without_a_cuda_kernel(stand_ins, kernel):
    # (tools/compile_check.py's run and the interpreter return none; ROCm's specialization also reads the storage size)
    fast = _launch.FastLaunch(kernel)
    for _ in range(2):
        fast[(1,)](torch.zeros(4), 1, BLOCK=16)
    assert len(kernel.slow) == 2 and fast._kept == {}


def test_kept_keys_stay_bounded_when_bundles_are_made_anew(stand_ins, monkeypatch):
    monkeypatch.setattr(_launch, "KEPT_LIMIT", 4)
    kernel = _Kernel()
    fast = _launch.FastLaunch(kernel)
    for _ in range(10):  # (an equal constexpr bundle, made for each call: a new identity, so a new key)
        fast[(1,)](torch.zeros(4), 1, BLOCK=(tl.constexpr(16),))
    assert len(kernel.slow) == 10 and len(fast._kept) <= 4


def test_only_jit_kernels_of_a_mirrored_triton_are_wrapped_unless_switched_off(monkeypatch):
    from triton.runtime.jit import JITFunction

    def kernel(x):
        pass

    jitted = JITFunction(kernel)  # (a compiled-launch kernel, whatever the interpreter flag)
    plain = object()
    assert _launch.fast_launch(plain) is plain
    monkeypatch.setattr(_launch, "_TRITON_VERSION", "3.5.1")
    assert _launch.fast_launch(jitted) is jitted
    monkeypatch.setattr(_launch, "_TRITON_VERSION", _launch.MIRRORED_TRITON[0] + "0")
    assert isinstance(_launch.fast_launch(jitted), _launch.FastLaunch)
    monkeypatch.setenv("VARLEN_FAST_LAUNCH", "0")
    assert _launch.fast_launch(jitted) is jitted


MIRRORED = pytest.mark.skipif(not triton.__version__.startswith(_launch.MIRRORED_TRITON),
                              reason=f"Triton {triton.__version__}: its launches go through JITFunction.run "
                                     f"(varlen._launch mirrors {_launch.MIRRORED_TRITON})")


@pytest.mark.gpu_only
@MIRRORED
def test_gpu_kept_kernels_launch_without_triton_and_new_specializations_compile(monkeypatch):
    from triton.runtime.jit import JITFunction

    swiglu = importlib.import_module("varlen.ops.swiglu")  # (the package's ``swiglu`` is the function)
    # (Other tests in this process, test_compile's, keep kernels of their own shapes: start from none kept.)
    monkeypatch.setattr(swiglu._swiglu_fwd_kernel, "_kept", {})

    slow = []
    run = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **k: slow.append(self.fn.__name__) or run(self, *a, **k))
    torch.manual_seed(0)
    # Features 64 (16-byte aligned halves, widths a multiple of 16) and 33 (the second half misaligned: a kernel
    # kept for aligned pointers would load it with 16-byte vectors), alternately.
    inputs = {f: torch.randn(257, 2 * f, device="cuda", dtype=torch.bfloat16) for f in (64, 33)}
    for round_ in range(3):
        slow.clear()
        for x in inputs.values():
            gate, up = x.float().chunk(2, dim=-1)
            torch.testing.assert_close(swiglu.swiglu_fwd_triton(x).float(), torch.nn.functional.silu(gate) * up,
                                       atol=2e-2, rtol=2e-2)
        torch.cuda.synchronize()
        if round_ > 0:
            assert slow == [], f"launches through JITFunction.run after the first round: {slow}"
    assert len(swiglu._swiglu_fwd_kernel._kept) == 2


@pytest.mark.gpu_only
@MIRRORED
def test_gpu_attention_steps_after_the_first_launch_kept_kernels(monkeypatch):
    from triton.runtime.jit import JITFunction

    import varlen

    slow = []
    run = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, **k: slow.append(self.fn.__name__) or run(self, *a, **k))
    q, k, v = (torch.randn(2, 100, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    outputs = []
    for step in range(3):
        slow.clear()
        out = varlen.attention(q, k, v, causal=True)
        out.backward(torch.ones_like(out))
        outputs.append((out.detach(), q.grad.clone()))
        q.grad = k.grad = v.grad = None
        if step > 0:  # (the forward, the preprocess and the kv kernel: every launch through the kept kernels)
            assert slow == [], f"launches through JITFunction.run after the first step: {slow}"
    for out, dq in outputs[1:]:  # (dQ is summed by atomic adds, in any order)
        assert torch.equal(out, outputs[0][0])
        torch.testing.assert_close(dq, outputs[0][1], atol=1e-2, rtol=1e-2)


def _triton_specialization(value):
    """What the installed Triton's binder makes of ``value`` as a kernel's one (specialized) argument, for sm_90."""
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import KernelParam, create_function_from_signature

    parameter = inspect.Parameter("x", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    binder = create_function_from_signature(inspect.Signature([parameter]), [KernelParam(0, parameter, False, False)],
                                            make_backend(GPUTarget("cuda", 90, 32)))
    return str(binder(value)[1])


def test_key_is_never_coarser_than_tritons_own():
    storage = torch.zeros(64, dtype=torch.float16)
    pair = collections.namedtuple("Pair", "a b")
    ints = [n + d for n in (0, 2**31, 2**32, 2**63, -2**31, -2**63) for d in (-17, -16, -1, 0, 1, 15, 16)]
    values = [*ints, True, False, 0.0, -2.5, None, storage, storage[1:], storage[8:], storage.float(),
              torch.nn.Parameter(storage.clone()), (1, 2), (1, 16), pair(1, 2), pair(storage, 3), pair(storage[1:], 3),
              ((1,), 2), ()]
    from triton.tools.tensor_descriptor import TensorDescriptor

    plane = torch.zeros(32, 64, dtype=torch.float16)
    boxes = ((plane, [16, 16]), (plane, [16, 32]), (plane.bfloat16(), [16, 16]), (plane[:16], [16, 16]))
    values += [TensorDescriptor.from_tensor(t, box) for t, box in boxes]
    values = [v for v in values if not (type(v) is int and not -2**63 <= v < 2**64)]
    keys = [_key(v) for v in values]
    tritons = [_triton_specialization(v) for v in values]
    for i in range(len(values)):
        for j in range(i):
            if keys[i] == keys[j]:
                assert tritons[i] == tritons[j], (values[i], values[j], tritons[i], tritons[j])
