"""Host time per ``varlen.attention`` call, where the GPU work is negligible (B2 S64 H4 D64 bf16, causal),
next to SDPA's: what small problems and short sequences pay on every call.

    PYTHONPATH=src python3 bench/host_overhead.py [--breakdown] [--shapes] [--graphs]

Prints microseconds of host time per call (forward; forward + backward), the mean over 300 calls after a
warm-up, with the GPU synchronized only at the ends. ``--breakdown`` also times one forward + backward step
level by level (each level wrapped in a timer, which adds about a microsecond per wrapped call): the public
call, the backend's forward and backward, the launchers, and each Triton launch. ``--shapes`` puts host time
beside GPU time at bench/attention.py's dense S1k shapes (where the two are close): host us per forward and per
forward + backward, TFLOP/s by bench/attention.py's own timing, and the step's kernels' GPU microseconds
(``torch.profiler``), in all and each; a row whose host time exceeds its kernels' time is host-bound.
``--graphs`` times one forward + backward step at the tiny shape and the S1k shapes eagerly and as a replay of a
``torch.cuda.graph`` capture of it (``do_bench``, GPU time per step): what capturing the step gives back where the
host is the bottleneck.
"""

import collections
import json
import sys
import time

import torch
import torch.nn.functional as F

import varlen
from cuda_graph import captured  # (bench/, the script's folder)


def host_us(fn, n: int = 300) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return round(host, 1)


def main():
    q = torch.randn(2, 64, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    qt = q.detach().transpose(1, 2).requires_grad_()
    rows = {
        "varlen fwd": host_us(lambda: varlen.attention(q, q, q, causal=True)),
        "varlen fwd+bwd": host_us(lambda: varlen.attention(q, q, q, causal=True).sum().backward()),
        "sdpa fwd": host_us(lambda: F.scaled_dot_product_attention(qt, qt, qt, is_causal=True)),
        "sdpa fwd+bwd": host_us(lambda: F.scaled_dot_product_attention(qt, qt, qt, is_causal=True).sum().backward()),
    }
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "host us per call": rows}))
    if "--breakdown" in sys.argv:
        print(json.dumps({"host us per fwd+bwd step, by level": breakdown(q)}))
    if "--shapes" in sys.argv:
        for shape in S1K_SHAPES:
            print(json.dumps(host_beside_gpu(*shape)), flush=True)
    if "--graphs" in sys.argv:
        for shape in [(2, 64, 4, 64, True), *S1K_SHAPES]:
            print(json.dumps(eager_beside_graph(*shape)), flush=True)


# (B, S, H, D, causal): bench/attention.py's dense S1k rows.
S1K_SHAPES = [(16, 1024, 32, 64, False), (16, 1024, 32, 64, True), (16, 1024, 16, 128, False),
              (16, 1024, 16, 128, True)]


def host_beside_gpu(B, S, H, D, causal) -> dict:
    """Host time of bench/attention.py's forward and forward + backward at one dense shape, beside its TFLOP/s
    (bench/attention.py's own timing) and the GPU time of the step's kernels."""
    from attention import time_fwd_bwd  # (bench/attention.py: this script's folder is on sys.path)

    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)

    def fwd():
        return varlen.attention(q, k, v, causal=causal)

    def fwd_bwd():
        for t in (q, k, v):
            t.grad = None
        fwd().backward(grad)

    timed = time_fwd_bwd(fwd, [q, k, v], 4 * B * H * S * S * D * (0.5 if causal else 1))
    if isinstance(timed, str):  # (time_fwd_bwd reports a failure as text, for its tables)
        raise RuntimeError(timed)
    tflops_fwd, tflops_bwd, _ = timed
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fwd_bwd()
        torch.cuda.synchronize()
    kernels = {e.key: round(e.device_time_total / 5, 1) for e in prof.key_averages() if e.device_time_total > 0}
    return {"shape": f"B{B} S{S} H{H} D{D}" + (" causal" if causal else ""), "host us fwd": host_us(fwd),
            "host us fwd+bwd": host_us(fwd_bwd), "TFLOP/s fwd / bwd": [round(tflops_fwd), round(tflops_bwd)],
            "kernel us per fwd+bwd": round(sum(kernels.values()), 1), "kernels": kernels}


