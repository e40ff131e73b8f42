"""Context-parallel attention on 1..N GPUs: tokens/s of forward + backward and per-GPU memory, a jagged
batch of long documents (causal, bf16), with a projection to more GPUs from the measured compute and
communication times.

    PYTHONPATH=src python3 bench/context_parallel.py --gpus 1 2 --tokens 262144 --head-chunks 0 1 \
        --out bench/results/context_parallel_h200.md

One GPU runs ``varlen.attention`` on the whole batch; N GPUs run ``varlen.distributed.ContextParallel``
over NCCL (one process per GPU), each rank its plan's rows, with each ``--head-chunks`` setting. Times are
medians of CUDA-event-timed steps after warm-up. Memory per GPU, above the inputs and their gradients:
*saved* (what a forward leaves for its backward) and *peak* (during a forward + backward).
Projection to W GPUs: compute = one GPU's attention time x the largest rank's share of the causal work in
W's plan; communication = the K/V all-gather (forward and backward) and the float32 dK/dV reduce-scatter,
at the bus bandwidth measured on the N GPUs run here (a ring moves (W - 1) / W of the data per GPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import varlen
from varlen.distributed import ContextParallel, make_plan
from varlen.distributed.context_parallel import head_chunks_for


def lengths_for(tokens: int, lo: int, hi: int) -> list[int]:
    g = torch.Generator().manual_seed(0)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(torch.randint(lo, hi + 1, (1,), generator=g)))
    lengths[-1] -= sum(lengths) - tokens
    return [n for n in lengths if n > 0]


def _timed(fn, steps: int) -> float:
    """Median milliseconds of ``fn`` over ``steps`` runs (CUDA events)."""
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _run(rank: int, world: int, port: int, args, chunks, results):
    torch.cuda.set_device(rank)
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("nccl", rank=rank, world_size=world)
    lengths = lengths_for(args.tokens, args.min_len, args.max_len)
    offsets = torch.tensor([0, *lengths], device="cuda").cumsum(0)
    H, D = args.heads, args.dim
    g = torch.Generator(device="cuda").manual_seed(0)
    if world > 1:
        cp = ContextParallel(offsets)
        rows = cp.local_rows

        def attend(q, k, v):
            return cp.attention(q, k, v, causal=True, head_chunks=chunks)
    else:
        rows = sum(lengths)

        def attend(q, k, v):
            jagged = [varlen.JaggedTensor(t, offsets, max(lengths), validate=False) for t in (q, k, v)]
            return varlen.attention(*jagged, causal=True).values

    q, k, v = (torch.randn(rows, H, D, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    dout = torch.randn(rows, H, D, device="cuda", dtype=torch.bfloat16, generator=g)

    def step():
        attend(q, k, v).backward(dout)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    out = attend(q, k, v)
    torch.cuda.synchronize()
    saved = (torch.cuda.memory_allocated() - base) / 2**30  # the output and what its backward keeps
    out.backward(dout)
    del out
    step_ms = _timed(step, args.steps)
    fwd_ms = _timed(lambda: attend(q, k, v), args.steps)
    comm = {}
    if world > 1:
        from varlen.distributed.context_parallel import _all_gather, _reduce_scatter

        block = max(make_plan(lengths, world).rows(r) for r in range(world))
        kv = torch.randn(block, 2 * H * D, device="cuda", dtype=torch.bfloat16)
        grads = torch.randn(world * block, 2 * H * D, device="cuda", dtype=torch.float32)
        comm["all_gather_ms"] = _timed(lambda: _all_gather(kv, 0, dist.group.WORLD).wait(), args.steps)
        comm["reduce_scatter_ms"] = _timed(lambda: _reduce_scatter(grads, "sum", 0, dist.group.WORLD).wait(),
                                           args.steps)
        comm["all_gather_bytes"] = world * block * 2 * H * D * 2
        comm["reduce_scatter_bytes"] = world * block * 2 * H * D * 4
    result = dict(world=world, rank=rank, rows=rows, step_ms=step_ms, fwd_ms=fwd_ms, peak_gib=peak, saved_gib=saved,
                  head_chunks=None if world == 1 else head_chunks_for(H, world, 0.0, chunks), **comm)
    if world > 1:
        everyone = [None] * world
        dist.all_gather_object(everyone, result)
        if rank == 0:
            results.put(everyone)
        dist.destroy_process_group()
    else:
        results.put([result])


def measure(world: int, args, chunks: int | None = None) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_run, args=(world, port, args, chunks, queue), nprocs=world, join=True)
    return queue.get()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=262144)
    ap.add_argument("--min-len", type=int, default=8192)
    ap.add_argument("--max-len", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--project", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--head-chunks", type=int, nargs="+", default=[0],
                    help="kv-head chunks of the context-parallel runs (0: ContextParallel's default), one run each")
    ap.add_argument("--out")
    args = ap.parse_args()
    lengths = lengths_for(args.tokens, args.min_len, args.max_len)
    runs = []
    for w in args.gpus:
        for c in [0] if w == 1 else args.head_chunks:
            runs.append((w, measure(w, args, c or None)))
            print(json.dumps(dict(world=w, ranks=runs[-1][1])), flush=True)
    one = next((ranks[0] for w, ranks in runs if w == 1), None)
    lines = [f"# Context-parallel attention ({torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"Triton {__import__('triton').__version__}, {datetime.date.today()})", "",
             f"{len(lengths)} documents of {args.min_len}-{args.max_len} tokens ({sum(lengths)} tokens: "
             f"{lengths}), causal, H{args.heads} D{args.dim}, bf16, forward + backward.", "",
             "Memory per GPU (the largest rank's), above the inputs and their gradients: *saved* is what one forward "
             "leaves for its backward (the output included), *peak* the most allocated during a forward + backward "
             "(the gathered K/V and the float32 dK/dV sums of one head chunk are transients).", "",
             "| GPUs | head chunks | step ms | tokens/s | speedup | forward ms | saved GiB | peak GiB | "
             "all-gather ms | reduce-scatter ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for w, ranks in runs:
        step = max(r["step_ms"] for r in ranks)
        speed = f"{one['step_ms'] / step:.2f}x" if one else "-"
        lines.append(f"| {w} | {ranks[0]['head_chunks'] or '-'} | {step:.1f} | {sum(lengths) / step * 1e3:,.0f} | "
                     f"{speed} | {max(r['fwd_ms'] for r in ranks):.1f} | {max(r['saved_gib'] for r in ranks):.2f} | "
                     f"{max(r['peak_gib'] for r in ranks):.2f} | {ranks[0].get('all_gather_ms', 0):.2f} | "
                     f"{ranks[0].get('reduce_scatter_ms', 0):.2f} |")
    measured = [(w, ranks) for w, ranks in runs if w > 1]
    if one and measured and args.project:
        w0, (r0, *_) = measured[-1]
        # Bus bandwidth: a ring all-gather / reduce-scatter moves (W - 1) / W of the buffer per GPU.
        ag_bw = r0["all_gather_bytes"] * (w0 - 1) / w0 / r0["all_gather_ms"]
        rs_bw = r0["reduce_scatter_bytes"] * (w0 - 1) / w0 / r0["reduce_scatter_ms"]
        lines += ["", f"Projection (compute from 1 GPU x the largest rank's causal-work share; communication at "
                      f"the bus bandwidth measured on {w0} GPUs: all-gather {ag_bw / 1e6:.0f} GB/s, "
                      f"reduce-scatter {rs_bw / 1e6:.0f} GB/s):", "",
                  "| GPUs | largest work share | compute ms | communication ms | step ms | speedup |",
                  "|---|---|---|---|---|---|"]
        kv_bytes = sum(lengths) * 2 * args.heads * args.dim * 2
        for w in args.project:
            plan = make_plan(lengths, w)
            share = max(plan.work(r) for r in range(w)) / sum(plan.work(r) for r in range(w))
            compute = one["step_ms"] * share
            comm = 2 * kv_bytes * (w - 1) / w / ag_bw + 2 * kv_bytes * (w - 1) / w / rs_bw
            lines.append(f"| {w} | {share:.3f} | {compute:.1f} | {comm:.1f} | {compute + comm:.1f} | "
                         f"{one['step_ms'] / (compute + comm):.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
