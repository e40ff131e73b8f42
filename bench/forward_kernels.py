"""Forward TFLOP/s of varlen's two Hopper forward kernels side by side (the Triton kernel and the
warp-specialized Gluon kernel), with SDPA's cuDNN and flash kernels in the same run: the source of
the rule that the Gluon kernel runs wherever it applies (``launch_forward(gluon=True)``).

    PYTHONPATH=src python3 bench/forward_kernels.py --out bench/results/forward_kernels_h100.md

Dense bf16, B·S = 16k tokens, H·D = 2048, causal and not; medians of ``triton.testing.do_bench``; FLOPs
4·B·H·S²·D, halved when causal. Each varlen kernel is launched through ``launch_forward`` (no autograd).
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from varlen.attn.gluon import forward as gluon_forward
from varlen.attn.options import AttentionOptions, Problem
from varlen.attn.triton import configs
from varlen.attn.triton.forward import launch_forward


def tflops(fn, flops: float) -> float:
    return flops / do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    lines = ["# Forward kernels (`bench/forward_kernels.py`)\n",
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}, "
             f"{datetime.date.today().isoformat()}. bf16, dense, B·S = 16k, H·D = 2048; TFLOP/s (medians of do_bench). "
             "`selected`: the kernel `varlen.attention` runs for this shape.\n",
             "| D | S | causal | Triton kernel | Gluon kernel | Gluon / Triton | SDPA cuDNN | SDPA flash "
             "| selected / cuDNN | selected |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for D in (64, 128):
        for S in (1024, 4096, 16384):
            for causal in (False, True):
                B, H = 16384 // S, 2048 // D
                q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                problem = Problem(B, H, H, D, D, S, S, True)
                opts = AttentionOptions(scale=D ** -0.5, causal=causal)
                config = configs.forward_config(problem, q.dtype, q.device)
                flops = 4 * B * H * S * S * D * (0.5 if causal else 1)
                triton_k, gluon_k = (tflops(lambda g=g: launch_forward(q, k, v, None, None, problem, opts, None,
                                                                       config, gluon=g), flops)
                                     for g in (False, True))
                qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
                peers = []
                for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
                    with sdpa_kernel(backend):
                        peers.append(tflops(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal),
                                            flops))
                gluon = gluon_forward.applies(problem, opts, q, k, v, None, None, None)
                chosen = gluon_k if gluon else triton_k
                lines.append(f"| {D} | {S} | {causal} | {triton_k:.0f} | {gluon_k:.0f} | {gluon_k / triton_k:.2f} | "
                             f"{peers[0]:.0f} | {peers[1]:.0f} | {chosen / peers[0]:.2f} | "
                             f"{'Gluon' if gluon else 'Triton'} |")
                print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