def eager_beside_graph(B, S, H, D, causal) -> dict:
    """Microseconds per forward + backward step (bf16, grads reset each step), run eagerly and replayed from a
    CUDA graph of the same step, with the step's TFLOP/s (3.5x the forward's FLOPs) each way."""
    from triton.testing import do_bench

    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(q)

    def step():
        for t in (q, k, v):
            t.grad = None
        varlen.attention(q, k, v, causal=causal).backward(grad)

    eager, replay = do_bench(step), do_bench(captured(step))
    flops = 3.5 * 4 * B * H * S * S * D * (0.5 if causal else 1)
    return {"shape": f"B{B} S{S} H{H} D{D}" + (" causal" if causal else ""), "us per step eager": round(eager * 1e3, 1),
            "us per step graph": round(replay * 1e3, 1), "TFLOP/s eager / graph":
            [round(flops / eager / 1e9), round(flops / replay / 1e9)]}


def breakdown(q, n: int = 300) -> dict:
    """Microseconds per forward + backward step spent inside each level (levels nest: a launcher's time
    includes its kernel launches). A launch is ``launch: <kernel>`` (``varlen._launch.FastLaunch``, which launches
    a kernel it keeps without Triton's binding), inside it ``triton launch: <kernel>`` where it went through
    Triton's ``JITFunction.run`` (its first call with a new key, or every call where it can't keep the kernel)."""
    from triton.runtime import jit

    from varlen._launch import FastLaunch
    from varlen.attn import function
    from varlen.attn.triton import backend

    spent = collections.Counter()

    def timed(label, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter_ns()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter_ns() - t
        return wrapper

    run = jit.JITFunction.run

    def timed_run(self, *args, **kwargs):
        return timed("triton launch: " + self.fn.__name__, run)(self, *args, **kwargs)

    fast = FastLaunch.launch

    def timed_fast(self, *args, **kwargs):
        return timed("launch: " + self.kernel.fn.__name__, fast)(self, *args, **kwargs)

    patches = [(function, "run_forward", "run_forward (autograd Function's forward)"),
               (function, "run_backward", "run_backward (autograd Function's backward)"),
               (backend, "launch_forward", "launch_forward"), (backend, "launch_backward", "launch_backward"),
               (backend, "use_tma", "use_tma"), (backend.configs, "forward_config", "forward_config"),
               (backend.configs, "backward_config", "backward_config")]
    originals = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    try:
        for obj, name, label in patches:
            setattr(obj, name, timed(label, getattr(obj, name)))
        jit.JITFunction.run = timed_run
        FastLaunch.launch = timed_fast

        def step():
            t = time.perf_counter_ns()
            out = varlen.attention(q, q, q, causal=True)
            spent["varlen.attention (forward, with autograd)"] += time.perf_counter_ns() - t
            t = time.perf_counter_ns()
            out.sum().backward()
            spent["sum + backward()"] += time.perf_counter_ns() - t

        for _ in range(20):
            step()
        torch.cuda.synchronize()
        spent.clear()
        t = time.perf_counter()
        for _ in range(n):
            step()
        total = round((time.perf_counter() - t) / n * 1e6, 1)
        torch.cuda.synchronize()
    finally:
        for obj, name, fn in originals:
            setattr(obj, name, fn)
        jit.JITFunction.run = run
        FastLaunch.launch = fast
    return {"step": total, **{k: round(v / n / 1e3, 1) for k, v in sorted(spent.items())}}


if __name__ == "__main__":
    main()
