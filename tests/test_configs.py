"""The attention tile tables against the sweep rows they cite (tuning as data)."""

import ast
import csv
import pathlib

import pytest
import torch

from varlen._amp import float32_matmul_precision
from varlen.attn.options import Problem
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
    # (full float32 accuracy runs on bf16 parts, with its own sweep)
    rows = _rows(configs.FP32_PARTS_SWEEP if precision == "tf32x3" else configs.FP32_SWEEP)
    assert {r["capability"] for r in rows} == {"9.0"} and configs.TABLES[(9, 0)] is configs.SM90
    best, timed = _best_full(rows, "fwd", precision, D)
    assert timed[configs.SM90.forward_float32[(precision, D)]] >= best - 1
    kv, q, mode = configs.SM90.backward_float32[(precision, D)]
    best, timed = _best_full(rows, "bwd", precision, D)
    assert timed[configs.BackwardConfig(kv, None, mode)] >= best - 1
    # The dQ tiles (deterministic mode) are those of the best separate-dQ row.
    separate = {c: t for c, t in timed.items() if c.dq_mode == configs.DQ_SEPARATE}
    assert q == max(separate, key=separate.get).q


@pytest.mark.parametrize("feature", ["bias", "bias1H", "dropout"])
def test_heavy_tables_are_the_sweeps_best(feature):
    """The D128 tiles next to a bias (full or broadcast over batches) or dropout are rows of the sweep they cite,
    within the rows' rounding (1 TFLOP/s) of its best, forward and backward."""
    rows = [r for r in _rows(configs.HEAVY_SWEEP) if r["feature"] == feature and int(r["D"]) == 128]
    assert {r["capability"] for r in rows} == {"9.0"}
    t = configs.SM90
    for kind in ("fwd", "bwd"):
        timed = {_config(r["config"]): int(r["tflops"]) for r in rows
                 if r["kind"] == kind and r["tflops"].lstrip("-").isdigit()}
        if kind == "fwd":
            chosen = (t.forward_dropout if feature == "dropout" else t.forward_bias)[128]
        else:
            kv, q, mode = (t.backward_dropout if feature == "dropout" else t.backward_bias)[128]
            # (in-kernel dQ rows were timed without dQ tiles)
            chosen = configs.BackwardConfig(kv, q if mode == configs.DQ_SEPARATE else None, mode)
        assert timed[chosen] >= max(timed.values()) - 1


@pytest.mark.parametrize("causal", [False, True])
def test_head256_tables_are_the_sweeps_best(causal):
    """The D256 forward and backward tiles (without a bias or dropout) are rows of the sweep they cite, within the rows'
    rounding (1 TFLOP/s) of its best; the backward's with their dQ tiles (a separate dQ kernel)."""
    rows = [r for r in _rows(configs.HEAD256_SWEEP) if r["causal"] == str(causal)]
    assert {r["capability"] for r in rows} == {"9.0"} and {r["D"] for r in rows} == {"256"}
    t = configs.SM90
    kv, q, mode = t.backward[(256, causal)]
    # (in-kernel dQ rows were timed without dQ tiles)
    backward = configs.BackwardConfig(kv, q if mode == configs.DQ_SEPARATE else None, mode)
    for kind, chosen in (("fwd", t.forward[256]), ("bwd", backward)):
        timed = {(_config(r["config"]), r["tma"]): int(r["tflops"]) for r in rows
                 if r["kind"] == kind and r["tflops"].lstrip("-").isdigit()}
        assert timed[(chosen, "True")] >= max(timed.values()) - 1


@pytest.mark.parametrize("causal", [False, True])
def test_head256_dropout_dq_tiles_are_the_sweeps_best(causal):
    """With dropout at D256, the dQ kernel's tiles are the row of the sweep they cite (dQ tiles beside the Gluon dK and
    dV kernel) within the rows' rounding (1 TFLOP/s) of its best."""
    rows = [r for r in _rows(configs.HEAD256_DROPOUT_SWEEP) if r["causal"] == str(causal)]
    assert {r["capability"] for r in rows} == {"9.0"} and {(r["D"], r["feature"]) for r in rows} == {("256", "dropout")}
    timed = {_config(r["config"]).q: int(r["tflops"]) for r in rows if r["tflops"].lstrip("-").isdigit()}
    assert timed[configs.SM90.backward_dropout[256][1]] >= max(timed.values()) - 1


def test_sources_are_named_and_other_gpus_fall_back_to_sm90():
    assert (SWEEPS / pathlib.Path(configs.FP32_SWEEP).name).exists()
    assert (SWEEPS / pathlib.Path(configs.FP32_PARTS_SWEEP).name).exists()
    assert (SWEEPS / pathlib.Path(configs.HEAVY_SWEEP).name).exists()
    assert (SWEEPS / pathlib.Path(configs.HEAD256_SWEEP).name).exists()
    assert (SWEEPS / pathlib.Path(configs.HEAD256_DROPOUT_SWEEP).name).exists()
    assert "untuned" in configs.UNTUNED and "NOTES.md" in configs.H200_SWEEPS
    assert configs.tables(torch.device("cpu")) is configs.SM90


@pytest.mark.parametrize("D", [36, 64, 100, 128, 256])
def test_float32_tiles_follow_the_split(D, monkeypatch):
    """float32 at full accuracy (no TF32): calls that split into bf16 parts (TMA, head dims up to 128) take the
    parts' tuned tiles, or their untuned ones next to a bias or dropout, always with two stages or more (the
    launchers never split a one-stage config); the others take the untuned tiles of Triton's tf32x3 dots. With TF32
    allowed, D256's backward takes tiles that fit its shared memory."""
    monkeypatch.setattr(configs, "interpreter_enabled", lambda: False)  # (the interpreter never splits)
    problem = Problem(2, 4, 4, D, D, 512, 512, True)
    device, t = torch.device("cpu"), configs.SM90  # (tables() gives sm_90's off the GPU)
    bound = configs.head_bound(problem)
    with float32_matmul_precision("ieee"):
        for tma in (True, False):
            split = configs.splits_bf16(torch.float32, problem, tma)
            assert split == (tma and D <= 128)
            for heavy in ({}, {"bias": True}, {"dropout": True}):
                fwd = configs.forward_config(problem, torch.float32, device, tma=tma, **heavy)
                bwd = configs.backward_config(problem, torch.float32, False, False, device, tma=tma, **heavy)
                if split and not heavy:
                    assert fwd == t.forward_float32[("tf32x3", bound)]
                    assert (bwd.kv, bwd.q) == t.backward_float32[("tf32x3", bound)][:2]
                elif split:
                    assert fwd == bwd.kv == t.float32_split_untuned
                else:
                    assert fwd == t.float32_untuned
                    assert bwd.kv == (t.float32_untuned_256_pointers if D == 256 and not tma else t.float32_untuned)
                assert (fwd.num_stages > 1 and bwd.kv.num_stages > 1) == split
    with float32_matmul_precision("tf32"):  # (at D256 TF32's dots need smaller backward tiles)
        bwd = configs.backward_config(problem, torch.float32, False, False, device)
        assert bwd.kv == (t.float32_untuned_256_tf32 if D == 256 else t.backward_float32[("tf32", bound)][0])
