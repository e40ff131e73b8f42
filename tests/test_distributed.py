"""varlen.distributed: the context-parallel plan, and attention split over 2, 3 and 4 processes (gloo)
against the whole batch in one process (tests/distributed_worker.py)."""

import re
import socket

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp

import distributed_worker
from varlen.distributed import ContextParallel, make_plan
from varlen.distributed.context_parallel import head_chunks_for
from varlen.distributed.plan import Piece


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world: int, suite: str):
    mp.spawn(distributed_worker.worker, args=(world, _port(), suite), nprocs=world, join=True)


# --------------------------------------------------------------------------------------------- plan
LENGTH_MIXES = [[0, 1, 2, 37, 5, 64, 3], [1, 1, 1], [4096, 100, 8000, 3, 0, 900], [17], [0, 0, 5]]


@pytest.mark.parametrize("balance", ["causal", "tokens"])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("lengths", LENGTH_MIXES, ids=str)
def test_plan_owns_every_row_once(lengths, world, balance):
    plan = make_plan(lengths, world, balance)
    assert plan.world == world
    owned = sorted((p.sequence, i) for pieces in plan.pieces for p in pieces for i in range(p.start, p.end))
    assert owned == [(b, i) for b, n in enumerate(lengths) for i in range(n)]


def test_causal_plan_balances_the_work():
    """Long documents (8k-128k tokens): every rank within 2% of the mean causal work, at 2 to 8 ranks."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8192, 131073, (6,), generator=g).tolist() + [300, 5000, 77]
    for world in (2, 4, 8):
        plan = make_plan(lengths, world, "causal")
        work = [plan.work(r) for r in range(world)]
        assert max(work) <= 1.02 * sum(work) / world, (world, work)


def test_tokens_plan_balances_the_rows():
    plan = make_plan([10, 3, 0, 7], 3, "tokens")
    assert [plan.rows(r) for r in range(3)] == [6, 7, 7]
    assert plan.pieces[0] == (Piece(0, 0, 6),)


@pytest.mark.parametrize("args, error, message", [
    (([3, 4], 0), ValueError, "world: got 0; must be >= 1"),
    (([3, 4], -1), ValueError, "world: got -1; must be >= 1"),
    (([3, 4], 2.0), TypeError, "world: expected an int, got float 2.0"),
    (([3, 4], 2, "bogus"), ValueError, "balance: got 'bogus'; allowed: 'causal', 'tokens'"),
    (([3, -4], 2), ValueError, "lengths[1]: got -4; must be >= 0"),
    (([3, 4.5], 2), TypeError, "lengths[1]: expected an int, got float 4.5"),
    ((torch.tensor([3, 4]), 2), TypeError, "lengths: expected a list of ints, got Tensor"),
])
def test_plan_bad_input(args, error, message):
    """make_plan is public: bad arguments raise errors naming them (world 0 divided by zero, -1 gave an empty plan,
    an unknown balance was taken as "causal")."""
    with pytest.raises(error, match=re.escape(message)):
        make_plan(*args)


def test_zigzag_pairs_an_early_chunk_with_a_late_one():
    plan = make_plan([80], 2, "causal")
    assert plan.pieces == ((Piece(0, 0, 20), Piece(0, 60, 80)), (Piece(0, 20, 60),))  # the middle chunks meet


def test_head_chunks():
    assert head_chunks_for(32, 2, 0.0, None) == 4  # a group's gathered K/V: half the rank's own
    assert head_chunks_for(8, 3, 0.0, None) == 8
    assert head_chunks_for(1, 2, 0.0, None) == 1
    assert head_chunks_for(32, 2, 0.1, None) == 1  # dropout's mask is keyed on the head index in the call
    assert head_chunks_for(6, 2, 0.0, 3) == 3
    assert type(head_chunks_for(6, 2, 0.0, np.int64(3))) is int  # (as torch takes numpy's ints)
    with pytest.raises(ValueError, match="head_chunks: got 4; it must divide the 6 kv heads"):
        head_chunks_for(6, 2, 0.0, 4)
    with pytest.raises(ValueError, match="head_chunks: got 2 with dropout_p=0.1"):
        head_chunks_for(6, 2, 0.1, 2)
    with pytest.raises(TypeError, match="head_chunks: expected an int or None, got float"):
        head_chunks_for(6, 2, 0.0, 2.0)


def test_errors_without_a_process_group():
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        ContextParallel(torch.tensor([0, 3, 5]))
    with pytest.raises(ValueError, match="offsets: must not decrease"):
        ContextParallel(torch.tensor([0, 3, 2]))
    with pytest.raises(ValueError, match="balance: got 'heads'"):
        ContextParallel(torch.tensor([0, 3, 5]), balance="heads")


# ----------------------------------------------------------------------------------- multi-process
@pytest.mark.parametrize("world", [2, 3, 4])
def test_context_parallel_matches_one_process(world):
    """Outputs, lse and the gradients of every rank's q, k, v rows equal the whole batch's (float64, the
    PyTorch backend): causal, windows, GQA, Dv != D, softcap, ALiBi, prefixes, dropout, both balances."""
    _spawn(world, "torch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through Triton's interpreter, as CI runs it (the "
                    "GPU machines' Triton 3.6 interpreter can't run these kernels); on GPUs the compiled kernels "
                    "run in test_context_parallel_nccl_two_gpus")
def test_context_parallel_triton_kernels():
    """The same through the Triton kernels (float32, CPU tensors over gloo, the interpreter)."""
    _spawn(2, "triton")


@pytest.mark.gpu_only
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL): run on a machine with two")
def test_context_parallel_nccl_two_gpus():
    """bf16/fp16 through the Triton kernels over NCCL, sequences up to 3000 rows: within twice the error of
    the same call in one process (flash-attn's rule), against float64."""
    _spawn(2, "nccl")


def test_context_parallel_under_compile_and_ddp():
    _spawn(2, "compile")
    _spawn(2, "ddp")
