"""Backward TFLOP/s of the Gluon backward kernel's two forms at D64 (one key block per program, or two: ``PAIRS``,
``gluon_backward.pairs``) and of what ``varlen.attention`` selects, with cuDNN's backward (SDPA) in the same run,
each step replayed from a CUDA graph (``attention_cases.py``: the shapes and the timing).

    PYTHONPATH=src python3 bench/backward_kernels.py --out bench/results/backward_kernels_h100.md

Backward = (forward + backward) - forward, both replayed. Written from the probe behind bench/NOTES.md's "Two key
blocks per program" (same timing and shapes).
"""

from __future__ import annotations

import datetime

import torch
import triton

from attention_cases import arguments, cases, finish, replayed_ms, table_row  # (bench/, the script's folder)
from varlen.attn.gluon import backward as gluon_backward


def backward_ms(forward, step) -> float:
    """Milliseconds of a step's backward: the replayed step's median minus the replayed forward's."""
    return replayed_ms(step) - replayed_ms(forward)


def main():
    a = arguments()
    rule = gluon_backward.pairs
    forms = {"one block": lambda *args: False, "pairs": lambda problem, *args: not gluon_backward.lean(
        problem.head_dim), "selected": rule}
    lines = ["# Backward kernels (`bench/backward_kernels.py`)\n",
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}, "
             f"{datetime.date.today().isoformat()}. bf16; backward TFLOP/s, steps replayed from CUDA graphs "
             f"(backward = step - forward), {a.rounds} rounds of each form alternated. `pairs`: two key blocks per "
             "program wherever the kernel takes them (D64); `selected`: what `varlen.attention` runs.\n",
             "| case | one block | pairs | selected | cuDNN | selected / cuDNN |", "|---|---|---|---|---|---|"]
    for name, make in cases():
        if a.only not in name:
            continue
        case = make()
        flops = 2.5 * case.forward_flops
        taken = forms if name.startswith("D64") or " D64 " in name else {"selected": rule}  # (pairs: D64 only)
        results = {form: [] for form in taken}
        try:
            for _ in range(a.rounds):
                for form, choice in taken.items():
                    gluon_backward.pairs = choice
                    results[form].append(flops / backward_ms(case.forward, case.step) / 1e9)
        finally:
            gluon_backward.pairs = rule
        peer = flops / backward_ms(case.peer_forward, case.peer_step) / 1e9 if case.peer_step else None
        lines.append(table_row(name, forms, results, peer))
        print(lines[-1], flush=True)
    finish(lines, a.out)


if __name__ == "__main__":
    main()
