"""Benchmark of varlen's jagged ops over the ragged dim against torch.nested and padded dense PyTorch.

Run on a GPU machine:

    PYTHONPATH=src python3 bench/jagged_ops.py --out results.md

Ops: softmax over the ragged dim, sum over the ragged dim, jagged -> padded and padded -> jagged, rotary
embeddings (the features as heads of 64), SwiGLU (the features as a gate and an input), RMS and layer norm over
the features, each forward and backward. For every op the table gives the
median time (``triton.testing.do_bench``,
L2 flushed between runs), the bandwidth over the op's *minimal* bytes (each input read once, each
output written once, padding included only where it is the op's own output) and its share of the
device copy bandwidth measured in the same run; then the same op with ``torch.nested`` jagged
tensors and with padded dense PyTorch on the same data, over the same minimal bytes (so padding
the baselines process shows up as lower GB/s). On a GPU, varlen's row also gives its GPU time alone:
the same call replayed from a CUDA graph, which leaves out the host's time to issue it (the eager
median includes it where the host is slower than the kernel: a backward through ``autograd.grad``
costs about 60 us of host time before varlen's own work). ``--quick`` runs a tiny size on the CPU through
Triton's interpreter (no CUDA needed) to check that the script works; its timings mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

import triton  # noqa: E402

import varlen  # noqa: E402
from varlen.ops.rotary import rotary_torch  # noqa: E402
from varlen.padding import padded_to_jagged  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def bench(fn, device: torch.device) -> float:
    """Median milliseconds of ``fn()``."""
    if device.type == "cuda":
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def graph_ms(fn, stream: torch.cuda.Stream, calls: int = 10, replays: int = 20) -> float:
    """Median milliseconds of ``fn()`` replayed from a CUDA graph of ``calls`` calls on ``stream`` (where the
    inputs were made, so that autograd runs a backward there too)."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        graph.replay()
        end.record(stream)
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """GB/s of a device-to-device copy of ``nbytes`` (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), device)
    return 2 * nbytes / ms / 1e6


def grad_of(out: torch.Tensor, inp: torch.Tensor, g: torch.Tensor):
    """A backward step: the input gradient, materialized (an expanded gradient counts its writes)."""
    return lambda: torch.autograd.grad(out, inp, g, retain_graph=True)[0].contiguous()


def not_available(reason: str):
    return f"n/a ({reason})"


def try_case(make):
    """``make()`` returns a thunk to time; any failure (missing op, missing backward) becomes n/a."""
    try:
        fn = make()
        fn()
        return fn
    except Exception as exc:  # noqa: BLE001 - a missing op or backward is reported, not fatal
        return not_available(f"{type(exc).__name__}: {str(exc).splitlines()[0][:70]}")


def cases(x: varlen.JaggedTensor, padded: torch.Tensor, mask: torch.Tensor):
    """(op, direction, minimal bytes, {implementation: thunk or n/a reason})."""
    values = x.values
    B, F = x.batch_size, values.shape[1]
    W = padded.shape[1]
    e = values.element_size()
    n, dense_out = values.numel() * e, B * W * F * e
    offsets64 = x.offsets.to(torch.int64)

    def nested():
        return torch.nested.nested_tensor_from_jagged(values, offsets64, max_seqlen=x.max_len)

    g_values = torch.randn_like(values)
    g_batch = torch.randn(B, F, dtype=values.dtype, device=values.device)
    g_padded = torch.randn_like(padded)
    masked = padded.masked_fill(~mask, float("-inf"))
    rows = []

    # softmax over the ragged dim
    y = varlen.softmax(x, 1).values
    rows.append(("softmax", "fwd", 2 * n, {
        "varlen": lambda: varlen.softmax(x, 1),
        "torch.nested": try_case(lambda: lambda: nested().softmax(dim=1)),
        "padded dense": lambda: torch.softmax(padded.masked_fill(~mask, float("-inf")), 1),
    }))
    rows.append(("softmax", "bwd", 3 * n, {
        "varlen": grad_of(y, values, g_values),
        "torch.nested": try_case(lambda: grad_of(nested().softmax(dim=1).values(), values, g_values)),
        "padded dense": grad_of(torch.softmax(masked, 1), padded, g_padded),
    }))

    # sum over the ragged dim
    rows.append(("sum", "fwd", n + B * F * e, {
        "varlen": lambda: varlen.sum(x, 1),
        "torch.nested": try_case(lambda: lambda: nested().sum(dim=1)),
        "padded dense": lambda: padded.sum(1),
    }))
    rows.append(("sum", "bwd", B * F * e + n, {
        "varlen": grad_of(varlen.sum(x, 1), values, g_batch),
        "torch.nested": try_case(lambda: grad_of(nested().sum(dim=1), values, g_batch)),
        "padded dense": grad_of(padded.sum(1), padded, g_batch),
    }))

    # jagged -> padded (and its backward, padded gradient -> jagged)
    conversion = not_available("this op is the conversion itself")
    rows.append(("to_padded", "fwd", n + dense_out, {
        "varlen": lambda: x.to_padded(),
        "torch.nested": try_case(lambda: lambda: nested().to_padded_tensor(0.0)),
        "padded dense": conversion,
    }))
    rows.append(("to_padded", "bwd", 2 * n, {
        "varlen": grad_of(x.to_padded(), values, g_padded),
        "torch.nested": try_case(lambda: grad_of(nested().to_padded_tensor(0.0), values, g_padded)),
        "padded dense": conversion,
    }))

    # padded -> jagged (and its backward, jagged gradient -> padded)
    from_padded_nested = getattr(torch.nested._internal.nested_tensor, "nested_from_padded", None)

    def nested_from_padded():
        if from_padded_nested is None:
            raise NotImplementedError("torch.nested has no nested_from_padded")
        return from_padded_nested(padded, offsets64, max_seqlen=x.max_len, sum_S=x.total)

    rows.append(("from_padded", "fwd", 2 * n, {
        "varlen": lambda: padded_to_jagged(padded, x.offsets, x.total, x.max_len),
        "torch.nested": try_case(lambda: lambda: nested_from_padded()),
        "padded dense": conversion,
    }))
    rows.append(("from_padded", "bwd", n + dense_out, {
        "varlen": grad_of(padded_to_jagged(padded, x.offsets, x.total, x.max_len), padded, g_values),
        "torch.nested": try_case(lambda: grad_of(nested_from_padded().values(), padded, g_values)),
        "padded dense": conversion,
    }))

    # rotary embeddings, the features as heads of 64 (padded dense: transformers' Llama math on the padded
    # batch, positions past each sequence's end included)
    D = 64 if F % 64 == 0 else F
    heads = x.with_values(values.unflatten(-1, (-1, D)))
    padded_heads = padded.unflatten(-1, (-1, D))
    positions = torch.arange(W, device=values.device).repeat(B)
    freq = 1.0 / 10000.0 ** (torch.arange(D // 2, device=values.device, dtype=torch.float32) / (D // 2))

    def padded_rotary():
        return rotary_torch(padded_heads.flatten(0, 1), positions, freq, 1)
    rows.append(("rotary", "fwd", 2 * n, {
        "varlen": lambda: varlen.rotary(heads),
        "torch.nested": not_available("no rotary embedding op"),
        "padded dense": padded_rotary,
    }))
    rows.append(("rotary", "bwd", 2 * n, {
        "varlen": grad_of(varlen.rotary(heads).values, values, g_values.unflatten(-1, (-1, D))),
        "torch.nested": not_available("no rotary embedding op"),
        "padded dense": grad_of(padded_rotary(), padded, g_padded.unflatten(-1, (-1, D)).flatten(0, 1)),
    }))

    # SwiGLU, the features as a gate and an input of F / 2 each (torch: silu(gate) * up in its own ops)
    def torch_swiglu(t):
        gate, up = t.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    def nested_swiglu():
        return torch_swiglu(nested())
    rows.append(("swiglu", "fwd", 3 * n // 2, {
        "varlen": lambda: varlen.swiglu(x),
        "torch.nested": try_case(lambda: nested_swiglu),
        "padded dense": lambda: torch_swiglu(padded),
    }))
    g_half = g_values[:, :F // 2]
    rows.append(("swiglu", "bwd", 5 * n // 2, {
        "varlen": grad_of(varlen.swiglu(x).values, values, g_half),
        "torch.nested": try_case(lambda: grad_of(nested_swiglu().values(), values, g_half)),
        "padded dense": grad_of(torch_swiglu(padded), padded, g_padded[..., :F // 2]),
    }))

    # layer and RMS norm over the features (torch: its fused kernels; the backward asks for the weight's (and
    # bias's) gradient too, as training does)
    weight = torch.randn(F, dtype=values.dtype, device=values.device, requires_grad=True)
    bias = torch.randn(F, dtype=values.dtype, device=values.device, requires_grad=True)
    norms = {"rms_norm": (lambda t: varlen.rms_norm(t, F, weight, 1e-6),
                          lambda t: torch.nn.functional.rms_norm(t, (F,), weight, 1e-6), (weight,)),
             "layer_norm": (lambda t: varlen.layer_norm(t, F, weight, bias),
                            lambda t: torch.nn.functional.layer_norm(t, (F,), weight, bias), (weight, bias))}
    for name, (ours, theirs, params) in norms.items():
        def backward_of(out, inp, g, params=params):
            return lambda: torch.autograd.grad(out, (inp, *params), g, retain_graph=True)
        rows.append((name, "fwd", 2 * n, {
            "varlen": lambda ours=ours: ours(x),
            "torch.nested": try_case(lambda theirs=theirs: lambda: theirs(nested())),
            "padded dense": lambda theirs=theirs: theirs(padded),
        }))
        rows.append((name, "bwd", 3 * n, {
            "varlen": backward_of(ours(x).values, values, g_values),
            "torch.nested": try_case(lambda theirs=theirs: backward_of(theirs(nested()).values(), values, g_values)),
            "padded dense": backward_of(theirs(padded), padded, g_padded),
        }))
    return rows



def make_inputs(batch: int, min_len: int, max_len: int, inner: int, dtype: torch.dtype, device: torch.device):
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(min_len, max_len + 1, (batch,), generator=gen).tolist()
    x = varlen.jagged([torch.randn(n, inner, generator=gen) for n in lengths], device=device, dtype=dtype)
    x.values.requires_grad_(True)
    padded = x.to_padded().detach().requires_grad_(True)
    positions = torch.arange(x.max_len, device=device)
    mask = (positions[None, :] < x.lengths[:, None].to(device))[..., None]
    return x, padded, mask


def fmt(ms: float, nbytes: int, copy_gbs: float) -> tuple[str, str, str]:
    gbs = nbytes / ms / 1e6
    return f"{ms:.3f}", f"{gbs:.0f}", f"{100 * gbs / copy_gbs:.0f}%"


def run(args) -> str:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    copy_gbs = copy_bandwidth(device, args.copy_mb << 20)
    lines = [
        "# varlen jagged ops benchmark",
        "",
        f"- device: {name}",
        f"- torch {torch.__version__}, triton {triton.__version__}, varlen {varlen.__version__}",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- batch {args.batch}, lengths uniform in [{args.min_len}, {args.max_len}], inner {args.inner}",
        f"- device copy bandwidth ({args.copy_mb} MiB copy): {copy_gbs:.0f} GB/s",
        "- GB/s over each op's minimal bytes; % of the copy bandwidth; baselines over the same bytes",
        "- varlen GPU only: the same call replayed from a CUDA graph (no host time); ms and % of copy",
        "",
        "| op | dir | dtype | MB | varlen ms | GB/s | % copy | varlen GPU only | torch.nested ms (GB/s) "
        "| padded dense ms (GB/s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    # Everything on one side stream: a CUDA graph captures there, and autograd runs each backward on the stream
    # of its forward (so its timing events go there too).
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    with torch.cuda.stream(stream):
        for dtype_name in args.dtypes.split(","):
            lines += dtype_rows(args, dtype_name, copy_gbs, stream)
            if stream is not None:
                torch.cuda.empty_cache()
    return "\n".join(lines) + "\n"


def dtype_rows(args, dtype_name: str, copy_gbs: float, stream: torch.cuda.Stream | None) -> list[str]:
    device = torch.device("cuda" if stream is not None else "cpu")
    x, padded, mask = make_inputs(args.batch, args.min_len, args.max_len, args.inner, DTYPES[dtype_name], device)
    lines = []
    for op, direction, nbytes, impls in cases(x, padded, mask):
        ms, gbs, pct = fmt(bench(impls["varlen"], device), nbytes, copy_gbs)
        gpu_only = "n/a (CPU)"
        if stream is not None:
            g_ms, _, g_pct = fmt(graph_ms(impls["varlen"], stream), nbytes, copy_gbs)
            gpu_only = f"{g_ms} ({g_pct})"
        others = []
        for impl in ("torch.nested", "padded dense"):
            fn = impls[impl]
            if isinstance(fn, str):
                others.append(fn)
            else:
                o_ms, o_gbs, _ = fmt(bench(fn, device), nbytes, copy_gbs)
                others.append(f"{o_ms} ({o_gbs})")
        lines.append(f"| {op} | {direction} | {dtype_name} | {nbytes / 1e6:.0f} | {ms} | {gbs} | {pct} | "
                     f"{gpu_only} | {others[0]} | {others[1]} |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the markdown table to this file")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU / interpreter smoke test)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--min-len", type=int, default=128)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--inner", type=int, default=1024)
    parser.add_argument("--dtypes", default="bf16,fp32", help=f"comma-separated, from {', '.join(DTYPES)}")
    parser.add_argument("--copy-mb", type=int, default=1024, help="size of the copy that measures bandwidth")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.min_len, args.max_len, args.inner, args.dtypes, args.copy_mb = 4, 0, 40, 8, "fp32", 16
    for d in args.dtypes.split(","):
        if d not in DTYPES:
            parser.error(f"--dtypes: unknown dtype {d!r}; allowed: {', '.join(DTYPES)}")
    with varlen.use_backend("triton"):  # the kernels, also on the CPU (through the interpreter)
        table = run(args)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)


if __name__ == "__main__":
    main()
