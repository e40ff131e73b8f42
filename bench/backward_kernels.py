"""Backward TFLOP/s of the Gluon backward kernel's two forms at D64 (one key block per program, or two: ``PAIRS``,
``gluon_backward.pairs``) and of what ``varlen.attention`` selects, with cuDNN's backward (SDPA) in the same run,
each step replayed from a CUDA graph, so that no host time enters (``bench/attention.py``'s eager rows are
host-bound at S1k on these machines).

    PYTHONPATH=src python3 bench/backward_kernels.py --out bench/results/backward_kernels_h100.md

bf16; dense rows (B·S = 16k tokens, H·D = 2048 at D64) and jagged rows of causal GQA (a long-tailed mix like
bench/train_llm.py's documents) and of 16 sequences of 256-4096 tokens. Backward = (forward + backward) - forward,
both replayed; FLOPs 4·B·H·Sq·Sk·D (the real sequences' for jagged rows), halved when causal, backward 2.5x.
Written from the probe behind bench/NOTES.md's "Two key blocks per program" (same timing and shapes).
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import varlen
from cuda_graph import captured  # (bench/, the script's folder)
from varlen.attn.gluon import backward as gluon_backward

DEV = "cuda"


def backward_ms(forward, step) -> float:
    """Milliseconds of a step's backward: the replayed step's median minus the replayed forward's."""
    ms = [do_bench(captured(fn), warmup=50, rep=300, return_mode="median") for fn in (forward, step)]
    return ms[1] - ms[0]


def dense_case(B, S, H, HKV, D, causal):
    q = torch.randn(B, S, H, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, S, HKV, D, device=DEV, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    dout = torch.randn(B, S, H, D, device=DEV, dtype=torch.bfloat16)
    flops = 2.5 * 4 * B * H * S * S * D * (0.5 if causal else 1)

    def forward():
        with torch.no_grad():
            varlen.attention(q, k, v, causal=causal)

    def step():
        torch.autograd.grad(varlen.attention(q, k, v, causal=causal), (q, k, v), dout)

    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    dout_t = dout.transpose(1, 2).contiguous()

    def cudnn_forward():
        with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=H != HKV)

    def cudnn_step():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=H != HKV)
        torch.autograd.grad(out, (qt, kt, vt), dout_t)
    return forward, step, (cudnn_forward, cudnn_step), flops


def jagged_case(lengths, H, HKV, D, causal):
    total = sum(lengths)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEV, dtype=torch.int32)

    def jagged(heads):
        values = torch.randn(total, heads, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        return varlen.JaggedTensor(values, offsets, max(lengths))
    q, k, v = jagged(H), jagged(HKV), jagged(HKV)
    dout = torch.randn(total, H, D, device=DEV, dtype=torch.bfloat16)
    flops = 2.5 * sum(4 * H * L * L * D * (0.5 if causal else 1) for L in lengths)

    def forward():
        with torch.no_grad():
            varlen.attention(q, k, v, causal=causal)

    def step():
        torch.autograd.grad(varlen.attention(q, k, v, causal=causal).values, (q.values, k.values, v.values), dout)
    return forward, step, None, flops


def long_tail(tokens: int) -> list[int]:
    """Document lengths of 64-4096 tokens, Pareto-distributed (most short, most tokens in long ones)."""
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(min(4096, max(64, 64 * torch.distributions.Pareto(1.0, 0.9).sample().item()))))
    return lengths


def cases():
    for D, H in ((64, 32), (128, 16)):
        for S in (1024, 4096, 16384):
            for causal in (False, True):
                name = f"D{D} S{S} B{16384 // S} H{H}" + (" causal" if causal else "")
                yield name, lambda D=D, H=H, S=S, causal=causal: dense_case(16384 // S, S, H, H, D, causal)
    yield "D64 GQA 32/8 S4096 B2 causal", lambda: dense_case(2, 4096, 32, 8, 64, True)
    yield "D64 GQA 12/4 S2048 B8 causal", lambda: dense_case(8, 2048, 12, 4, 64, True)
    torch.manual_seed(1)
    tail = long_tail(48 * 1024)
    yield (f"jagged {len(tail)} seqs 64-4096 ({sum(tail)} tokens) D64 GQA 12/4 causal",
           lambda: jagged_case(tail, 12, 4, 64, True))
    uniform = torch.randint(256, 4097, (16,), generator=torch.Generator().manual_seed(3)).tolist()
    yield (f"jagged 16 seqs 256-4096 ({sum(uniform)} tokens) D64 H16 causal",
           lambda: jagged_case(uniform, 16, 16, 64, True))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default="", help="run the rows whose name contains this")
    ap.add_argument("--rounds", type=int, default=2, help="measurements of each form, alternated")
    a = ap.parse_args()
    rule = gluon_backward.pairs
    forms = {"one block": lambda *args: False, "pairs": lambda problem, *args: not gluon_backward.lean(
        problem.head_dim), "selected": rule}
    lines = ["# Backward kernels (`bench/backward_kernels.py`)\n",
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}, "
             f"{datetime.date.today().isoformat()}. bf16; backward TFLOP/s, steps replayed from CUDA graphs "
             f"(backward = step - forward), {a.rounds} rounds of each form alternated. `pairs`: two key blocks per "
             "program wherever the kernel takes them (D64); `selected`: what `varlen.attention` runs.\n",
             "| case | one block | pairs | selected | cuDNN |", "|---|---|---|---|---|"]
    for name, make in cases():
        if a.only not in name:
            continue
        forward, step, peer, flops = make()
        taken = forms if name.startswith("D64") or " D64 " in name else {"selected": rule}  # (pairs: D64 only)
        results = {form: [] for form in taken}
        try:
            for _ in range(a.rounds):
                for form, choice in taken.items():
                    gluon_backward.pairs = choice
                    results[form].append(flops / backward_ms(forward, step) / 1e9)
        finally:
            gluon_backward.pairs = rule
        cudnn = f"{flops / backward_ms(*peer) / 1e9:.0f}" if peer else ""
        cells = [", ".join(f"{r:.0f}" for r in results.get(form, [])) for form in forms]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {cudnn} |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
