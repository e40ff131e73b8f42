"""Backward TFLOP/s of the Triton backward kernels, the Gluon backward kernel's two forms in tiles of 64 (one key
block per program, or two: ``PAIRS``, ``gluon_backward.pairs``) and what ``varlen.attention`` selects (past a head dim
of 128, the Gluon dK and dV kernel of ``gluon/backward_wide.py`` beside the Triton dQ kernel), with cuDNN's backward
(SDPA) in the same run, each step replayed from a CUDA graph (``attention_cases.py``: the shapes and the
timing).

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
from varlen.attn.gluon import backward_wide as gluon_backward_wide
from varlen.attn.gluon import common as gluon_common


def backward_ms(forward, step) -> float:
    """Milliseconds of a step's backward: the replayed step's median minus the replayed forward's."""
    return replayed_ms(step) - replayed_ms(forward)


def main():
    a = arguments()
    applies, rule, wide = gluon_backward.applies, gluon_backward.pairs, gluon_backward_wide.applies
    never = lambda *args: False  # noqa: E731
    # Each form: (whether the Gluon kernel takes calls it applies to, whether it pairs key blocks, whether the wide
    # kernel takes those it applies to).
    forms = {"Triton": (never, rule, never), "one block": (applies, never, wide),
             "pairs": (applies, lambda problem, *args: not gluon_backward.lean(
                 gluon_common.tile_head_dim(problem.head_dim)), wide), "selected": (applies, rule, wide)}
    lines = ["# Backward kernels (`bench/backward_kernels.py`)\n",
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}, "
             f"{datetime.date.today().isoformat()}. bf16; backward TFLOP/s, steps replayed from CUDA graphs "
             f"(backward = step - forward), {a.rounds} rounds of each form alternated. `Triton`: the Triton kernels; "
             "`one block` / `pairs`: the Gluon kernel with one or two key blocks per program (two in tiles of 64 "
             "only); `selected`: what `varlen.attention` runs.\n",
             "| case | Triton | one block | pairs | selected | cuDNN | selected / cuDNN |",
             "|---|---|---|---|---|---|---|"]
    for name, make in cases():
        if a.only not in name:
            continue
        case = make()
        flops = 2.5 * case.forward_flops
        tile64 = gluon_common.tile_head_dim(case.head_dim) == 64
        taken = {form: how for form, how in forms.items() if tile64 or form in ("Triton", "selected")}
        results = {form: [] for form in taken}
        try:
            for _ in range(a.rounds):
                for form, (takes, choice, wide_takes) in taken.items():
                    gluon_backward.applies, gluon_backward.pairs = takes, choice
                    gluon_backward_wide.applies = wide_takes
                    results[form].append(flops / backward_ms(case.forward, case.step) / 1e9)
        finally:
            gluon_backward.applies, gluon_backward.pairs, gluon_backward_wide.applies = applies, rule, wide
        peer = flops / backward_ms(case.peer_forward, case.peer_step) / 1e9 if case.peer_step else None
        lines.append(table_row(name, forms, results, peer))
        print(lines[-1], flush=True)
    finish(lines, a.out)


if __name__ == "__main__":
    main()
