"""varlen.softmax over the ragged dim (Triton kernels, PyTorch path) and over inner dims."""

import dataclasses
import importlib
import math

import pytest
import torch

import varlen
from conftest import ON_GPU
from utils import ROW_LAYOUTS, assert_close, checkable_dtypes, random_jagged, random_lengths, rel_err, strided_rows
from varlen.attn.triton.configs import compute_capability
from varlen.capabilities import JAGGED_KERNELS

softmax_ops = importlib.import_module("varlen.ops.softmax")  # the module, not varlen.ops.softmax the function
_softmax_gluon = importlib.import_module("varlen.ops._softmax_gluon")

# Under the interpreter, masked lanes (columns past F, empty sequences) compute 0 / 0 in numpy; those
# lanes are never stored.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

LONG = 5000 if ON_GPU else 1000
# The float dtypes the Triton kernels declare (the PyTorch path takes them all); 16-bit on the GPU only.
DTYPES = checkable_dtypes(JAGGED_KERNELS["ragged"], half_on_cpu=False)
INNERS = [(), (3,), (2, 5)]
BACKENDS = ["torch", "triton"]


def per_sequence_softmax(values, lengths):
    """torch.softmax over each sequence's positions, in ``values``' dtype."""
    return torch.cat([torch.softmax(part, 0) for part in values.split(lengths)])


def per_sequence_softmax_backward(y, g, lengths):
    """torch's softmax backward over each sequence's positions, in ``y``'s dtype."""
    return torch.cat([torch._softmax_backward_data(gp, yp, 0, yp.dtype)
                      for yp, gp in zip(y.split(lengths), g.split(lengths), strict=True)])


def reference(values, lengths, grad=None):
    """Per-sequence float64 softmax over positions, and its autograd gradient for ``grad``."""
    x = values.detach().to(torch.float64).requires_grad_(grad is not None)
    y = per_sequence_softmax(x, lengths)
    if grad is None:
        return y.detach(), None
    y.backward(grad.to(torch.float64))
    return y.detach(), x.grad


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inner", INNERS, ids=str)
def test_ragged_softmax_matches_reference(backend, dtype, inner, device, poison_empty):
    lengths = random_lengths(7, 40, include=(0, 1, 17, LONG))
    x = random_jagged(lengths, inner, dtype=dtype, device=device, requires_grad=True)
    g = torch.randn_like(x.values)
    with varlen.use_backend(backend):
        y = varlen.softmax(x, dim=1)
        y.values.backward(g)
    ref_y, ref_dx = reference(x.values, lengths, g)
    assert isinstance(y, varlen.JaggedTensor) and y.offsets is x.offsets and y.max_len == x.max_len
    assert y.values.dtype == dtype and y.values.shape == x.values.shape
    assert_close(y.values, ref_y, dtype, name="y")
    assert_close(x.values.grad, ref_dx, dtype, name="dx")


# Forced plans: the split path with chunks, row loops and column edges inside a tile; the cooperative path
# with one tile per sequence (the interpreter runs it: nobody waits) and, on the GPU, with many. The cooperative
# forward that reads its chunks twice (chunk_rows > block_t): REREAD_PLANS.
PLANS = [softmax_ops.SoftmaxPlan(block_t=16, block_f=2, chunk_rows=64),
         softmax_ops.SoftmaxPlan(block_t=4, block_f=4, chunk_rows=8),
         softmax_ops.SoftmaxPlan(block_t=512, block_f=1, chunk_rows=None),
         softmax_ops.SoftmaxPlan(block_t=512, block_f=2, chunk_rows=512, cooperative=True),
         pytest.param(softmax_ops.SoftmaxPlan(block_t=16, block_f=2, chunk_rows=16, cooperative=True),
                      marks=pytest.mark.gpu_only)]
PLAN_IDS = ["split-64", "split-8", "single-narrow", "cooperative-one-tile", "cooperative-16"]


REREAD_PLANS = [softmax_ops.SoftmaxPlan(block_t=16, block_f=2, chunk_rows=512, cooperative=True),
                pytest.param(softmax_ops.SoftmaxPlan(block_t=16, block_f=2, chunk_rows=64, cooperative=True),
                             marks=pytest.mark.gpu_only),
                pytest.param(softmax_ops.SoftmaxPlan(block_t=4, block_f=4, chunk_rows=8, cooperative=True),
                             marks=pytest.mark.gpu_only)]
REREAD_IDS = ["reread-one-chunk", "reread-64", "reread-8"]


@pytest.mark.parametrize("plan", PLANS, ids=PLAN_IDS)
def test_plans_match_reference(plan, device, poison_empty):
    lengths = [0, 1, 17, 300, 40, 0] if plan.block_t > 4 else [0, 1, 17, 30, 0]
    x = random_jagged(lengths, (3,), dtype=torch.float64, device=device)
    values = 30 * x.values  # large logits: the max shift matters
    g = torch.randn_like(values)
    cols = values.reshape(x.total, -1)
    y = softmax_ops.softmax_fwd_triton(cols, x.offsets, x.max_len, plan)
    dx = softmax_ops.softmax_bwd_triton(y, g.reshape(x.total, -1), x.offsets, x.max_len, plan)
    ref_y, ref_dx = reference(values, lengths, g)
    assert_close(y.view_as(values), ref_y)
    assert_close(dx.view_as(values), ref_dx)


@pytest.mark.parametrize("plan", REREAD_PLANS, ids=REREAD_IDS)
def test_reread_plans_match_reference(plan, device, poison_empty):
    """The forward only: the backward holds its chunk (a re-reading plan is refused there)."""
    lengths = [0, 1, 17, 300, 40, 0] if plan.block_t > 4 else [0, 1, 17, 30, 0]
    x = random_jagged(lengths, (3,), dtype=torch.float64, device=device)
    values = 30 * x.values  # large logits: the max shift matters
    cols = values.reshape(x.total, -1)
    y = softmax_ops.softmax_fwd_triton(cols, x.offsets, x.max_len, plan)
    assert_close(y.view_as(values), reference(values, lengths)[0])
    with pytest.raises(ValueError, match="plan: the cooperative backward holds its chunk in one tile"):
        softmax_ops.softmax_bwd_triton(y, torch.ones_like(y), x.offsets, x.max_len, plan)


# The automatic plan, and forced plans whose blocks hold 64 columns: split, single, cooperative in one tile per
# sequence, on the GPU in many, and the forward that reads its chunks twice.
ROW_PLANS = [None,
             softmax_ops.SoftmaxPlan(block_t=16, block_f=64, chunk_rows=64),
             softmax_ops.SoftmaxPlan(block_t=512, block_f=64, chunk_rows=None),
             softmax_ops.SoftmaxPlan(block_t=512, block_f=64, chunk_rows=512, cooperative=True),
             pytest.param(softmax_ops.SoftmaxPlan(block_t=16, block_f=64, chunk_rows=16, cooperative=True),
                          marks=pytest.mark.gpu_only),
             pytest.param(softmax_ops.SoftmaxPlan(block_t=16, block_f=64, chunk_rows=64, cooperative=True),
                          marks=pytest.mark.gpu_only)]
