"""Forward TFLOP/s of varlen's Hopper forward kernels side by side: the Triton kernel, the warp-specialized Gluon
kernel with two query warpgroups and, at D64, with three (``gluon_forward.query_warpgroups``), and what
``varlen.attention`` selects, with cuDNN's forward (SDPA) in the same run, each replayed from a CUDA graph
(``attention_cases.py``: the shapes and the timing). The source of the rules that the Gluon kernel runs wherever
it applies and of ``query_warpgroups``.

    PYTHONPATH=src python3 bench/forward_kernels.py --out bench/results/forward_kernels_h100.md
"""

from __future__ import annotations

import datetime

import torch
import triton

from attention_cases import arguments, cases, finish, replayed_ms, table_row  # (bench/, the script's folder)
from varlen.attn.gluon import common as gluon_common
from varlen.attn.gluon import forward as gluon_forward


def main():
    a = arguments()
    applies, rule = gluon_forward.applies, gluon_forward.query_warpgroups
    # Each form: (whether the Gluon kernel takes calls it applies to, its query warpgroups).
    forms = {"Triton": (lambda *args: False, rule), "Gluon two": (applies, lambda *args: 2),
             "Gluon three": (applies, lambda *args: 3), "selected": (applies, rule)}
    lines = ["# Forward kernels (`bench/forward_kernels.py`)\n",
             f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Triton {triton.__version__}, "
             f"{datetime.date.today().isoformat()}. bf16; forward TFLOP/s, replayed from CUDA graphs, {a.rounds} "
             "rounds of each form alternated. `Triton`: the Triton kernel; `Gluon two` / `three`: the Gluon kernel "
             "with two or three query warpgroups (three in tiles of 64 only); `selected`: what `varlen.attention` "
             "runs.\n",
             "| case | Triton | Gluon two | Gluon three | selected | cuDNN | selected / cuDNN |",
             "|---|---|---|---|---|---|---|"]
    for name, make in cases():
        if a.only not in name:
            continue
        case = make()
        tiles = gluon_common.wide_tile_head_dims(case.head_dim, case.head_dim_v)  # (three query warpgroups: tiles
        # of 64 only; no Gluon form where no tile takes the head dims)
        taken = {form: how for form, how in forms.items()
                 if form in ("Triton", "selected") or tiles == (64, 64) or (tiles and form == "Gluon two")}
        results = {form: [] for form in taken}
        try:
            for _ in range(a.rounds):
                for form, (takes, warpgroups) in taken.items():
                    gluon_forward.applies, gluon_forward.query_warpgroups = takes, warpgroups
                    results[form].append(case.forward_flops / replayed_ms(case.forward) / 1e9)
        finally:
            gluon_forward.applies, gluon_forward.query_warpgroups = applies, rule
        peer = case.forward_flops / replayed_ms(case.peer_forward) / 1e9 if case.peer_forward else None
        lines.append(table_row(name, forms, results, peer))
        print(lines[-1], flush=True)
    finish(lines, a.out)


if __name__ == "__main__":
    main()
