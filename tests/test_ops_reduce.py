"""varlen.sum / varlen.mean over the ragged dim (Triton kernels, PyTorch path) and over inner dims."""

import importlib
import math

import pytest
import torch

import varlen
from conftest import ON_GPU
from utils import ROW_LAYOUTS, assert_close, checkable_dtypes, random_jagged, random_lengths, strided_rows
from varlen.capabilities import JAGGED_KERNELS

reduce_ops = importlib.import_module("varlen.ops.reduce")

# Under the interpreter the mean of an empty sequence computes 0 / 0 in numpy (NaN, as intended).
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

LONG = 5000 if ON_GPU else 1000
# The float dtypes the Triton kernels declare (the PyTorch path takes them all); 16-bit on the GPU only.
DTYPES = checkable_dtypes(JAGGED_KERNELS["ragged"], half_on_cpu=False)
INNERS = [(), (3,), (2, 5)]
BACKENDS = ["torch", "triton"]
OPS = {"sum": varlen.sum, "mean": varlen.mean}


def reference(values, lengths, op, grad=None):
    """Per-sequence float64 sum/mean over positions (NaN mean for an empty one), and its gradient."""
    x = values.detach().to(torch.float64).requires_grad_(grad is not None)
    out = torch.stack([getattr(part, op)(0) for part in x.split(lengths)])
    if grad is None:
        return out.detach(), None
    out.backward(grad.to(torch.float64))
    return out.detach(), x.grad


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inner", INNERS, ids=str)
def test_ragged_reduction_matches_reference(op, backend, dtype, inner, device, poison_empty):
    lengths = random_lengths(7, 40, include=(0, 1, 17, LONG))
    x = random_jagged(lengths, inner, dtype=dtype, device=device, requires_grad=True)
    g = torch.randn(len(lengths), *inner, dtype=dtype, device=device)
    with varlen.use_backend(backend):
        out = OPS[op](x, 1)
        out.backward(g)
    ref, ref_dx = reference(x.values, lengths, op, g)
    assert isinstance(out, torch.Tensor) and out.shape == (len(lengths), *inner) and out.dtype == dtype
    assert_close(out, ref, dtype, name=op)
    assert_close(x.values.grad, ref_dx, dtype, name="dx")
    empty = out[0]  # lengths[0] == 0
    assert (empty == 0).all() if op == "sum" else torch.isnan(empty).all()


@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
@pytest.mark.parametrize("tiles", [dict(block_t=8, chunk_rows=32), dict(block_t=1, block_f=1),
                                   dict(block_t=4, block_f=2, chunk_rows=4, num_warps=2, stages=3)], ids=str)
def test_forced_tiles_and_chunks(mean, tiles, device, poison_empty):
    """Sequences split into chunks (the last chunk to finish adds the partial sums, in the kernel), pipelined
    loads and tiny tiles with edges."""
    lengths = [0, 1, 6, 3] if tiles.get("block_t") in (1, 4) else [0, 1, 17, 90, 5]
    x = random_jagged(lengths, (3,), dtype=torch.float64, device=device)
    out = reduce_ops.segment_sum_triton(x.values, x.offsets, x.max_len, mean, **tiles)
    ref, _ = reference(x.values, lengths, "mean" if mean else "sum")
    assert_close(out, ref)
    g = torch.randn(len(lengths), 3, dtype=torch.float64, device=device)
    tile_args = {k: v for k, v in tiles.items() if k not in ("chunk_rows", "stages")}
    dx = reduce_ops.broadcast_rows_triton(g, x.offsets, x.total, x.max_len, mean, **tile_args)
    scale = [max(n, 1) if mean else 1 for n in lengths]
    assert_close(dx, torch.cat([g[b].expand(n, 3) / scale[b] for b, n in enumerate(lengths)]))