ROW_PLAN_IDS = ["auto", "split-64", "single", "cooperative-one-tile", "cooperative-16", "reread-64"]


@pytest.mark.parametrize("plan", ROW_PLANS, ids=ROW_PLAN_IDS)
@pytest.mark.parametrize("layout", ROW_LAYOUTS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float64] + ([torch.float32, torch.bfloat16] if ON_GPU else []), ids=str)
def test_rows_not_16_apart(plan, layout, dtype, device, poison_empty):
    lengths = [0, 1, 17, 300, 40, 0]
    offsets = varlen.jagged([torch.zeros(n) for n in lengths], device=device).offsets
    x = strided_rows(sum(lengths), layout, dtype, device)
    g = strided_rows(sum(lengths), layout, dtype, device)
    y = softmax_ops.softmax_fwd_triton(x, offsets, 300, plan)
    ref_y, ref_dx = reference(x, lengths, g)
    assert_close(y, ref_y, dtype, name="y")
    if plan is None or not plan.rereads:
        assert_close(softmax_ops.softmax_bwd_triton(y, g, offsets, 300, plan), ref_dx, dtype, name="dx")


def test_automatic_plan_choice(device):
    # Interpreter / small: one tile per sequence. Too long for one tile: cooperative on a GPU while a sequence
    # has at most half as many tiles as there are SMs, else split (chunks on a GPU).
    plan = softmax_ops.softmax_plan(8, 1000, 10, 4, device)
    assert plan.chunk_rows is None and plan.block_t >= 1000
    plan = softmax_ops.softmax_plan(2, 300_000, 1024, 2, device)
    assert plan.chunk_rows is not None and plan.chunk_rows % plan.block_t == 0 and not plan.cooperative
    for elem_size, inputs in ((4, 1), (4, 2)):  # float32 forward and backward
        plan = softmax_ops.softmax_plan(64, 4096, 1024, elem_size, device, inputs=inputs)
        assert plan.cooperative == ON_GPU
        if ON_GPU:
            assert plan.block_t * plan.block_f * elem_size * inputs == softmax_ops.COOPERATIVE_TILE_BYTES
            assert plan.chunk_rows == plan.block_t
            assert -(-4096 // plan.block_t) <= softmax_ops.cooperative_max_chunks(device)
    plan = softmax_ops.softmax_plan(64, 4096, 1024, 2, device)  # 16-bit forward: chunks read twice
    assert plan.cooperative == plan.rereads == ON_GPU
    if ON_GPU:
        assert (plan.chunk_rows, plan.block_t) == (softmax_ops.REREAD_CHUNK_ROWS, softmax_ops.REREAD_BLOCK_T)
        assert plan.block_f == softmax_ops.COOPERATIVE_COLS
        # As many chunks as the bound allows, and one row more: split.
        longest = softmax_ops.cooperative_max_chunks(device) * softmax_ops.REREAD_CHUNK_ROWS
        assert softmax_ops.softmax_plan(2, longest, 1024, 2, device).rereads
        assert not softmax_ops.softmax_plan(2, longest + 1, 1024, 2, device).cooperative
        # Fewer columns than a block: tiles and chunks keep their elements.
        plan = softmax_ops.softmax_plan(2, 20000, 4, 2, device)
        assert plan.rereads and plan.block_f == 4
        assert plan.block_t * plan.block_f == softmax_ops.REREAD_BLOCK_T * softmax_ops.COOPERATIVE_COLS
        assert plan.chunk_rows * plan.block_f == softmax_ops.REREAD_CHUNK_ROWS * softmax_ops.COOPERATIVE_COLS


@pytest.mark.parametrize("sms", [132, 14])
def test_gpu_plans_take_a_bounded_number_of_variants_over_any_batch(sms, monkeypatch):
    """A stream of batches compiles a kernel variant per plan it meets: the single tile follows the longest sequence
    in powers of two (at most 13: 1 to 4,096 rows), the cooperative, shared-memory and re-reading plans have at most
    two tiers and the split plan one (the README's bound). On a GPU of fewer than 16 SMs the split plan has two: a
    one-column backward of 4,097-8,192 rows, past the single tile and the narrow tiles' bound, takes split tiles of
    8,192 rows (16,384 past that). The plans of a GPU of ``sms`` SMs, chosen off the GPU."""
    monkeypatch.setattr(softmax_ops, "sm_count", lambda device: sms)
    monkeypatch.setattr(varlen.tiling, "sm_count", lambda device: sms)
    monkeypatch.setattr(softmax_ops, "interpreter_enabled", lambda: False)
    gpu = torch.device("cuda")
    lengths = sorted({n for p in range(18) for n in (2**p - 1, 2**p, 2**p + 1)} | set(range(0, 300, 7)) | {70_000})
    bounds = {"single": 13, "cooperative": 2, "shared": 2, "reread": 2, "split": 1 if sms >= 16 else 2}
    for n_cols in (1, 3, 16, 40, 1024):
        for elem_size in (2, 4, 8):
            for inputs, shared in ((1, False), (1, elem_size <= 4), (2, False), (2, elem_size <= 4)):
                for aligned in (True, False):
                    variants = {}
                    for max_len in lengths:
                        plan = softmax_ops.softmax_plan(64, max_len, n_cols, elem_size, gpu, inputs=inputs,
                                                        shared=shared, aligned=aligned)
                        kind = ("single" if plan.chunk_rows is None else "shared" if plan.shared else "reread"
                                if plan.rereads else "cooperative" if plan.cooperative else "split")
                        constexprs = (plan.block_t, plan.block_f, plan.num_warps)
                        if kind in ("shared", "reread"):
                            constexprs += (plan.chunk_rows,)  # (a constexpr of those kernels)
                        variants.setdefault(kind, set()).add(constexprs)
                    for kind, seen in variants.items():
                        assert len(seen) <= bounds[kind], (n_cols, elem_size, inputs, shared, aligned, kind, seen)


@pytest.mark.parametrize("inputs", [1, 2], ids=["forward", "backward"])
def test_single_tile_rows_wide_enough(inputs, monkeypatch):
    """On a GPU a whole sequence takes one tile only where the tile's rows are at least SINGLE_MIN_ROW_BYTES per
    input (or hold every column): 8K elements, 16K for float32 whose rows 8K would leave narrower; else the
    cooperative plan. The 16-bit forward held in shared memory takes one tile only with every column. Rows not 16
    elements apart keep the rule before (8K elements, rows of 32 bytes over the inputs). The plan of an H100-sized
    GPU, chosen off the GPU (nothing runs)."""
    monkeypatch.setattr(softmax_ops, "sm_count", lambda device: 132)
    monkeypatch.setattr(varlen.tiling, "sm_count", lambda device: 132)
    monkeypatch.setattr(softmax_ops, "interpreter_enabled", lambda: False)
    gpu = torch.device("cuda")
    for max_len, elem_size, block_f in ((128, 2, 64), (256, 2, 32), (257, 2, None), (1024, 2, None),
                                        (512, 4, 16), (513, 4, 16), (1024, 4, 16), (1025, 4, None),
                                        (1024, 8, 8), (1025, 8, None)):
        plan = softmax_ops.softmax_plan(64, max_len, 1024, elem_size, gpu, inputs=inputs)
        assert (plan.chunk_rows is None) == (block_f is not None) and plan.cooperative != (block_f is not None), \
            (max_len, elem_size, plan)
        if block_f is not None:
            assert plan.block_f == block_f and plan.block_t == varlen.tiling.next_power_of_2(max_len), (max_len, plan)
            assert plan.block_f * elem_size >= softmax_ops.SINGLE_MIN_ROW_BYTES
            assert plan.num_warps == 8
    # Rows not 16 elements apart: the rule before (8K elements, rows of 32 bytes over the inputs).
    for max_len, elem_size, block_f in ((1024, 2, 8 if inputs == 2 else None), (1024, 4, 8), (2048, 4, 4 if inputs == 2
                                                                                               else None)):
        plan = softmax_ops.softmax_plan(64, max_len, 40, elem_size, gpu, inputs=inputs, aligned=False)
        assert (plan.chunk_rows is None) == (block_f is not None), (max_len, elem_size, plan)
        if block_f is not None:
            assert plan.block_f == block_f and plan.block_t == varlen.tiling.next_power_of_2(max_len)
    assert softmax_ops.rows_aligned(torch.zeros(3, 32), torch.zeros(8, 64)[:, :40])
    assert not softmax_ops.rows_aligned(torch.zeros(3, 40))
    assert not softmax_ops.rows_aligned(torch.zeros(32, 3).t())
    assert not softmax_ops.rows_aligned(torch.zeros(4, 48)[:, 1:33])  # (rows 48 apart, from 4 bytes past a boundary)
    # Every column in the tile: one tile whatever the row's width.
    plan = softmax_ops.softmax_plan(64, 4096, 2, 2, gpu, inputs=inputs)
    assert plan.chunk_rows is None and (plan.block_t, plan.block_f) == (4096, 2)
    # The 16-bit forward held in shared memory: chunks even for short sequences, unless the tile holds every column.
    plan = softmax_ops.softmax_plan(64, 128, 1024, 2, gpu, inputs=inputs, shared=inputs == 1)
    assert plan.shared == (inputs == 1) and (plan.chunk_rows is None) == (inputs == 2)
    plan = softmax_ops.softmax_plan(64, 128, 64, 2, gpu, inputs=inputs, shared=inputs == 1)
    assert plan.chunk_rows is None and (plan.block_t, plan.block_f) == (128, 64)


@pytest.mark.parametrize("sms", [132, 78])
def test_16_bit_backward_tiles_at_the_bound(sms, monkeypatch):
    """The 16-bit backward's cooperative tiles: 128 rows while a sequence's fit the bound, then 256, then split;
    the plan of a GPU with ``sms`` SMs (H100: 132), chosen off the GPU (nothing runs)."""
    monkeypatch.setattr(softmax_ops, "sm_count", lambda device: sms)
    monkeypatch.setattr(varlen.tiling, "sm_count", lambda device: sms)  # (the split plan's chunks)
    monkeypatch.setattr(softmax_ops, "interpreter_enabled", lambda: False)
    gpu = torch.device("cuda")
    most, rows = sms // 2, softmax_ops.HELD_16_BLOCK_T
    for max_len, block_t in ((4096, rows), (most * rows, rows), (most * rows + 1, 2 * rows),
                             (2 * most * rows, 2 * rows), (2 * most * rows + 1, None)):
        plan = softmax_ops.softmax_plan(64, max_len, 1024, 2, gpu, inputs=2)
        assert plan.cooperative == (block_t is not None), max_len
        if block_t is not None:
            assert plan.block_t == plan.chunk_rows == block_t and plan.block_f == softmax_ops.COOPERATIVE_COLS


@pytest.mark.parametrize("sms", [132, 78])
@pytest.mark.parametrize("inputs", [1, 2], ids=["forward", "backward"])
def test_float32_tiles_at_the_bounds(sms, inputs, monkeypatch):
    """The float32 cooperative tiles: 64 columns while a sequence has at most FLOAT32_WIDE_TILES of them, then 32
    columns of twice the rows while those fit the bound, then split; blocks of fewer columns keep their rows. The
    plan of a GPU with ``sms`` SMs, chosen off the GPU (nothing runs)."""
    monkeypatch.setattr(softmax_ops, "sm_count", lambda device: sms)
    monkeypatch.setattr(varlen.tiling, "sm_count", lambda device: sms)  # (the split plan's chunks)
    monkeypatch.setattr(softmax_ops, "interpreter_enabled", lambda: False)
    gpu = torch.device("cuda")
    most, wide = sms // 2, softmax_ops.FLOAT32_WIDE_TILES
    rows = softmax_ops.COOPERATIVE_TILE_BYTES // (softmax_ops.COOPERATIVE_COLS * 4 * inputs)
    for max_len, tile in ((4096, (rows, 64)), (wide * rows, (rows, 64)), (wide * rows + 1, (2 * rows, 32)),
                          (most * 2 * rows, (2 * rows, 32)), (most * 2 * rows + 1, None)):
        plan = softmax_ops.softmax_plan(64, max_len, 1024, 4, gpu, inputs=inputs)
        assert plan.cooperative == (tile is not None), max_len
        if tile is not None:
            assert (plan.block_t, plan.block_f) == tile and plan.chunk_rows == plan.block_t, max_len
    plan = softmax_ops.softmax_plan(64, wide * rows + 1, 20, 4, gpu, inputs=inputs)  # a block of 32 columns
    assert plan.cooperative and (plan.block_t, plan.block_f) == (rows, 32)


@pytest.mark.parametrize("sms", [132, 78])
def test_narrow_cooperative_tiles(sms, monkeypatch):
    """Blocks of 1-16 columns in the backward and one float32 column in the forward hold tiles of NARROW_TILE_ELEMS
    elements (16-bit backward) or NARROW_TILE_ELEMS_32, at most NARROW_BLOCK_T rows, 8 warps from 4,096 elements, while
    a sequence's tiles fit the bound (then split); wider blocks and the 16-bit forward keep their tiles. The plan of a
    GPU with ``sms`` SMs, chosen off the GPU (nothing runs)."""
    monkeypatch.setattr(softmax_ops, "sm_count", lambda device: sms)
    monkeypatch.setattr(varlen.tiling, "sm_count", lambda device: sms)
    monkeypatch.setattr(softmax_ops, "interpreter_enabled", lambda: False)
    gpu = torch.device("cuda")
    most = softmax_ops.cooperative_max_chunks(gpu)
    # (columns, element size, inputs): (rows, warps) of the tile
    tiles = {(1, 2, 2): (1024, 4), (4, 2, 2): (1024, 8), (16, 2, 2): (1024, 8), (1, 4, 2): (1024, 4),
             (4, 4, 2): (1024, 8), (8, 4, 2): (512, 8), (16, 4, 2): (256, 8), (16, 8, 2): (256, 8),
             (1, 4, 1): (1024, 4)}
    for (n_cols, elem_size, inputs), (rows, warps) in tiles.items():
        for max_len in (20_000, most * rows, most * rows + 1):
            plan = softmax_ops.softmax_plan(64, max_len, n_cols, elem_size, gpu, inputs=inputs, aligned=False)
            if max_len > most * rows:
                assert not plan.cooperative, (n_cols, elem_size, inputs, max_len, plan)
                continue
            assert plan == softmax_ops.SoftmaxPlan(rows, n_cols, rows, warps, cooperative=True), \
                (n_cols, elem_size, inputs, max_len, plan)
    # Wider blocks, and the 16-bit forward: their own tiles.
    rows = softmax_ops.HELD_16_BLOCK_T
    assert softmax_ops.softmax_plan(64, most * rows, 32, 2, gpu, inputs=2).block_t == rows
    rows = softmax_ops.COOPERATIVE_TILE_BYTES // (softmax_ops.COOPERATIVE_COLS * 4)
    assert softmax_ops.softmax_plan(64, most * rows, 32, 4, gpu).block_t == rows
    assert softmax_ops.softmax_plan(64, 20_000, 1, 2, gpu).rereads


@pytest.mark.parametrize("sms", [132, 78])
def test_narrow_32_and_64_bit_forward_reads_chunks_twice(sms, monkeypatch):
    """The 32- and 64-bit forward's blocks of 2-16 columns (one float64 column too) read chunks of
    REREAD_NARROW_CHUNK_ELEMS elements twice, in tiles of REREAD_NARROW_TILE_ELEMS and 4 warps; a sequence past the
    bound's chunks takes chunks of twice the rows, and one past that the split path. One float32 column and 32
    columns keep their held tiles. The plan of a GPU with ``sms`` SMs, chosen off the GPU (nothing runs)."""
    monkeypatch.setattr(softmax_ops, "sm_count", lambda device: sms)
    monkeypatch.setattr(varlen.tiling, "sm_count", lambda device: sms)
    monkeypatch.setattr(softmax_ops, "interpreter_enabled", lambda: False)
    gpu = torch.device("cuda")
    most = softmax_ops.cooperative_max_chunks(gpu)
    for n_cols, elem_size in ((2, 4), (3, 4), (4, 4), (8, 4), (16, 4), (1, 8), (2, 8), (4, 8), (16, 8)):
        block_f = 1 << (n_cols - 1).bit_length()
        block_t = softmax_ops.REREAD_NARROW_TILE_ELEMS // block_f
        rows = softmax_ops.REREAD_NARROW_CHUNK_ELEMS // block_f
        for max_len, chunk_rows in ((4097, rows), (most * rows, rows), (most * rows + 1, 2 * rows),
                                    (2 * most * rows, 2 * rows), (2 * most * rows + 1, None)):
            for aligned in (True, False):
                plan = softmax_ops.softmax_plan(64, max_len, n_cols, elem_size, gpu, aligned=aligned)
                if chunk_rows is None:
                    assert not plan.cooperative, (n_cols, elem_size, max_len, plan)
                    continue
                assert plan == softmax_ops.SoftmaxPlan(block_t, block_f, chunk_rows, 4, cooperative=True), \
                    (n_cols, elem_size, max_len, aligned, plan)
                assert plan.rereads
    assert not softmax_ops.softmax_plan(64, 20_000, 1, 4, gpu).rereads
    assert not softmax_ops.softmax_plan(64, 20_000, 32, 4, gpu).rereads


@pytest.mark.parametrize("elem_size", [2, 4, 8])
def test_single_tile_stops_at_4096_rows_on_a_gpu(elem_size, monkeypatch):
    """On a GPU one tile takes a whole sequence of at most SINGLE_MAX_ROWS rows (one column, forward and backward,
    every dtype): longer ones go to the cooperative plans, whose programs share the sequence. The interpreter keeps
    its 64K-element tiles. Plans of an H100-sized GPU, chosen off the GPU (nothing runs)."""
    monkeypatch.setattr(softmax_ops, "sm_count", lambda device: 132)
    monkeypatch.setattr(varlen.tiling, "sm_count", lambda device: 132)
    monkeypatch.setattr(softmax_ops, "interpreter_enabled", lambda: False)
    gpu = torch.device("cuda")
    for inputs in (1, 2):
        for aligned in (True, False):
            at_most = softmax_ops.softmax_plan(64, softmax_ops.SINGLE_MAX_ROWS, 1, elem_size, gpu, inputs=inputs,
                                               aligned=aligned)
            past = softmax_ops.softmax_plan(64, softmax_ops.SINGLE_MAX_ROWS + 1, 1, elem_size, gpu, inputs=inputs,
                                            aligned=aligned)
            assert at_most.chunk_rows is None and at_most.block_t == softmax_ops.SINGLE_MAX_ROWS, at_most
            assert past.cooperative, past
    cpu = softmax_ops.softmax_plan(64, 8192, 1, elem_size, torch.device("cpu"))
    assert cpu.chunk_rows is None and cpu.block_t == 8192


def test_cooperative_plan_refuses_to_wait_under_the_interpreter(device, monkeypatch):
    """Its tiles wait for each other: under the interpreter, which runs one program at a time, a sequence of two
    tiles would never finish, so the launcher refuses rather than hang (and the automatic plan never picks it)."""
    monkeypatch.setattr(softmax_ops, "interpreter_enabled", lambda: True)
    x = random_jagged([3, 20], (2,), dtype=torch.float64, device=device)
    assert not softmax_ops.softmax_plan(64, 4096, 1024, 4, device).cooperative
    plan = softmax_ops.SoftmaxPlan(block_t=16, block_f=2, chunk_rows=16, cooperative=True)
    with pytest.raises(ValueError, match="plan: the cooperative path's 2 chunks per sequence would wait"):
        softmax_ops.softmax_fwd_triton(x.values, x.offsets, x.max_len, plan)


@pytest.mark.parametrize("sms", [132, 78])
@pytest.mark.parametrize("key", sorted(softmax_ops.SHARED_TIERS), ids=lambda key: f"inputs{key[0]}-bytes{key[1]}")
def test_shared_tiers_at_the_bound(key, sms, monkeypatch):
    """Chunks held in shared memory (where ``_softmax_gluon`` takes the inputs): the first of ``SHARED_TIERS`` whose
    chunks of a sequence fit the bound, then the plans the inputs take without it; blocks of fewer than 64 columns and
    inputs the kernels don't take keep their plans. A GPU of ``sms`` SMs, chosen off the GPU."""
    monkeypatch.setattr(softmax_ops, "sm_count", lambda device: sms)
    monkeypatch.setattr(varlen.tiling, "sm_count", lambda device: sms)
    monkeypatch.setattr(softmax_ops, "interpreter_enabled", lambda: False)
    gpu, most = torch.device("cuda"), sms // 2
    inputs, elem_size = key
    tiers = softmax_ops.SHARED_TIERS[key]
    edges = [(4096, tiers[0])]
    for i, tier in enumerate(tiers):
        edges.append((most * tier[0], tier))
        edges.append((most * tier[0] + 1, tiers[i + 1] if i + 1 < len(tiers) else None))
    for max_len, tier in edges:
        plan = softmax_ops.softmax_plan(64, max_len, 1024, elem_size, gpu, inputs=inputs, shared=True)
        without = softmax_ops.softmax_plan(64, max_len, 1024, elem_size, gpu, inputs=inputs)
        assert plan.shared == (tier is not None) and not plan.rereads, max_len
        if tier is None:
            assert plan == without, max_len
        else:
            assert plan.cooperative and (plan.chunk_rows, plan.block_t, plan.block_f, plan.num_warps) == tier
    for n_cols in (20, 32, 40, 63, 64):  # blocks of 32 columns; of 64, below SHARED_MIN_COLS and at it
        plan = softmax_ops.softmax_plan(64, 4096, n_cols, elem_size, gpu, inputs=inputs, shared=True)
        held = n_cols > 32 and n_cols >= softmax_ops.SHARED_MIN_COLS.get(key, 0)
        assert plan.shared == held, n_cols
        if not held:
            assert plan == softmax_ops.softmax_plan(64, 4096, n_cols, elem_size, gpu, inputs=inputs), n_cols
    assert not softmax_ops.softmax_plan(64, 4096, 1024, elem_size, gpu, inputs=inputs).shared  # inputs it doesn't take
    # (float64: the kernels take no such inputs, and the plan holds none in shared memory even if told they do)
    assert not softmax_ops.softmax_plan(64, 4096, 1024, 8, gpu, inputs=inputs, shared=True).shared


def test_shared_plan_refused_where_it_cannot_run(device):
    """A plan holding chunks in shared memory runs a Gluon kernel: refused where ``_softmax_gluon.applies`` doesn't
    hold (off an sm_90 GPU, float64 here) and in shapes the kernels don't take (a chunk's bytes counted over the
    backward's two inputs); forward and backward alike."""
    plan = softmax_ops.SoftmaxPlan(block_t=64, block_f=64, chunk_rows=192, num_warps=2, cooperative=True, shared=True)
    x = random_jagged([3, 20], (64,), dtype=torch.float64, device=device)
    steps = (lambda plan: softmax_ops.softmax_fwd_triton(x.values, x.offsets, x.max_len, plan),
             lambda plan: softmax_ops.softmax_bwd_triton(x.values, x.values, x.offsets, x.max_len, plan))
    for step in steps:
        with pytest.raises(ValueError, match="plan: a chunk held in shared memory takes blocks of 128 or 256 bytes"):
            step(plan)  # (float64: 512 bytes a row)
        with pytest.raises(ValueError, match="plan: a chunk held in shared memory needs fp16/bf16/float32 values"):
            step(dataclasses.replace(plan, block_f=16))
        for bad in (dict(block_t=48), dict(block_t=512, chunk_rows=512), dict(chunk_rows=100), dict(block_f=8),
                    dict(num_warps=3), dict(block_t=256, chunk_rows=4096)):
            with pytest.raises(ValueError, match="plan: a chunk held in shared memory takes blocks of 128 or 256"):
                step(dataclasses.replace(plan, **{"block_f": 16, **bad}))
        for bad in (dict(cooperative=False), dict(chunk_rows=None)):
            with pytest.raises(ValueError, match="plan: shared=True holds a cooperative plan's chunks"):
                step(dataclasses.replace(plan, **bad))
    # 128 KiB of one input a chunk: the forward's bound, twice the backward's
    big = dataclasses.replace(plan, block_f=16, block_t=256, chunk_rows=1024)
    with pytest.raises(ValueError, match="plan: a chunk held in shared memory needs fp16/bf16/float32 values"):
        steps[0](big)
    with pytest.raises(ValueError, match="plan: a chunk held in shared memory takes blocks of 128 or 256"):
        steps[1](big)
    with pytest.raises(ValueError, match="plan: the cooperative backward holds its chunk"):
        steps[1](dataclasses.replace(plan, shared=False))  # (chunks read twice: the forward's only)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_one_sequence_stays_there(backend, device):
    lengths = [3, 17, 0, 5]
    x = random_jagged(lengths, (4,), device=device)
    x.values[3, 1] = math.nan  # sequence 1, column 1
    with varlen.use_backend(backend):
        y = varlen.softmax(x, 1).values
    ref, _ = reference(x.values, lengths)
    nan = torch.zeros_like(y, dtype=torch.bool)
    nan[3:20, 1] = True  # softmax spreads it over its own column of its own sequence, as torch
    assert torch.equal(torch.isnan(y), nan)
    assert_close(y[~nan], ref[~nan])


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_values_hidden_columns_not_read(backend, device):
    lengths = [5, 0, 12]
    big = torch.full((17, 9), math.nan, device=device)
    big[:, :4] = torch.randn(17, 4, device=device)
    big.requires_grad_()
    x = varlen.JaggedTensor(big[:, :4], torch.tensor([0, 5, 5, 17], device=device))
    g = torch.full((17, 9), math.nan, device=device)
    g[:, :4] = torch.randn(17, 4, device=device)
    with varlen.use_backend(backend):
        y = varlen.softmax(x, 1)
        y.values.backward(g[:, :4])
    ref_y, ref_dx = reference(big[:, :4], lengths, g[:, :4])
    assert_close(y.values, ref_y)
    assert_close(big.grad[:, :4], ref_dx)
    assert (big.grad[:, 4:] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_infinities(backend, device):
    x = random_jagged([4, 3], (2,), device=device)
    x.values[0, 0] = -math.inf  # one -inf in a column: probability 0 there
    x.values[4:7, 1] = -math.inf  # a whole column of -inf: NaN, as torch.softmax
    with varlen.use_backend(backend):
        y = varlen.softmax(x, 1).values
    ref, _ = reference(x.values, [4, 3])
    assert y[0, 0] == 0 and torch.isnan(y[4:7, 1]).all()
    assert_close(y, ref)


@pytest.mark.parametrize("plan", PLANS[:2] + REREAD_PLANS, ids=["split-64", "split-8"] + REREAD_IDS)
def test_infinities_split_plans(plan, device):
    """-inf across chunks and tile rows: slots that see only -inf, columns whose max arrives late, and a
    column of -inf only (NaN, as torch.softmax)."""
    lengths = [20, 11]
    x = random_jagged(lengths, (4,), device=device, dtype=torch.float64)
    x.values[:15, 0] = -math.inf  # the finite values of this column come in the last chunk
    x.values[20:, 1] = -math.inf  # the second sequence's column 1: all -inf
    x.values[3, 2] = 50.0  # a large max after smaller values: the running sums rescale
    x.values[::2, 3] = -math.inf  # alternate slots never see a finite value
    y = softmax_ops.softmax_fwd_triton(x.values.reshape(x.total, -1), x.offsets, x.max_len, plan)
    ref = per_sequence_softmax(x.values, lengths)
    assert torch.equal(torch.isnan(y), torch.isnan(ref)) and torch.isnan(y[20:, 1]).all()
    assert (y[:15, 0] == 0).all() and (y[20::2, 3] == 0).all()
    finite = ~torch.isnan(ref)
    assert_close(y[finite], ref[finite])


@pytest.mark.parametrize("plan", PLANS[:2] + REREAD_PLANS[:1], ids=["split-64", "split-8", "reread-one-chunk"])
def test_float64_past_float32_range_split_plans(plan, device):
    """Values near -1e300 spread over the chunks: the running maxima start at float64's lowest value (float32's
    would drop every value below -3.4e38)."""
    lengths = [20, 11]
    x = random_jagged(lengths, (4,), device=device, dtype=torch.float64)
    values = -1e300 * (1 + x.values.abs())
    y = softmax_ops.softmax_fwd_triton(values.reshape(x.total, -1), x.offsets, x.max_len, plan)
    assert_close(y.view_as(values), per_sequence_softmax(values, lengths))


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_empty_batch_one_and_nested_input(backend, device):
    empty = varlen.JaggedTensor(torch.zeros(0, 3, device=device), torch.zeros(4, dtype=torch.int64, device=device))
    one = random_jagged([LONG], (), device=device)
    with varlen.use_backend(backend):
        assert varlen.softmax(empty, 1).values.shape == (0, 3)
        assert_close(varlen.softmax(one, -1).values, torch.softmax(one.values.double(), 0))
        y = varlen.softmax(one.to_nested(), 1)
    assert isinstance(y, varlen.JaggedTensor)
    assert_close(y.values, torch.softmax(one.values.double(), 0))


@pytest.mark.parametrize("dim", [2, -1, 3, -2])
def test_inner_dims_run_on_values(dim, device):
    x = random_jagged([3, 0, 4], (2, 5), device=device, requires_grad=True)
    y = varlen.softmax(x, dim)
    assert y.offsets is x.offsets
    expected = torch.softmax(x.values, dim - 1 if dim > 0 else dim)
    assert torch.equal(y.values, expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_float64(backend, device):
    x = random_jagged([3, 0, 1, 2], (2,), dtype=torch.float64, device=device)

    def f(values):
        return varlen.softmax(x.with_values(values), 1).values

    with varlen.use_backend(backend):
        assert torch.autograd.gradcheck(f, (x.values.clone().requires_grad_(),))


def test_double_backward_is_refused(device):
    x = random_jagged([3, 2], (), dtype=torch.float64, device=device, requires_grad=True)
    y = varlen.softmax(x, 1).values
    (g,) = torch.autograd.grad((y**2).sum(), x.values, create_graph=True)
    with pytest.raises(NotImplementedError, match="no double backward"):
        g.sum().backward()
    # A gradient penalty, where the incoming gradient doesn't require grad: raises too (doesn't drop the term).
    (g,) = torch.autograd.grad(varlen.softmax(x, 1).values.sum(), x.values, create_graph=True)
    with pytest.raises(NotImplementedError, match="no double backward"):
        (g * x.values).sum().backward()


def test_bad_inputs(device):
    x = random_jagged([3, 2], (4,), device=device)
    with pytest.raises(ValueError, match="dim: got 0, the batch dim"):
        varlen.softmax(x, 0)
    with pytest.raises(ValueError, match="dim: 3 is out of range"):
        varlen.softmax(x, 3)
    with pytest.raises(TypeError, match="dim: expected an int"):
        varlen.softmax(x, 1.0)
    with pytest.raises(TypeError, match="x.values: dtype int64 is not supported"):
        varlen.softmax(x.with_values(x.values.long()), 1)
    with pytest.raises(TypeError, match="x: expected a varlen.JaggedTensor"):
        varlen.softmax(x.values, 1)


@pytest.mark.gpu_only
@pytest.mark.parametrize("lengths", [[0, 1, 17, 200, 256], [0, 1, 17, 300, 512], [0, 1, 17, 1000],
                                     [0, 1, 17, 1000, 4096, 0], [4096, 12000], [33000, 5], [1, 70000]], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
def test_gpu_sizes_every_plan(lengths, dtype, device, poison_empty):
    """Single tile (the 16-bit backward up to 256 rows, float32 up to 512 in tiles of 8K elements and 1024 in tiles
    of 16K, float64 up to 1024: test_single_tile_rows_wide_enough), cooperative (on sm_90 chunks held in shared
    memory: the forward's 192 rows up to 12672 (12000 near that bound) and 512 up to 33792 (33000), the backward's
    128 rows up to 8448 and 256 up to 16896 (12000); elsewhere in registers:
    float32 tiles of 64 columns up to 8192 rows forward and 4096 backward, then of 32 columns and twice the rows up to
    33792 and 16896 (12000 both, 33000 the forward); the 16-bit backward in tiles of 128 rows up to 8448 and 256
    beyond; the 16-bit forward's chunks read twice), split across many programs (a few long sequences), and one very
    long sequence."""
    x = random_jagged(lengths, (1024,), dtype=dtype, device=device, requires_grad=True)
    g = torch.randn_like(x.values)
    y = varlen.softmax(x, 1)
    y.values.backward(g)
    ref_y, ref_dx = reference(x.values, lengths, g)
    assert_close(y.values, ref_y, dtype)
    assert_close(x.values.grad, ref_dx, dtype)


@pytest.mark.gpu_only
@pytest.mark.parametrize("inner", [(1,), (2,), (3,), (8,), (16,), (20,), (40,)], ids=str)
@pytest.mark.parametrize("lengths", [[0, 9000, 12000, 1], [0, 8448, 5, 3000], [4097, 17, 6000, 0]], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64], ids=str)
def test_gpu_narrow_columns(inner, lengths, dtype, device, poison_empty):
    """Fewer columns than a cooperative block: the 16-bit forward's chunks, scaled to keep their elements (at 40
    columns held in shared memory on sm_90, in a block of 64 whose missing columns TMA fills with zeros, as the float32
    forward and backward are there; the 16-bit backward's stay in registers below 64 columns); the narrow
    tiles (NARROW_TILE_ELEMS, at most NARROW_BLOCK_T rows) of the backward at 1-16 columns and of the float32
    forward at one column; the 32- and 64-bit forward's chunks read twice at 2-16 columns (one float64 column); the
    tiles of 64-column blocks beyond; rows of 16-byte multiples and not (3, 20, 40 columns); sequences just past the
    single tile's SINGLE_MAX_ROWS."""
    x = random_jagged(lengths, inner, dtype=dtype, device=device, requires_grad=True)
    g = torch.randn_like(x.values)
    y = varlen.softmax(x, 1)
    y.values.backward(g)
    ref_y, ref_dx = reference(x.values, lengths, g)
    assert_close(y.values, ref_y, dtype)
    assert_close(x.values.grad, ref_dx, dtype)


# Narrow rows in a wider tensor: (columns, row stride, first column), off 16 bytes and not; the last takes every
# other column of its 8 (a column stride of 2).
NARROW_LAYOUTS = [(4, 7, 1), (2, 3, 0), (8, 12, 4), (1, 5, 2), (4, 8, -2)]


@pytest.mark.parametrize("layout", NARROW_LAYOUTS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_narrow_forward_chunks_read_twice_from_strided_rows(layout, dtype, device, poison_empty):
    """The 32- and 64-bit forward's narrow chunks read twice (tiles of REREAD_NARROW_TILE_ELEMS elements) from rows
    that are a view of a wider tensor, against float64: the automatic plan on the GPU (several chunks a sequence,
    which wait for each other), and everywhere the plan forced with one chunk a sequence (the interpreter runs one
    program at a time)."""
    n_cols, row_stride, first = layout
    lengths = [0, 1, 17, 9000, 300]
    if first < 0:  # every other column of a row of 2 * n_cols
        big = torch.randn(sum(lengths), 2 * n_cols, dtype=dtype, device=device)
        x = big[:, ::2]
    else:
        x = strided_rows(sum(lengths), layout, dtype, device)
    offsets = varlen.jagged([torch.zeros(n) for n in lengths], device=device).offsets
    ref_y, _ = reference(x, lengths)
    block_f = 1 << (n_cols - 1).bit_length()
    block_t = softmax_ops.REREAD_NARROW_TILE_ELEMS // block_f
    plans = [softmax_ops.SoftmaxPlan(block_t, block_f, 16384, 4, cooperative=True)]
    if device.type == "cuda":
        auto = softmax_ops.softmax_plan(len(lengths), 9000, n_cols, x.element_size(), device,
                                        aligned=softmax_ops.rows_aligned(x))
        assert (auto.rereads and auto.block_t == block_t) == (n_cols > 1 or dtype == torch.float64), auto
        plans.append(None)
    for plan in plans:
        assert_close(softmax_ops.softmax_fwd_triton(x, offsets, 9000, plan), ref_y, dtype, name=str(plan))


@pytest.mark.gpu_only
@pytest.mark.parametrize("inner", [(2,), (16,)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_gpu_narrow_forward_chunks_doubled(inner, dtype, device, poison_empty):
    """The 32- and 64-bit forward's narrow chunks read twice, in their second tier: the longest sequence is one row
    past this GPU's bound in chunks of REREAD_NARROW_CHUNK_ELEMS elements, so its chunks take twice the rows."""
    rows = softmax_ops.REREAD_NARROW_CHUNK_ELEMS // inner[0]
    lengths = [softmax_ops.cooperative_max_chunks(device) * rows + 1, 0, 5, rows + 3]
    x = random_jagged(lengths, inner, dtype=dtype, device=device)
    plan = softmax_ops.softmax_plan(len(lengths), x.max_len, inner[0], x.values.element_size(), device,
                                    aligned=softmax_ops.rows_aligned(x.values))
    assert plan.rereads and plan.chunk_rows == 2 * rows, plan
    ref_y, _ = reference(x.values, lengths)
    assert_close(softmax_ops.softmax_fwd_triton(x.values, x.offsets, x.max_len), ref_y, dtype)


@pytest.mark.gpu_only
@pytest.mark.parametrize("plan", [softmax_ops.SoftmaxPlan(block_t=128, block_f=1, chunk_rows=128, cooperative=True),
                                  softmax_ops.SoftmaxPlan(block_t=256, block_f=1, chunk_rows=256, cooperative=True)],
                         ids=["128x1", "256x1"])
def test_gpu_16_bit_backward_one_value_per_thread(plan, device, poison_empty):
    """The 16-bit cooperative backward's tile held as 16-bit values, at one column: one or two values per thread
    (the automatic plan's tiles hold more since the narrow tiles; the kernel still takes these). The longest sequence
    has as many tiles of 128 rows as this GPU's bound allows (66 on an H100 or H200)."""
    lengths = [0, softmax_ops.cooperative_max_chunks(device) * 128, 5, 3000]
    x = random_jagged(lengths, (1,), dtype=torch.bfloat16, device=device)
    y = softmax_ops.softmax_fwd_triton(x.values, x.offsets, x.max_len)
    g = torch.randn_like(y)
    _, ref_dx = reference(x.values, lengths, g)
    assert_close(softmax_ops.softmax_bwd_triton(y, g, x.offsets, x.max_len, plan), ref_dx, torch.bfloat16)


def _shared_cases():
    """(inputs, dtype, plan) for every plan of ``SHARED_TIERS``, and the other tile shapes the Gluon kernels take: one
    tile per chunk, rows of 256 bytes (the 16-bit backward's 128 columns, float32's 64), 1, 4 and 8 warps."""
    extra = {(1, 2): [(64, 64, 64, 4), (128, 32, 128, 4), (128, 64, 64, 8)],
             (1, 4): [(64, 64, 64, 2), (96, 32, 32, 1), (128, 32, 64, 8)],
             (2, 2): [(64, 32, 128, 4), (64, 64, 64, 1), (128, 64, 64, 8)],
             (2, 4): [(128, 32, 32, 1), (64, 64, 64, 4), (128, 32, 64, 8)]}
    cases = []
    for key, tiers in softmax_ops.SHARED_TIERS.items():
        inputs, elem_size = key
        for chunk_rows, block_t, block_f, warps in tiers + tuple(extra[key]):
            plan = softmax_ops.SoftmaxPlan(block_t=block_t, block_f=block_f, chunk_rows=chunk_rows, num_warps=warps,
                                           cooperative=True, shared=True)
            for dtype in ((torch.bfloat16, torch.float16) if elem_size == 2 else (torch.float32,)):
                name = f"{'fwd' if inputs == 1 else 'bwd'}-{str(dtype)[6:]}-{chunk_rows}x{block_t}x{block_f}w{warps}"
                cases.append(pytest.param(inputs, dtype, plan, id=name))
    return cases


@pytest.mark.gpu_only
@pytest.mark.skipif(not _softmax_gluon.applies(torch.zeros(8, 8, dtype=torch.bfloat16, device="cuda"))
                    if ON_GPU else True, reason="the shared-memory softmax kernels need an sm_90 GPU with Gluon")
@pytest.mark.parametrize("inputs, dtype, plan", _shared_cases())
@pytest.mark.parametrize("n_cols", [8, 40, 64, 200, 1024])
def test_gpu_shared_plans(inputs, dtype, plan, n_cols, device, poison_empty):
    """Every plan shape the Gluon kernels take (every tier, and one tile per chunk), forward and backward, at lengths
    0, 1, 17, 1000 and chunk edges, columns fewer than a block, one block, and partial blocks; -inf in a column, a
    column all -inf (NaN, as torch), a large max arriving late and a NaN kept in its column; within twice torch's own
    error at the same precision (flash-attn's rule); the same bits when run again. The longest sequence has 66 chunks
    of 64 rows (the bound of an H100 or H200): the combine loads its partials in more than one slice."""
    lengths = [0, 1, 17, 1000, 191, 192, 193, 0, 513, 2000, 4200]
    x = random_jagged(lengths, (n_cols,), dtype=torch.float32, device=device)
    values = 8 * x.values
    values[1:18, 0] = -math.inf  # sequence 2 (17 rows), column 0: all -inf
    values[18:500, n_cols - 1] = -math.inf  # most of a long sequence's last column: its max arrives late
    values[900, n_cols // 2] = 60.0  # a large max after smaller values: the running sums rescale
    values[1200, n_cols - 1] = math.nan  # sequence 4 (191 rows from 1018), the last column
    xd = values.to(dtype)
    if inputs == 1:
        out = softmax_ops.softmax_fwd_triton(xd, x.offsets, x.max_len, plan)
        ref, _ = reference(xd, lengths)
        torch_out = per_sequence_softmax(xd, lengths)
        again = softmax_ops.softmax_fwd_triton(xd, x.offsets, x.max_len, plan)
    else:
        y = per_sequence_softmax(xd, lengths)  # (NaN in the columns above, as a forward gives)
        g = torch.randn_like(y)
        out = softmax_ops.softmax_bwd_triton(y, g, x.offsets, x.max_len, plan)
        ref = softmax_ops.softmax_bwd_torch(y.double(), g.double(), x.offsets)
        torch_out = per_sequence_softmax_backward(y, g, lengths)
        again = softmax_ops.softmax_bwd_triton(y, g, x.offsets, x.max_len, plan)
    assert torch.equal(torch.isnan(out), torch.isnan(ref)) and torch.isnan(out[1:18, 0]).all()
    assert torch.isnan(out[1018:1209, n_cols - 1]).all()
    finite = ~torch.isnan(ref)
    assert rel_err(out[finite], ref[finite]) <= 2 * rel_err(torch_out[finite], ref[finite])
    # The largest error too: an error in one column would hide in the norm of all of them. In float32 the largest
    # error is one rounding of a column's sum in either implementation, where two roundings' ratio is noise (twice
    # torch's alone failed 2 of the 30 float32 backward cases on an H200): 2**-22 of the largest value more (2-4 units
    # in its last place).
    slack = 2.0**-22 * ref[finite].abs().max() if dtype == torch.float32 else 0.0
    assert (out[finite] - ref[finite]).abs().max() <= 2 * (torch_out[finite] - ref[finite]).abs().max() + slack
    bits = torch.int16 if dtype != torch.float32 else torch.int32
    assert torch.equal(again.view(bits), out.view(bits))  # bit for bit, NaNs included


@pytest.mark.gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_gpu_shared_plan_follows_the_inputs(dtype, device, monkeypatch):
    """Aligned fp16 / bf16 / float32 rows on an sm_90 GPU take the shared-memory kernels (varlen.softmax's automatic
    plan), forward and backward; a base off 16 bytes, a row stride off 16 bytes or a column stride other than 1 (of x,
    or of dy) take the plans in registers, with the same results."""
    launches = []
    for name in ("launch", "launch_backward"):
        real = getattr(_softmax_gluon, name)
        monkeypatch.setattr(_softmax_gluon, name, lambda *args, real=real, name=name: launches.append(name)
                            or real(*args))
    big = torch.randn(3000, 1040, dtype=dtype, device=device)
    offsets = torch.tensor([0, 1000, 1001, 3000], device=device)
    on_sm90 = compute_capability(device)[0] == 9 and _softmax_gluon.HAVE_GLUON and torch.version.hip is None
    aligned = 16 // big.element_size()  # (columns in 16 bytes)
    layouts = ((big[:, :1024], on_sm90), (big[:, aligned:1024 + aligned], on_sm90), (big[:, 1:1025], False),
               (big[:, :1018].contiguous()[:, :1012], False), (big[:, ::2], False))
    for step in ("launch", "launch_backward"):
        for t, shared in layouts:
            launches.clear()
            if step == "launch":
                assert _softmax_gluon.applies(t) == shared
                out = varlen.softmax(varlen.JaggedTensor(t, offsets, 1999), 1).values
                ref = softmax_ops.softmax_fwd_torch(t.double(), offsets)
            else:
                y = softmax_ops.softmax_fwd_torch(big[:, :t.shape[1]], offsets)  # (contiguous: t is dy)
                assert _softmax_gluon.applies(y, t) == shared
                out = softmax_ops.softmax_bwd_triton(y, t, offsets, 1999)
                ref = softmax_ops.softmax_bwd_torch(y.double(), t.double(), offsets)
            assert launches == ([step] if shared else []), (step, t.stride(), launches)
            assert_close(out, ref, dtype)


@pytest.mark.gpu_only
@pytest.mark.parametrize("dtype, fills", [
    (torch.bfloat16, [-1e9, torch.finfo(torch.bfloat16).min, 1e6, -1e30]),
    (torch.float16, [-65504.0, 60000.0, -30000.0, 65504.0]),
], ids=["bf16", "fp16"])
def test_gpu_16_bit_forward_large_magnitudes(dtype, fills, device):
    """Columns filled with large values (mask fills such as -1e9 or the dtype's lowest, values near the dtype's
    largest) and single huge values: every plan's forward within twice torch's own error, columns summing to 1
    (an exponent taken as x log2(e) - max log2(e) lost max log2(e)'s rounding there: a column of -1e9 summed to
    1e-11, and past 2.4e38 overflowed to NaN)."""
    lengths = [3000, 17, 700]
    x = torch.randn(sum(lengths), 1024, device=device)
    for c, fill in enumerate(fills):
        x[:, c] = fill  # every row
        x[::7, 64 + c] = fill  # every seventh row, with randn between
    if dtype == torch.bfloat16:
        x[100, 200] = 1e30
        x[200, 201] = 3e38
    x = x.to(dtype)
    offsets = torch.tensor([0, 3000, 3017, 3717], device=device)
    ref = softmax_ops.softmax_fwd_torch(x.double(), offsets)
    torch_err = (per_sequence_softmax(x, lengths).double() - ref).abs().max()
    y = varlen.softmax(varlen.JaggedTensor(x, offsets, 3000), 1).values
    assert torch.isfinite(y).all()
    assert (y.double() - ref).abs().max() <= 2 * torch_err
    sums = torch.stack([part.double().sum(0) for part in y.split(lengths)])
    assert (sums - 1).abs().max() < 0.05
