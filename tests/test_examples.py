"""The main job, ``python -m varlen.examples.train``, at a tiny size."""

import os
import subprocess
import sys

import pytest

from conftest import DEVICE
from varlen.examples import train

TINY = ["--steps", "4", "--batch-size", "4", "--max-len", "9", "--d-model", "16", "--heads", "2", "--layers", "1",
        "--bench-steps", "2", "--bench-rounds", "2", "--device", str(DEVICE)]


@pytest.mark.parametrize("options", [[], ["--dropout", "0.1"]], ids=["plain", "dropout"])
def test_train_runs_and_prints_the_comparison_table(options):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "varlen.examples.train", *TINY, *options], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "step     0" in out and "step     4" in out and "token accuracy" in out
    assert "| batches" in out and "tokens/s (real tokens)" in out and "peak memory (MiB)" in out
    assert "| jagged: varlen" in out and "| padded: torch.nn + key padding mask" in out
    assert "the median of 2 rounds, alternated" in out
    assert "|logit difference| between the two on real tokens" in out
    assert "memory: peak" in out


@pytest.mark.parametrize("argv, match", [
    (["--d-model", "10", "--heads", "4"], "--d-model 10 must be a multiple of --heads 4"),
    (["--steps", "0"], "--steps: must be >= 1, got 0"),
    (["--bench-rounds", "0"], "--bench-rounds: must be >= 1, got 0"),
])
def test_bad_options_exit_with_a_message(argv, match, capsys):
    with pytest.raises(SystemExit):
        train.parse_args(argv)
    assert match in capsys.readouterr().err


def test_batches_count_each_symbol_in_its_own_sequence():
    import torch

    gen = torch.Generator().manual_seed(0)
    batch = train.make_batch(gen, 5, 12, 3, 8, torch.device("cpu"))
    for seq, targets in zip(batch.tokens.unbind(), batch.tokens.with_values(batch.targets).unbind(), strict=True):
        assert seq[0] == 3 and targets[0] == train.IGNORE  # BOS
        for token, target in zip(seq[1:].tolist(), targets[1:].tolist(), strict=True):
            assert target == min((seq[1:] == token).sum().item(), 8) - 1
    valid = ~batch.padding_mask
    assert torch.equal(batch.padded_tokens[valid], batch.tokens.values)
    assert torch.equal(batch.padded_targets[valid], batch.targets)
    assert (batch.padded_targets[~valid] == train.IGNORE).all()
