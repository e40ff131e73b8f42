"""The attention tile tables against the sweep rows they cite (tuning as data)."""

import ast
import csv
import pathlib

import pytest
import torch

from varlen.attn.triton import configs

SWEEPS = pathlib.Path(__file__).parent.parent / "bench/results/sweeps"


def _rows(name):
    with open(SWEEPS / pathlib.Path(name).name) as f:
        return list(csv.DictReader(f))


def _config(text):
    """A config from its repr in a sweep row (only the config classes are in scope)."""
    tree = ast.parse(text, mode="eval")
    return eval(compile(tree, "<row>", "eval"), {"__builtins__": {}},  # noqa: S307 - trusted committed data
                {"KernelConfig": configs.KernelConfig, "BackwardConfig": configs.BackwardConfig})


def _best_full(rows, kind, precision, D):
    """The best TFLOP/s without a mask, and each config's TFLOP/s there."""
    timed = {r["config"]: int(r["tflops"]) for r in rows if r["kind"] == kind and r["precision"] == precision
             and int(r["D"]) == D and r["causal"] == "False" and r["tflops"].lstrip("-").isdigit()}
    return max(timed.values()), {_config(c): t for c, t in timed.items()}


@pytest.mark.parametrize("precision", ["tf32", "tf32x3"])
@pytest.mark.parametrize("D", [64, 128])
def test_float32_tables_are_the_sweeps_best(precision, D):
    """Every float32 entry is a row of the sweep it cites, within the rows' rounding (1 TFLOP/s) of the best."""
    rows = _rows(configs.FP32_SWEEP)
    assert {r["capability"] for r in rows} == {"9.0"} and configs.TABLES[(9, 0)] is configs.SM90
    best, timed = _best_full(rows, "fwd", precision, D)
    assert timed[configs.SM90.forward_float32[(precision, D)]] >= best - 1
    kv, q, mode = configs.SM90.backward_float32[(precision, D)]
    if precision == "tf32x3":  # the backward with bf16 parts has its own sweep
        rows = _rows(configs.FP32_PARTS_SWEEP)
        assert {r["capability"] for r in rows} == {"9.0"} and not any(r["kind"] == "fwd" for r in rows)
    best, timed = _best_full(rows, "bwd", precision, D)
    assert timed[configs.BackwardConfig(kv, None, mode)] >= best - 1
    # The dQ tiles (deterministic mode) are those of the best separate-dQ row.
    separate = {c: t for c, t in timed.items() if c.dq_mode == configs.DQ_SEPARATE}
    assert q == max(separate, key=separate.get).q


def test_sources_are_named_and_other_gpus_fall_back_to_sm90():
    assert (SWEEPS / pathlib.Path(configs.FP32_SWEEP).name).exists()
    assert (SWEEPS / pathlib.Path(configs.FP32_PARTS_SWEEP).name).exists()
    assert "untuned" in configs.UNTUNED and "NOTES.md" in configs.H200_SWEEPS
    assert configs.tables(torch.device("cpu")) is configs.SM90
