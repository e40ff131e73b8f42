"""The shapes and timing of the kernel-level attention benchmarks (``forward_kernels.py``, ``backward_kernels.py``):
each case's forward and training step through ``varlen.attention`` and cuDNN's (SDPA) on the same data, each timed
from CUDA-graph replays, so that no host time enters (``bench/attention.py``'s eager rows are host-bound at S1k on
these machines).

bf16; dense rows (B·S = 16k tokens, H·D = 2048; at head dims 32, 40, 80, 96 and 192 about 2048), dense GQA rows at
S2k-4k, dropout 0.1 at S2k and 8k, jagged rows of causal attention: a long-tailed mix like ``bench/train_llm.py``'s
documents (D64 GQA 12/4, and D128 GQA 32/8) and 16 sequences of 256-4096 tokens, multi-head latent attention's
head dims (q and k 192, v 128: DeepSeek-V2 and V3), dense and on the long-tailed documents, and deterministic mode
at D64 and D128. FLOPs 2·B·H·Sq·Sk·(D + Dv) (4·B·H·Sq·Sk·D where Dv = D; the real sequences' for jagged rows),
halved when causal; the backward counts 2.5x.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import varlen
from cuda_graph import captured  # (bench/, the scripts' folder)

DEV = "cuda"


class Case(NamedTuple):
    forward: Callable[[], None]  # varlen.attention without autograd
    step: Callable[[], None]  # forward and backward
    peer_forward: Callable[[], None] | None  # cuDNN's (dense rows only: SDPA takes no jagged batch)
    peer_step: Callable[[], None] | None
    forward_flops: float
    head_dim: int
    head_dim_v: int


def replayed_ms(fn: Callable[[], None]) -> float:
    """Median milliseconds of ``fn`` replayed from a CUDA graph."""
    return do_bench(captured(fn), warmup=50, rep=300, return_mode="median")


def dense_case(B, S, H, HKV, D, causal, dropout_p=0.0, DV=None, deterministic=False) -> Case:
    DV = D if DV is None else DV
    q = torch.randn(B, S, H, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, S, HKV, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, S, HKV, DV, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(B, S, H, DV, device=DEV, dtype=torch.bfloat16)

    def forward():
        with torch.no_grad():
            varlen.attention(q, k, v, causal=causal, dropout_p=dropout_p, deterministic=deterministic)

    def step():
        out = varlen.attention(q, k, v, causal=causal, dropout_p=dropout_p, deterministic=deterministic)
        torch.autograd.grad(out, (q, k, v), dout)

    qt, kt, vt = (t.detach().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v))
    dout_t = dout.transpose(1, 2).contiguous()

    def cudnn_forward():
        with torch.no_grad(), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=H != HKV, dropout_p=dropout_p)

    def cudnn_step():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=H != HKV,
                                                 dropout_p=dropout_p)
        torch.autograd.grad(out, (qt, kt, vt), dout_t)
    peer_forward, peer_step = cudnn_forward, cudnn_step
    if DV != D:  # (where cuDNN's SDPA declines a value head dim other than the query's, no peer)
        try:
            cudnn_step()
        except RuntimeError as e:
            print(f"cuDNN declines D{D} Dv{DV}: {str(e).splitlines()[0][:200]}", flush=True)
            peer_forward = peer_step = None
    return Case(forward, step, peer_forward, peer_step, 2 * B * H * S * S * (D + DV) * (0.5 if causal else 1), D, DV)


def jagged_case(lengths, H, HKV, D, causal, DV=None) -> Case:
    DV = D if DV is None else DV
    total = sum(lengths)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEV, dtype=torch.int32)

    def jagged(heads, dim):
        values = torch.randn(total, heads, dim, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        return varlen.JaggedTensor(values, offsets, max(lengths))
    q, k, v = jagged(H, D), jagged(HKV, D), jagged(HKV, DV)
    dout = torch.randn(total, H, DV, device=DEV, dtype=torch.bfloat16)

    def forward():
        with torch.no_grad():
            varlen.attention(q, k, v, causal=causal)

    def step():
        torch.autograd.grad(varlen.attention(q, k, v, causal=causal).values, (q.values, k.values, v.values), dout)
    return Case(forward, step, None, None, sum(2 * H * L * L * (D + DV) * (0.5 if causal else 1) for L in lengths), D,
                DV)


def long_tail(tokens: int) -> list[int]:
    """Document lengths of 64-4096 tokens, Pareto-distributed (most short, most tokens in long ones)."""
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(min(4096, max(64, 64 * torch.distributions.Pareto(1.0, 0.9).sample().item()))))
    return lengths


def cases() -> Iterator[tuple[str, Callable[[], Case]]]:
    """``(name, make)`` per row; ``make()`` allocates the row's tensors."""
    for D, H in ((64, 32), (128, 16)):
        for S in (1024, 4096, 16384):
            for causal in (False, True):
                name = f"D{D} S{S} B{16384 // S} H{H}" + (" causal" if causal else "")
                yield name, lambda D=D, H=H, S=S, causal=causal: dense_case(16384 // S, S, H, H, D, causal)
    yield "D64 GQA 32/8 S4096 B2 causal", lambda: dense_case(2, 4096, 32, 8, 64, True)
    yield "D64 GQA 12/4 S2048 B8 causal", lambda: dense_case(8, 2048, 12, 4, 64, True)
    yield "D128 GQA 32/8 S4096 B2 causal", lambda: dense_case(2, 4096, 32, 8, 128, True)
    # bench/attention.py's dropout rows (a captured call draws its key on the GPU: options.DropoutSeed)
    yield "D128 S2048 B4 H16 dropout 0.1", lambda: dense_case(4, 2048, 16, 16, 128, False, 0.1)
    yield "D128 S8192 B1 H16 dropout 0.1", lambda: dense_case(1, 8192, 16, 16, 128, False, 0.1)
    torch.manual_seed(1)
    tail = long_tail(48 * 1024)
    yield (f"jagged {len(tail)} seqs 64-4096 ({sum(tail)} tokens) D64 GQA 12/4 causal",
           lambda: jagged_case(tail, 12, 4, 64, True))
    yield (f"jagged {len(tail)} seqs 64-4096 ({sum(tail)} tokens) D128 GQA 32/8 causal",
           lambda: jagged_case(tail, 32, 8, 128, True))
    uniform = torch.randint(256, 4097, (16,), generator=torch.Generator().manual_seed(3)).tolist()
    yield (f"jagged 16 seqs 256-4096 ({sum(uniform)} tokens) D64 H16 causal",
           lambda: jagged_case(uniform, 16, 16, 64, True))
    # Head dims the Gluon kernels compute in a larger tile (40 in 64, 80 and 96 in 128; gluon.common.tile_head_dim), 32,
    # which they leave to the Triton kernels, and 192 and 256, past their tiles; H·D about 2048.
    for D, H in ((32, 64), (40, 48), (80, 24), (96, 20), (192, 10), (256, 8)):
        for S in (1024, 4096):
            for causal in (False, True):
                name = f"D{D} S{S} B{16384 // S} H{H}" + (" causal" if causal else "")
                yield name, lambda D=D, H=H, S=S, causal=causal: dense_case(16384 // S, S, H, H, D, causal)
    # ... and D256 with dropout (the Gluon backward in tiles of 256 draws it; the forward is the Triton kernel's).
    yield "D256 S2048 B8 H8 dropout 0.1", lambda: dense_case(8, 2048, 8, 8, 256, False, 0.1)
    # ... and D256 GQA 16/4, dense and on the long-tailed documents above (the Gluon kernels' tiles of 256).
    yield "D256 GQA 16/4 S4096 B2 causal", lambda: dense_case(2, 4096, 16, 4, 256, True)
    yield (f"jagged {len(tail)} seqs 64-4096 ({sum(tail)} tokens) D256 GQA 16/4 causal",
           lambda: jagged_case(tail, 16, 4, 256, True))
    # Multi-head latent attention's head dims (q and k 192, v 128; its heads are not grouped), dense and on the
    # long-tailed documents.
    for S in (1024, 4096):
        for causal in (False, True):
            name = f"MLA D192/128 S{S} B{16384 // S} H16" + (" causal" if causal else "")
            yield name, lambda S=S, causal=causal: dense_case(16384 // S, S, 16, 16, 192, causal, DV=128)
    yield (f"jagged {len(tail)} seqs 64-4096 ({sum(tail)} tokens) MLA D192/128 H16 causal",
           lambda: jagged_case(tail, 16, 16, 192, True, DV=128))
    # Deterministic mode (bit-for-bit reruns: dQ stored, not added by atomics) at D64 and D128. cuDNN's row is its
    # usual backward.
    for D, H in ((64, 32), (128, 16)):
        for S in (4096, 16384):
            for causal in (False, True):
                name = f"D{D} S{S} B{16384 // S} H{H}" + (" causal" if causal else "") + " deterministic"
                yield name, lambda D=D, H=H, S=S, causal=causal: dense_case(16384 // S, S, H, H, D, causal,
                                                                           deterministic=True)


def arguments() -> argparse.Namespace:
    """The kernel tables' command line: ``--out`` (a path for the table), ``--only`` (rows whose name contains it),
    ``--rounds`` (measurements of each form, alternated)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", default="", help="run the rows whose name contains this")
    ap.add_argument("--rounds", type=int, default=2, help="measurements of each form, alternated")
    return ap.parse_args()


def table_row(name: str, forms, results: dict[str, list[float]], peer: float | None) -> str:
    """A markdown row: each form's rates (its rounds), then the peer's and the selected form's mean over it (blank
    where the row has no peer)."""
    cells = [", ".join(f"{r:.0f}" for r in results.get(form, [])) for form in forms]
    if peer:
        selected = sum(results["selected"]) / len(results["selected"])
        cells += [f"{peer:.0f}", f"{selected / peer:.2f}"]
    else:
        cells += ["", ""]
    return f"| {name} | " + " | ".join(cells) + " |"


def finish(lines: list[str], out: str | None) -> None:
    """Print the table and write it to ``out`` (a path) where one is given."""
    text = "\n".join(lines) + "\n"
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)
