"""Tile-configuration sweep for the attention kernels (a tuning tool; results feed configs.py).

    PYTHONPATH=src python3 bench/attention_sweep.py --jobs 16 [--quick] [--focus F] --csv rows.csv
    PYTHONPATH=src python3 bench/attention_sweep.py --focus fp32 --precision tf32x3 --kind bwd --csv rows.csv
    PYTHONPATH=src python3 bench/attention_sweep.py --focus head256_dropout --csv rows.csv

Every variant is first compiled in a pool of processes (filling Triton's on-disk cache in parallel),
then timed one after another in this process. Forward and backward are timed separately; the backward
through ``launch_backward`` alone (preprocess + kernels), in TFLOP/s with the 2.5x-forward FLOP count. The Triton
kernels' tiles are swept, with the Gluon kernels off, except for ``--focus head256_dropout``: the dQ kernel's tiles
beside the Gluon dK and dV kernel in tiles of 256 (``gluon/backward_wide.py``), which runs there on Hopper.

``--csv`` writes one row per variant with its provenance (GPU, compute capability, torch and Triton
versions, date), shape, feature, config and TFLOP/s: commit it under ``bench/results/sweeps/``, where the
tables of ``varlen/attn/triton/configs.py`` cite it (``tests/test_configs.py`` checks they are its best).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import csv
import datetime
import itertools
import json
import multiprocessing as mp

import torch
import triton

from varlen.attn.options import AttentionOptions, DropoutSeed, Problem
from varlen.attn.triton import configs
from varlen.attn.triton.backward import launch_backward
from varlen.attn.triton.forward import launch_forward

K = configs.KernelConfig
BC = configs.BackwardConfig
FWD = [K(128, 64, 4, 3), K(128, 64, 8, 3), K(128, 128, 8, 3), K(128, 128, 8, 2), K(128, 64, 4, 4),
       K(64, 64, 4, 3), K(128, 128, 4, 3)]
KV = [K(64, 128, 8, 2), K(64, 128, 8, 3), K(64, 64, 4, 2), K(64, 64, 4, 3), K(128, 64, 8, 2), K(32, 128, 8, 2),
      K(64, 128, 4, 2), K(128, 128, 8, 2)]
QK = [K(64, 64, 4, 2), K(128, 64, 8, 2), K(64, 128, 4, 2), K(128, 128, 8, 2), K(64, 32, 4, 3), K(128, 64, 4, 2)]
# Shared-memory-lean choices for calls with a bias or dropout.
FWD_HEAVY = [K(128, 64, 8, 2), K(128, 64, 4, 2), K(64, 64, 4, 2), K(128, 64, 8, 3), K(64, 64, 4, 3)]
BWD_HEAVY = [BC(K(64, 128, 8, 3, tma=False), None, configs.DQ_TMA),
             BC(K(64, 128, 8, 2, tma=False), None, configs.DQ_TMA),
             BC(K(64, 64, 4, 2), None, configs.DQ_TMA),
             BC(K(64, 64, 4, 3), None, configs.DQ_TMA),
             BC(K(64, 64, 4, 2), K(64, 64, 4, 2), configs.DQ_SEPARATE),
             BC(K(64, 64, 4, 3), K(64, 64, 4, 2), configs.DQ_SEPARATE),
             BC(K(64, 128, 8, 2, tma=False), K(64, 64, 4, 2), configs.DQ_SEPARATE),
             BC(K(128, 64, 8, 2), K(64, 64, 4, 2), configs.DQ_SEPARATE),
             BC(K(64, 64, 4, 2), K(128, 64, 8, 2), configs.DQ_SEPARATE),
             BC(K(64, 64, 4, 2), K(64, 128, 4, 2), configs.DQ_SEPARATE)]


# float32 tiles: 4-byte operands take twice the shared memory of bf16 ones, and "tf32x3" dots (float32
# accuracy) hold split operands in registers: smaller tiles than bf16's.
FWD_F32 = [K(64, 32, 4, 2), K(64, 64, 4, 2), K(128, 32, 4, 2), K(128, 64, 8, 2), K(64, 64, 4, 3), K(128, 64, 4, 2),
           K(64, 32, 4, 3), K(32, 64, 4, 2)]
KV_F32 = [K(32, 64, 4, 1), K(32, 64, 4, 2), K(64, 64, 4, 2), K(64, 32, 4, 2), K(32, 32, 4, 2), K(64, 64, 8, 2),
          K(32, 128, 8, 2), K(64, 128, 8, 2)]
QK_F32 = [K(64, 32, 4, 2), K(64, 64, 4, 2), K(32, 64, 4, 2), K(128, 32, 4, 2)]
# Head dim 256 (and 192, whose tiles are 256 wide): K and V tiles of 64 keys already take 32 KiB each, and the
# kv kernel's dK and dV accumulators 64 KiB each, so fewer rows per tile and stage than at D128.
FWD_256 = [K(64, 64, 4, 2), K(64, 64, 4, 1), K(64, 64, 4, 3), K(128, 64, 8, 2), K(128, 64, 8, 1), K(128, 64, 4, 2),
           K(128, 32, 8, 2), K(128, 32, 8, 3), K(128, 32, 8, 4), K(64, 32, 4, 2), K(64, 32, 4, 3), K(64, 128, 8, 1)]
KV_256 = [K(32, 64, 8, 1), K(32, 64, 8, 2), K(32, 64, 8, 3), K(32, 64, 4, 2), K(64, 64, 8, 1), K(16, 64, 4, 2),
          K(16, 64, 8, 2), K(64, 32, 4, 2), K(32, 128, 8, 1)]
KV_256_SEPARATE = [K(64, 64, 8, 2), K(64, 64, 8, 3), K(64, 64, 8, 1), K(128, 64, 8, 2), K(64, 64, 4, 2),
                   K(32, 64, 8, 2), K(32, 64, 8, 3), K(64, 32, 4, 2)]
QK_256 = [K(128, 32, 8, 3), K(128, 32, 8, 2), K(128, 32, 8, 4), K(128, 32, 4, 3), K(128, 16, 8, 3), K(128, 64, 8, 1),
          K(64, 32, 4, 1), K(64, 32, 4, 3)]
# ... with dropout (its draws beside the tiles): those that compile (tools/compile_check.py; 128 x 32 at 3 stages
# overflows shared memory, kept to record it), and the smallest.
QK_256_DROPOUT = [K(128, 32, 8, 2), K(128, 32, 8, 3), K(128, 16, 8, 3), K(128, 16, 8, 2), K(64, 64, 8, 2),
                  K(64, 32, 8, 3), K(64, 32, 4, 2), K(32, 64, 8, 1)]
# The float32 backward with bf16 parts keeps every loaded tile's three parts in shared memory
# (configs.splits_bf16): few query rows per tile, and two stages or more (launch_backward).
KV_F32_SPLIT = [K(32, 64, 4, 2), K(64, 64, 4, 2), K(16, 64, 4, 2), K(16, 64, 4, 3), K(32, 64, 4, 3),
                K(32, 128, 8, 2), K(32, 64, 8, 2)]
# ... and so does the forward: tiles that compile without spills at D64 (tools/compile_check.py), the first three
# at D128 too (there the 64x64 and 128x64 ones overflow shared memory: the sweep records the error).
FWD_F32_SPLIT = [K(64, 32, 4, 2), K(128, 32, 8, 2), K(64, 32, 4, 3), K(64, 64, 4, 2), K(128, 64, 8, 2),
                 K(64, 64, 4, 3)]


def shapes(args):
    if args.focus == "fp32":
        for D, causal, prec in itertools.product((64, 128), (False, True), args.precision):
            yield dict(D=D, causal=causal, S=2048, B=8, H=512 // D, feat=None, dtype=torch.float32, prec=prec)
        return
    if args.focus == "all":
        for D, causal in itertools.product((64, 128), (False, True)):
            yield dict(D=D, causal=causal, S=4096 if not args.quick else 1024, B=4, H=2048 // D, feat=None)
    elif args.focus == "tails":
        yield dict(D=128, causal=True, S=4096, B=4, H=16, feat=None)
        yield dict(D=64, causal=True, S=1024, B=16, H=32, feat=None)
    elif args.focus == "head256":
        for causal in (False, True):
            yield dict(D=256, causal=causal, S=4096, B=4, H=8, feat=None)
    elif args.focus == "head256_dropout":
        for causal in (False, True):
            yield dict(D=256, causal=causal, S=2048, B=8, H=8, feat="dropout", gluon=True)
    elif args.focus == "gqa_window":
        yield dict(D=128, causal=True, S=4096, B=2, H=32, Hkv=8, feat=None)
        yield dict(D=128, causal=True, S=16384, B=1, H=16, window=1023, feat=None)
    else:  # heavy
        for feat in ("bias", "bias1H", "dropout"):
            yield dict(D=128, causal=False, S=2048, B=4, H=16, feat=feat)


def variants(args):
    """(kind, shape, config, tma): TMA tile loads, plus the pointer path for reference."""
    for sh in shapes(args):
        if sh.get("dtype") == torch.float32:
            if args.kind != "bwd":
                for c in FWD_F32_SPLIT if sh["prec"] == "tf32x3" else FWD_F32:
                    yield ("fwd", sh, c, None)
            if args.kind == "fwd":
                continue
            kv_tiles = KV_F32_SPLIT if sh["prec"] == "tf32x3" else KV_F32
            for c in kv_tiles:
                for mode in (configs.DQ_TMA, configs.DQ_ATOMIC):
                    yield ("bwd", sh, BC(c, None, mode), None)
            for kv, q in itertools.product(kv_tiles[:4], QK_F32):
                yield ("bwd", sh, BC(kv, q, configs.DQ_SEPARATE), None)
            continue
        if "Hkv" in sh or "window" in sh:
            for c in (K(64, 128, 8, 3, tma=False), K(64, 64, 4, 2), K(64, 64, 4, 2, tma=False), K(64, 64, 4, 3),
                      K(32, 128, 8, 2, tma=False), K(64, 128, 8, 2, tma=False)):
                yield ("bwd", sh, BC(c, None, configs.DQ_TMA), None)
            for kv, q in ((K(64, 64, 4, 2), K(64, 64, 4, 2)), (K(64, 128, 8, 3), K(64, 64, 4, 2))):
                yield ("bwd", sh, BC(kv, q, configs.DQ_SEPARATE), None)
            continue
        if sh.get("gluon"):  # (the dQ kernel beside the Gluon kernel, which takes the kv kernel's place)
            for q in QK_256_DROPOUT:
                yield ("bwd", sh, BC(K(32, 64, 8, 1), q, configs.DQ_SEPARATE), True)
            continue
        if sh["D"] == 256:
            for c in FWD_256:
                yield ("fwd", sh, c, True)
            yield ("fwd", sh, K(64, 64, 4, 2), False)
            for c in KV_256:
                yield ("bwd", sh, BC(c, None, configs.DQ_TMA), True)
            yield ("bwd", sh, BC(K(32, 64, 8, 1), None, configs.DQ_TMA), False)
            for kv, q in itertools.product(KV_256_SEPARATE, QK_256):
                yield ("bwd", sh, BC(kv, q, configs.DQ_SEPARATE), True)
            continue
        if sh["feat"]:
            for c in FWD_HEAVY:
                yield ("fwd", sh, c, None)
            for c in BWD_HEAVY:
                yield ("bwd", sh, c, None)
            continue
        for c in FWD:
            yield ("fwd", sh, c, True)
        yield ("fwd", sh, K(128, 128, 8, 3), False)
        for c in KV:
            yield ("bwd", sh, BC(c, None, configs.DQ_TMA), True)
            yield ("bwd", sh, BC(c, None, configs.DQ_TMA), False)
        for kv, q in itertools.product(KV[:5], QK):
            yield ("bwd", sh, BC(kv, q, configs.DQ_SEPARATE), True)


def make(sh):
    B, S, H, D, Hkv = sh["B"], sh["S"], sh["H"], sh["D"], sh.get("Hkv", sh["H"])
    dtype = sh.get("dtype", torch.bfloat16)
    # float32 shapes name the dot precision: "tf32" (torch allows TF32) or "tf32x3" (it doesn't).
    torch.backends.cuda.matmul.fp32_precision = "tf32" if sh.get("prec") == "tf32" else "ieee"
    q, do = (torch.randn(B, S, H, D, device="cuda", dtype=dtype) for _ in range(2))
    k, v = (torch.randn(B, S, Hkv, D, device="cuda", dtype=dtype) for _ in range(2))
    bias = seed = None
    if sh["feat"] == "bias":
        bias = torch.randn(B, H, S, S, device="cuda", dtype=torch.bfloat16)
    elif sh["feat"] == "bias1H":
        bias = torch.randn(1, H, S, S, device="cuda", dtype=torch.bfloat16)
    elif sh["feat"] == "dropout":
        seed = DropoutSeed(1234, 0)
    opts = AttentionOptions(scale=D ** -0.5, causal=sh["causal"], window_left=sh.get("window", -1),
                            dropout_p=0.1 if seed else 0.0)
    prob = Problem(B, H, Hkv, D, D, S, S, True)
    return q, k, v, do, bias, seed, opts, prob


def run(variant, timing=False):
    kind, sh, cfg, tma = variant
    q, k, v, do, bias, seed, opts, prob = make(sh)
    try:
        fwd_cfg = cfg if kind == "fwd" else configs.forward_config(prob, q.dtype, q.device, bias=bias is not None,
                                                                   dropout=seed is not None)
        out, lse = launch_forward(q, k, v, bias, None, prob, opts, seed, fwd_cfg)
        if kind == "fwd":
            def fn():
                # (the Triton kernel's tiles are swept, not the Gluon kernel that runs where it applies)
                return launch_forward(q, k, v, bias, None, prob, opts, seed, cfg, tma=tma, gluon=False)
        else:
            def fn():
                return launch_backward(do, None, q, k, v, out, lse, bias, None, prob, opts, seed, cfg,
                                       bias is not None, tma=tma, gluon=sh.get("gluon", False))
        fn()
        torch.cuda.synchronize()
        if not timing:
            return None
        from triton.testing import do_bench

        ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
        if "window" in sh:
            W = sh["window"] + 1
            flops = 4 * sh["B"] * sh["H"] * sh["D"] * sum(min(i + 1, W) for i in range(sh["S"]))
        else:
            flops = 4 * sh["B"] * sh["H"] * sh["S"] ** 2 * sh["D"] * (0.5 if sh["causal"] else 1)
        return flops * (1 if kind == "fwd" else 2.5) / ms / 1e9
    except Exception as exc:
        return "err " + str(exc).splitlines()[0][:80]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=16)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--focus", default="all",
                    choices=["all", "tails", "heavy", "gqa_window", "fp32", "head256", "head256_dropout"])
    ap.add_argument("--csv", help="write the rows here (see the module docstring)")
    ap.add_argument("--precision", nargs="+", default=["tf32", "tf32x3"], choices=["tf32", "tf32x3"],
                    help="--focus fp32: the float32 dot precisions to sweep")
    ap.add_argument("--kind", default="both", choices=["fwd", "bwd", "both"], help="--focus fp32: which passes")
    a = ap.parse_args()
    major, minor = torch.cuda.get_device_capability()
    provenance = dict(gpu=torch.cuda.get_device_name(), capability=f"{major}.{minor}",
                      torch=torch.__version__, triton=triton.__version__, date=datetime.date.today().isoformat())
    rows = []
    vs = list(variants(a))
    with cf.ProcessPoolExecutor(a.jobs, mp_context=mp.get_context("spawn")) as pool:
        list(pool.map(run, vs))
    best = {}
    for v in vs:
        r = run(v, timing=True)
        kind, sh, cfg, tma = v
        print(json.dumps(dict(kind=kind, D=sh["D"], S=sh["S"], causal=sh["causal"], feat=sh["feat"], tma=tma,
                              prec=sh.get("prec"), cfg=str(cfg),
                              tflops=r if isinstance(r, str) else round(r))), flush=True)
        rows.append(dict(**provenance, kind=kind, dtype=str(sh.get("dtype", torch.bfloat16)).replace("torch.", ""),
                         precision=sh.get("prec") or "", B=sh["B"], S=sh["S"], H=sh["H"], Hkv=sh.get("Hkv", sh["H"]),
                         D=sh["D"], causal=sh["causal"], feature=sh["feat"] or "", tma="" if tma is None else tma,
                         config=str(cfg), tflops=r if isinstance(r, str) else round(r)))
        key = (kind, sh["D"], sh["S"], sh.get("Hkv"), sh["causal"], sh["feat"], sh.get("prec"),
               getattr(cfg, "dq_mode", None), tma)
        if not isinstance(r, str) and r > best.get(key, (0,))[0]:
            best[key] = (round(r), str(cfg))
    for key, val in sorted(best.items(), key=str):
        print("BEST", key, val)
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


if __name__ == "__main__":
    main()
