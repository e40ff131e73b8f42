"""varlen.cross_entropy against torch's cross-entropy of the logits in float64."""

import math
import re

import pytest
import torch
import torch.nn.functional as F

import varlen
from conftest import DEVICE, ON_GPU
from utils import assert_close
from varlen.ops.cross_entropy import cross_entropy_fwd_triton

DTYPES = [torch.float32, torch.float64, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
BACKENDS = ["torch", "triton"]
# Vocabularies under one block, odd, whole blocks only (the forward's loop with no partial block), a few blocks (the
# forward takes 2048 per step, 1024 in float64; the backward 4096 per program).
VOCABS = [5, 100, 4096 if ON_GPU else 64, 4097, 9000 if ON_GPU else 2100]


def _case(rows, vocab, dtype, ignored=()):
    logits = (3 * torch.randn(rows, vocab, device=DEVICE)).to(dtype).requires_grad_(True)
    targets = torch.randint(0, vocab, (rows,), device=DEVICE)
    for r in ignored:
        targets[r] = -100
    return logits, targets


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_backward(dtype, vocab, reduction, backend):
    logits, targets = _case(37, vocab, dtype, ignored=(0, 5, 36))
    loss = varlen.cross_entropy(logits, targets, reduction=reduction, backend=backend)
    grad = torch.randn_like(loss)
    loss.backward(grad)
    x64 = logits.detach().double().requires_grad_(True)
    ref = F.cross_entropy(x64, targets, reduction=reduction)
    ref.backward(grad.double())
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert logits.grad.dtype == dtype
    assert_close(loss, ref, dtype, name="loss")
    assert_close(logits.grad, x64.grad, dtype, name="dlogits")
    if reduction == "none":
        assert torch.equal(loss[[0, 5, 36]].detach(), torch.zeros(3, dtype=loss.dtype, device=DEVICE))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_and_other_ignore_index(backend):
    logits = torch.randn(6, 11, dtype=torch.float64, device=DEVICE, requires_grad=True)
    targets = torch.tensor([3, 7, 0, 10, 7, 2], device=DEVICE)
    assert torch.autograd.gradcheck(
        lambda x: varlen.cross_entropy(x, targets, ignore_index=7, backend=backend), (logits,))
    ref = F.cross_entropy(logits, targets, ignore_index=7)
    assert_close(varlen.cross_entropy(logits, targets, ignore_index=7, backend=backend), ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_row_ignored_and_no_rows(backend):
    logits, targets = _case(4, 9, torch.float32, ignored=range(4))
    loss = varlen.cross_entropy(logits, targets, backend=backend)
    assert torch.isnan(loss)  # a mean over no targets, as torch's
    assert varlen.cross_entropy(logits, targets, reduction="sum", backend=backend).item() == 0.0
    empty = torch.randn(0, 9, device=DEVICE, requires_grad=True)
    out = varlen.cross_entropy(empty, torch.zeros(0, dtype=torch.int64, device=DEVICE), reduction="sum",
                               backend=backend)
    out.backward()
    assert out.item() == 0.0 and empty.grad.shape == (0, 9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_logits_keep_their_precision(backend):
    """Rows of huge equal logits (the log of the sum must not vanish into the max) and logits offset by 3e4."""
    logits = torch.full((2, 30), -torch.finfo(torch.float32).max, device=DEVICE)
    logits[1] = torch.randn(30, device=DEVICE) + 3e4
    logits.requires_grad_(True)
    targets = torch.tensor([4, 7], device=DEVICE)
    loss = varlen.cross_entropy(logits, targets, reduction="none", backend=backend)
    loss.sum().backward()
    x64 = logits.detach().double().requires_grad_(True)
    ref = F.cross_entropy(x64, targets, reduction="none")
    ref.sum().backward()
    assert_close(loss, ref, tol=1e-6, name="loss")
    assert_close(logits.grad, x64.grad, tol=1e-5, name="dlogits")


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_range_and_non_finite_rows(backend):
    """float64 logits past float32's range (the running maxima start at float64's lowest value, not float32's), and
    rows holding +inf, NaN or only -inf: NaN losses, as torch's."""
    logits = torch.full((6, 30), -1e300, dtype=torch.float64, device=DEVICE)
    logits[0, 3] = -5e299  # the row's max, 5e299 above the rest
    logits[1] = -1e300 * (1 + torch.rand(30, dtype=torch.float64, device=DEVICE))
    logits[2, 5] = 1e300
    logits[3, 9] = math.inf
    logits[4, 2] = math.nan
    logits[5] = -math.inf
    targets = torch.tensor([3, 7, 0, 1, 4, 6], device=DEVICE)
    loss = varlen.cross_entropy(logits, targets, reduction="none", backend=backend)
    ref = F.cross_entropy(logits, targets, reduction="none")
    assert torch.equal(torch.isnan(loss), torch.isnan(ref)) and torch.isnan(loss[3:]).all()
    assert_close(loss[:3], ref[:3], tol=1e-12, name="loss")


@pytest.mark.parametrize("backend", BACKENDS)
def test_double_backward_raises(backend):
    """A gradient penalty (create_graph=True, then the gradient times the input) differentiates the gradient even
    where the incoming gradient doesn't require grad: the Triton path raises instead of dropping that term."""
    logits, targets = _case(5, 9, torch.float64)
    (g,) = torch.autograd.grad(varlen.cross_entropy(logits, targets, backend=backend), logits, create_graph=True)
    if backend == "torch":
        (g * logits).sum().backward()
        return
    with pytest.raises(NotImplementedError, match="varlen.cross_entropy: the Triton path has no double backward"):
        (g * logits).sum().backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_vocabulary_and_narrow_targets(backend):
    """An empty vocabulary: every row ignored gives a sum of 0 (the Triton kernel reads nothing); int32 targets on
    both backends."""
    empty = torch.randn(3, 0, device=DEVICE)
    ignored = torch.full((3,), -100, device=DEVICE)
    assert varlen.cross_entropy(empty, ignored, reduction="sum", backend=backend).item() == 0.0
    logits, targets = _case(4, 6, torch.float32)
    got = varlen.cross_entropy(logits, targets.int(), backend=backend)
    assert_close(got, F.cross_entropy(logits.double(), targets))


def test_strided_logits_and_int32_targets():
    # rows of a wider tensor (a view), int32 targets; large logits (a max of 1e4 must not overflow exp)
    wide = torch.randn(9, 30, device=DEVICE) * 1e4
    logits, targets = wide[:, 3:20], torch.randint(0, 17, (9,), device=DEVICE, dtype=torch.int32)
    got = varlen.cross_entropy(logits, targets, backend="triton")
    assert_close(got, F.cross_entropy(logits.double(), targets.long()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["column", "expanded"])
def test_targets_of_any_stride(backend, layout):
    """int64 targets that are a column of a wider tensor or one index expanded to every row: the kernels read them as
    they are meant (they read targets[row] at stride 1, so the launchers make them contiguous; an expanded index was
    read past its one element)."""
    logits = (3 * torch.randn(6, 5, device=DEVICE, dtype=torch.float64)).requires_grad_(True)
    pairs = torch.tensor([[1, 4], [2, 0], [3, 1], [0, 2], [4, 3], [1, 1]], device=DEVICE)
    targets = {"column": pairs[:, 0], "expanded": torch.tensor(3, device=DEVICE).expand(6)}[layout]
    assert not targets.is_contiguous() and targets.dtype == torch.int64
    got = varlen.cross_entropy(logits, targets, reduction="none", backend=backend)
    ref = F.cross_entropy(logits, targets, reduction="none")
    assert_close(got, ref)
    g = torch.randn(6, device=DEVICE, dtype=torch.float64)
    assert_close(torch.autograd.grad(got, logits, g)[0], torch.autograd.grad(ref, logits, g)[0])


@pytest.mark.parametrize("call, error, message", [
    pytest.param(lambda: varlen.cross_entropy(torch.randn(3, 4), torch.tensor([0.0, 1.0, 2.0])), TypeError,
                 "targets: expected integer class indices, got dtype torch.float32", id="float-targets"),
    pytest.param(lambda: varlen.cross_entropy(torch.randn(3, 4), torch.zeros(2, dtype=torch.int64)), ValueError,
                 "targets: expected shape (3,), one per row of logits (3, 4); got (2,)", id="shape"),
    pytest.param(lambda: varlen.cross_entropy(torch.randn(3, 4, 2), torch.zeros(3, dtype=torch.int64)), ValueError,
                 "logits: expected (N, V) rows, got shape (3, 4, 2)", id="3-d"),
    pytest.param(lambda: varlen.cross_entropy(torch.randn(3, 4), [0, 1, 2]), TypeError,
                 "targets: expected a torch.Tensor, got list", id="list-targets"),
    pytest.param(lambda: varlen.cross_entropy(torch.randn(3, 4), torch.zeros(3, dtype=torch.int64, device="meta")),
                 ValueError, "targets: on meta, but logits are on cpu", id="device"),
    pytest.param(lambda: varlen.cross_entropy(torch.randn(3, 4), torch.zeros(3, dtype=torch.int64), ignore_index=2**63),
                 ValueError, "ignore_index: expected an int64 value", id="ignore-index-range"),
    pytest.param(lambda: varlen.cross_entropy(torch.zeros(3, 4, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)),
                 TypeError, "logits", id="int-logits"),
    pytest.param(lambda: varlen.cross_entropy(torch.randn(3, 4), torch.zeros(3, dtype=torch.int64), reduction="avg"),
                 ValueError, "reduction", id="reduction"),
    pytest.param(lambda: varlen.cross_entropy(torch.randn(3, 4), torch.zeros(3, dtype=torch.int64), ignore_index=1.0),
                 TypeError, "ignore_index: expected an int, got float", id="ignore-index"),
])
def test_bad_input(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [50, -1, 2**40])
def test_target_out_of_range_raises_where_it_can_be_read(backend, bad):
    """A target outside [0, V) that isn't ignore_index: a ValueError naming it on the CPU (torch's own IndexError there
    named nothing; the Triton path gave NaN) and on a GPU in the checking mode."""
    logits, targets = _case(3, 50, torch.float32)
    targets[1] = bad
    varlen.set_checks(True)
    try:
        with pytest.raises(ValueError, match=re.escape(f"targets: [{bad}] at rows [1] lie outside [0, 50)")):
            varlen.cross_entropy(logits, targets, backend=backend)
    finally:
        varlen.set_checks(False)
    targets[1] = -100  # (ignore_index: fine)
    assert torch.isfinite(varlen.cross_entropy(logits, targets, backend=backend))


def test_target_out_of_range_gives_nan_not_a_read_outside():
    """Unchecked (a GPU outside the checking mode), the kernel reads no logit outside the row: NaN for that row."""
    logits, targets = _case(3, 50, torch.float32)
    for bad in (50, -1):
        targets[1] = bad
        losses, _, _ = cross_entropy_fwd_triton(logits.detach(), targets, -100)
        assert torch.isnan(losses[1]) and torch.isfinite(losses[[0, 2]]).all()
