"""varlen.select along the batch, ragged (Triton gather/scatter, PyTorch path) and inner dims."""

import importlib
import math

import pytest
import torch

import varlen
from conftest import ON_GPU
from utils import checkable_dtypes, random_jagged, random_lengths
from varlen.capabilities import JAGGED_KERNELS

select_ops = importlib.import_module("varlen.ops.select")  # the module, not varlen.ops.select the function

LONG = 5000 if ON_GPU else 1000
# The float dtypes the Triton kernels declare (the PyTorch path takes them all); 16-bit on the GPU only.
DTYPES = checkable_dtypes(JAGGED_KERNELS["copy"], half_on_cpu=False)
INNERS = [(), (3,), (2, 5)]
BACKENDS = ["torch", "triton"]


def reference(values, lengths, index, fill):
    """Per-sequence loop: position ``index`` of each sequence, ``fill`` where it has none."""
    rows = [part[index] if -len(part) <= index < len(part) else torch.full(values.shape[1:], fill,
                                                                           dtype=values.dtype)
            for part in values.detach().cpu().split(lengths)]
    return torch.stack(rows)


def scatter_reference(grad, lengths, index):
    parts = []
    for b, n in enumerate(lengths):
        part = grad.new_zeros((n, *grad.shape[1:]))
        if -n <= index < n:
            part[index] = grad[b]
        parts.append(part)
    return torch.cat(parts)


@pytest.mark.parametrize("index", [0, 16, -1, -17])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inner", INNERS, ids=str)
def test_ragged_select_with_fill_matches_reference(index, backend, dtype, inner, device, poison_empty):
    lengths = random_lengths(7, 40, include=(0, 1, 17, LONG))
    x = random_jagged(lengths, inner, dtype=dtype, device=device, requires_grad=True)
    g = torch.randn(len(lengths), *inner, dtype=dtype, device=device)
    with varlen.use_backend(backend):
        out = varlen.select(x, 1, index, fill_value=math.nan)
        out.backward(g)
    ref = reference(x.values, lengths, index, math.nan)
    assert out.shape == (len(lengths), *inner) and out.dtype == dtype
    assert torch.equal(out.cpu().nan_to_num(7.0), ref.nan_to_num(7.0))
    assert torch.isnan(out[0]).all()  # lengths[0] == 0: no position at all
    # Missing positions get no gradient (the NaN fill must not leak into it either).
    assert torch.equal(x.values.grad.cpu(), scatter_reference(g.cpu(), lengths, index))


