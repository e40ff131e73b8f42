"""Host time per ``varlen.attention`` call, where the GPU work is negligible (B2 S64 H4 D64 bf16, causal),
next to SDPA's: what small problems and short sequences pay on every call.

    PYTHONPATH=src python3 bench/host_overhead.py

Prints microseconds of host time per call (forward; forward + backward), the mean over 300 calls after a
warm-up, with the GPU synchronized only at the ends.
"""

import json
import time

import torch
import torch.nn.functional as F

import varlen


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


if __name__ == "__main__":
    main()