@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
@pytest.mark.parametrize("tiles", [{}, dict(block_t=16, block_f=64, chunk_rows=32)], ids=["auto", "chunks"])
@pytest.mark.parametrize("layout", ROW_LAYOUTS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float64] + ([torch.float32, torch.bfloat16] if ON_GPU else []), ids=str)
def test_rows_not_16_apart(mean, tiles, layout, dtype, device, poison_empty):
    """Values and gradients whose rows are not 16 elements apart (the kernels load ROW_ALIGN elements at once), with
    sequences in one chunk and in several (the partial sums, n_cols apart)."""
    lengths = [0, 1, 17, 300, 40]
    offsets = varlen.jagged([torch.zeros(n) for n in lengths], device=device).offsets
    x = strided_rows(sum(lengths), layout, dtype, device)
    out = reduce_ops.segment_sum_triton(x, offsets, 300, mean, **tiles)
    ref, _ = reference(x, lengths, "mean" if mean else "sum")
    assert_close(out, ref, dtype)
    g = strided_rows(len(lengths), layout, dtype, device)
    tile_args = {k: v for k, v in tiles.items() if k != "chunk_rows"}
    dx = reduce_ops.broadcast_rows_triton(g, offsets, sum(lengths), 300, mean, **tile_args)
    scale = [max(n, 1) if mean else 1 for n in lengths]
    ref_dx = torch.cat([g[b].double().expand(n, -1) / scale[b] for b, n in enumerate(lengths)])
    assert_close(dx, ref_dx, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_one_sequence_stays_there(backend, device):
    lengths = [3, 17, 0, 5]
    x = random_jagged(lengths, (4,), device=device)
    x.values[3, 1] = math.nan  # sequence 1, column 1
    with varlen.use_backend(backend):
        out = varlen.sum(x, 1)
    ref, _ = reference(x.values, lengths, "sum")
    assert torch.isnan(out[1, 1]) and torch.isfinite(out.flatten()[torch.arange(16) != 5]).all()
    assert_close(out, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_values_and_gradient(backend, device):
    lengths = [5, 0, 12]
    big = torch.full((17, 9), math.nan, device=device)
    big[:, :4] = torch.randn(17, 4, device=device)
    big.requires_grad_()
    x = varlen.JaggedTensor(big[:, :4], torch.tensor([0, 5, 5, 17], device=device))
    with varlen.use_backend(backend):
        out = varlen.mean(x, 1)
        out.sum().backward()  # an expanded (stride 0) gradient
    ref, ref_dx = reference(big[:, :4], lengths, "mean", torch.ones(3, 4, device=device))
    assert_close(out, ref)
    assert_close(big.grad[:, :4], ref_dx)
    assert (big.grad[:, 4:] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_inner_dims_keepdim_and_mixed(backend, device):
    lengths = [3, 0, 4]
    x = random_jagged(lengths, (2, 5), dtype=torch.float64, device=device)
    with varlen.use_backend(backend):
        inner = varlen.sum(x, (2, -1))
        inner_keep = varlen.mean(x, 3, keepdim=True)
        kept = varlen.sum(x, 1, keepdim=True)
        mixed = varlen.mean(x, (1, -1))
        mixed_keep = varlen.sum(x, (-1, 1, 2), keepdim=True)
    assert isinstance(inner, varlen.JaggedTensor) and inner.offsets is x.offsets
    assert torch.equal(inner.values, x.values.sum((1, 2)))
    assert torch.equal(inner_keep.values, x.values.mean(2, keepdim=True))
    ref_sum, _ = reference(x.values, lengths, "sum")
    ref_mean, _ = reference(x.values, lengths, "mean")
    assert kept.shape == (3, 1, 2, 5)
    assert_close(kept[:, 0], ref_sum)
    assert mixed.shape == (3, 2)
    assert_close(mixed, ref_mean.mean(-1))
    assert mixed_keep.shape == (3, 1, 1, 1)
    assert_close(mixed_keep.flatten(), ref_sum.sum((1, 2)))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_16_bit_over_ragged_and_inner_dims_accumulates_in_float32(op, backend, device):
    """fp16 (and bf16 on the GPU) over the ragged and an inner dim together: the inner partial sums stay in float32,
    as the ragged sum does. Rounded to 16 bits first they overflowed (rows of +-40000 summed to NaN) and lost
    precision (up to 13x torch's own error); now within twice the error of torch's fp16 reduction of each sequence,
    with the gradient of the float64 reference."""
    for dtype in [torch.float16] + ([torch.bfloat16] if ON_GPU else []):
        big = torch.tensor([[40000.0, 40000.0], [-40000.0, -40000.0], [1.0, 2.0]], dtype=dtype, device=device)
        x = varlen.JaggedTensor(big, torch.tensor([0, 2, 3], device=device))
        got = OPS[op](x, (1, 2), backend=backend)
        assert got.dtype == dtype
        assert_close(got, torch.tensor([0.0, 3.0 if op == "sum" else 1.5], dtype=dtype, device=device))
        lengths = [300, 17, 0, 200]
        x = random_jagged(lengths, (64,), dtype=dtype, device=device, requires_grad=True)
        got = OPS[op](x, (1, 2), backend=backend)
        x64 = x.values.detach().double().requires_grad_(True)
        ref = torch.stack([getattr(part, op)() for part in x64.split(lengths)])
        own = torch.stack([getattr(part, op)() for part in x.values.detach().split(lengths)]).double()
        err, own_err = (got.double() - ref).abs().nan_to_num(), (own - ref).abs().nan_to_num()
        assert bool((err <= 2 * own_err + 2 * torch.finfo(dtype).eps * ref.abs().nan_to_num()).all()), (err, own_err)
        grad = torch.randn_like(got).nan_to_num()
        (dx,) = torch.autograd.grad(got, x.values, grad)
        (want,) = torch.autograd.grad(ref, x64, grad.double())
        assert_close(dx, want, tol=2 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_empty_and_batch_one(backend, device):
    empty = varlen.JaggedTensor(torch.zeros(0, 3, device=device), torch.zeros(3, dtype=torch.int32, device=device))
    one = random_jagged([LONG], (2,), dtype=torch.float64, device=device)
    with varlen.use_backend(backend):
        assert torch.equal(varlen.sum(empty, 1), torch.zeros(2, 3, device=device))
        assert torch.isnan(varlen.mean(empty, 1)).all()
        assert_close(varlen.mean(one, 1), one.values.mean(0, keepdim=True))


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_and_gradgradcheck_float64(op, backend, device):
    # The mean of an empty sequence is NaN, whose finite differences are NaN: no empty one for mean.
    x = random_jagged([3, 0, 1, 2] if op == "sum" else [3, 1, 2], (), dtype=torch.float64, device=device)

    def f(values):
        return OPS[op](x.with_values(values), 1)

    with varlen.use_backend(backend):
        v = x.values.clone().requires_grad_()
        assert torch.autograd.gradcheck(f, (v,))
        # The backward (a broadcast) is differentiable too: its backward is the reduction.
        assert torch.autograd.gradgradcheck(f, (v,))


def test_bad_inputs(device):
    x = random_jagged([3, 2], (4,), device=device)
    with pytest.raises(ValueError, match="includes the batch dim 0"):
        varlen.sum(x, 0)
    with pytest.raises(ValueError, match="includes the batch dim 0"):
        varlen.mean(x, (1, 0))
    with pytest.raises(ValueError, match="more than once"):
        varlen.sum(x, (2, -1))
    with pytest.raises(ValueError, match="dim: 3 is out of range"):
        varlen.sum(x, 3)
    with pytest.raises(TypeError, match="dim: expected an int or a non-empty tuple"):
        varlen.sum(x, ())
    with pytest.raises(TypeError, match="dim: expected an int"):
        varlen.mean(x, 1.0)
    with pytest.raises(TypeError, match="keepdim: expected a bool"):
        varlen.sum(x, 1, keepdim=1)
    with pytest.raises(TypeError, match="x.values: dtype int64 is not supported"):
        varlen.sum(x.with_values(x.values.long()), 1)
    with pytest.raises(TypeError, match="x: expected a varlen.JaggedTensor"):
        varlen.mean(x.values, 1)


@pytest.mark.gpu_only
def test_gpu_chunked_sum_is_deterministic(device):
    """Sequences in several chunks: the last chunk to finish adds the partials in chunk order, so repeated calls
    give the same bits whichever chunk that is."""
    x = random_jagged([4096, 12000, 70000], (1024,), device=device)
    first = reduce_ops.segment_sum_triton(x.values, x.offsets, x.max_len, False, chunk_rows=512)
    for _ in range(5):
        assert torch.equal(reduce_ops.segment_sum_triton(x.values, x.offsets, x.max_len, False, chunk_rows=512),
                           first)


@pytest.mark.gpu_only
@pytest.mark.parametrize("lengths", [[0, 1, 17, 300, 512], [4096, 12000], [1, 70000]], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_gpu_sizes_split_across_programs(lengths, dtype, device, poison_empty):
    x = random_jagged(lengths, (1024,), dtype=dtype, device=device, requires_grad=True)
    g = torch.randn(len(lengths), 1024, dtype=dtype, device=device)
    out = varlen.mean(x, 1)
    out.backward(g)
    ref, ref_dx = reference(x.values, lengths, "mean", g)
    assert_close(out, ref, dtype)
    assert_close(x.values.grad, ref_dx, dtype)