@pytest.mark.parametrize("index", [0, 2, -1, -3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_select_validated(index, backend, device):
    lengths = [3, 5, 17, 4]
    x = random_jagged(lengths, (2,), device=device, requires_grad=True)
    with varlen.use_backend(backend):
        out = varlen.select(x, 1, index)
        out.sum().backward()
    assert torch.equal(out.cpu(), reference(x.values, lengths, index, 0.0))
    assert torch.equal(x.values.grad.cpu(), scatter_reference(torch.ones(4, 2), lengths, index))


def test_validation_uses_cached_host_offsets_or_one_copy(device):
    lengths = [3, 1, 4]
    x = random_jagged(lengths, (), device=device)
    with pytest.raises(ValueError, match=r"index: 1 is out of range for sequence 1 of length 1 .*fill_value"):
        varlen.select(x, 1, 1)
    with pytest.raises(ValueError, match=r"index: -2 is out of range for sequence 1 of length 1"):
        varlen.select(x, 1, -2)
    # Built without host offsets (on a GPU; the CPU always has them): the check copies them once and caches
    # them on x.
    bare = varlen.JaggedTensor(x.values, x.offsets, x.max_len, validate=False)
    assert (bare._host_offsets is None) == (device.type != "cpu")
    with pytest.raises(ValueError, match="index: 3 is out of range for sequence 0 of length 3"):
        varlen.select(bare, 1, 3)
    assert bare._host_offsets is not None
    # With fill_value there is no check and no host copy.
    bare = varlen.JaggedTensor(x.values, x.offsets, x.max_len, validate=False)
    out = varlen.select(bare, 1, 3, fill_value=-1.0)
    assert (bare._host_offsets is None) == (device.type != "cpu")
    assert out.tolist() == [-1.0, -1.0, x.values[7].item()]


@pytest.mark.parametrize("block", [(1, 1), (2, 4)], ids=str)
def test_small_tiles(block, device, poison_empty):
    lengths = [0, 1, 17, 4, 2]
    x = random_jagged(lengths, (5,), dtype=torch.float64, device=device)
    tiles = dict(block_b=block[0], block_f=block[1])
    out = select_ops.gather_triton(x.values, x.offsets, -2, 0.5, **tiles)
    assert torch.equal(out.cpu(), reference(x.values, lengths, -2, 0.5))
    g = torch.randn(5, 5, dtype=torch.float64, device=device)
    assert torch.equal(select_ops.scatter_triton(g, x.offsets, x.total, -2, **tiles).cpu(),
                       scatter_reference(g.cpu(), lengths, -2))


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_non_float_dtypes(dtype, backend, device):
    lengths = [2, 0, 3]
    parts = [torch.randint(0, 2**62 if dtype == torch.int64 else 2, (n, 2)).to(dtype) for n in lengths]
    x = varlen.jagged(parts, device=device)
    with varlen.use_backend(backend):
        out = varlen.select(x, 1, -1, fill_value=1)
    assert torch.equal(out.cpu(), reference(x.values, lengths, -1, 1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_values(backend, device):
    lengths = [5, 0, 12]
    big = torch.full((17, 9), math.nan, device=device)
    big[:, :4] = torch.randn(17, 4, device=device)
    x = varlen.JaggedTensor(big[:, :4], torch.tensor([0, 5, 5, 17], device=device))
    with varlen.use_backend(backend):
        out = varlen.select(x, 1, 4, fill_value=0.0)
    assert torch.equal(out.cpu(), reference(big[:, :4], lengths, 4, 0.0))


def test_batch_dim_returns_a_view_of_one_sequence(device):
    lengths = [3, 0, 4]
    x = random_jagged(lengths, (2,), device=device, requires_grad=True)
    seq = varlen.select(x, 0, -1)
    assert seq.shape == (4, 2) and seq.data_ptr() == x.values[3].data_ptr()
    assert varlen.select(x, 0, 1).shape == (0, 2)
    seq.sum().backward()
    assert x.values.grad[3:].eq(1).all() and x.values.grad[:3].eq(0).all()


def test_inner_dim(device):
    x = random_jagged([3, 0, 4], (2, 5), device=device)
    y = varlen.select(x, 3, -2)
    assert isinstance(y, varlen.JaggedTensor) and y.offsets is x.offsets
    assert torch.equal(y.values, x.values[:, :, -2])
    assert torch.equal(varlen.select(x, -2, 1).values, x.values[:, 1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_and_gradgradcheck_float64(backend, device):
    x = random_jagged([3, 0, 1, 2], (), dtype=torch.float64, device=device)

    def f(values):
        return varlen.select(x.with_values(values), 1, -2, fill_value=0.0)

    with varlen.use_backend(backend):
        v = x.values.clone().requires_grad_()
        assert torch.autograd.gradcheck(f, (v,))
        assert torch.autograd.gradgradcheck(f, (v,))


def test_bad_inputs(device):
    x = random_jagged([3, 2], (4,), device=device)
    with pytest.raises(ValueError, match=r"index: 2 is out of range for the batch dim of size 2"):
        varlen.select(x, 0, 2)
    with pytest.raises(ValueError, match=r"index: 4 is out of range for dim 2 of size 4"):
        varlen.select(x, 2, 4)
    with pytest.raises(ValueError, match=r"index: 2 is out of range for sequence 1 of length 2"):
        varlen.select(x, 1, 2)
    with pytest.raises(ValueError, match="dim: 3 is out of range"):
        varlen.select(x, 3, 0)
    with pytest.raises(ValueError, match="fill_value: only applies to dim=1"):
        varlen.select(x, 0, 0, fill_value=0.0)
    with pytest.raises(TypeError, match="fill_value: expected a real number or None"):
        varlen.select(x, 1, 0, fill_value="nan")
    with pytest.raises(TypeError, match="index: expected an int"):
        varlen.select(x, 1, 0.0)
    with pytest.raises(TypeError, match="x: expected a varlen.JaggedTensor"):
        varlen.select(x.values, 1, 0)


@pytest.mark.gpu_only
def test_large_batch_on_gpu(device, poison_empty):
    lengths = random_lengths(3000, 500, include=(0, 1, 17, 4096))
    x = random_jagged(lengths, (256,), dtype=torch.bfloat16, device=device, requires_grad=True)
    out = varlen.select(x, 1, -3, fill_value=0.0)
    out.backward(torch.ones_like(out))
    assert torch.equal(out.cpu(), reference(x.values, lengths, -3, 0.0))
    assert torch.equal(x.values.grad.cpu(), scatter_reference(torch.ones(3000, 256, dtype=torch.bfloat16),
                                                              lengths, -3))
