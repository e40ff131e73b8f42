"""Jagged <-> padded conversion (varlen.padding): Triton kernels and the PyTorch path."""

import math

import pytest
import torch

import varlen
from conftest import ON_GPU
from utils import ROW_LAYOUTS, checkable_dtypes, random_jagged, random_lengths, strided_rows
from varlen import padding as padded_ops
from varlen.capabilities import JAGGED_KERNELS

LONG = 3000 if ON_GPU else 1000
# The float dtypes the Triton kernels declare (the PyTorch path takes them all); 16-bit on the GPU only.
DTYPES = checkable_dtypes(JAGGED_KERNELS["copy"], half_on_cpu=False)
INNERS = [(), (3,), (2, 5)]
BACKENDS = ["torch", "triton"]


def padded_reference(values, lengths, width, padding_value):
    """Per-sequence loop: sequence b in the first rows of out[b], padding_value after."""
    out = values.new_full((len(lengths), width, *values.shape[1:]), padding_value)
    for b, part in enumerate(values.split(lengths)):
        out[b, :len(part)] = part
    return out


def _lengths():
    return random_lengths(6, 40, include=(0, 1, 17, LONG))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inner", INNERS, ids=str)
def test_to_padded_and_back_match_reference(backend, dtype, inner, device, poison_empty):
    lengths = _lengths()
    x = random_jagged(lengths, inner, dtype=dtype, device=device, requires_grad=True)
    width = x.max_len + 3
    with varlen.use_backend(backend):
        p = x.to_padded(padding_value=-1.5, max_len=width)
        g = torch.randn_like(p)
        p.backward(g)
        p_leaf = p.detach().requires_grad_()
        back = varlen.JaggedTensor.from_padded(p_leaf, lengths)
        gb = torch.randn_like(back.values)
        back.values.backward(gb)
    assert torch.equal(p, padded_reference(x.values.detach(), lengths, width, -1.5))
    # The gradient of to_padded gathers the valid positions; padding positions are dropped.
    assert torch.equal(x.values.grad, torch.cat([g[b, :n] for b, n in enumerate(lengths)]))
    assert torch.equal(back.values, x.values.detach())
    assert torch.equal(back.offsets.cpu(), x.offsets.cpu().to(torch.int64))
    # The gradient of from_padded pads with zeros.
    assert torch.equal(p_leaf.grad, padded_reference(gb, lengths, width, 0.0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_from_padded_with_device_lengths(backend, device, poison_empty):
    lengths = [3, 0, LONG, 1]
    padded = torch.randn(4, LONG + 2, 2, 3, dtype=torch.float64, device=device, requires_grad=True)
    with varlen.use_backend(backend):
        x = varlen.JaggedTensor.from_padded(padded, torch.tensor(lengths, device=device), max_len=LONG)
        g = torch.randn_like(x.values)
        x.values.backward(g)
    assert x.max_len == LONG and x.offsets.tolist() == [0, 3, 3, 3 + LONG, 4 + LONG]
    assert torch.equal(x.values, torch.cat([padded[b, :n] for b, n in enumerate(lengths)]))
    assert torch.equal(padded.grad, padded_reference(g, lengths, LONG + 2, 0.0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_in_padding_does_not_leak(backend, device):
    lengths = [2, 0, 17, 5]
    padded = torch.randn(4, 20, 3, device=device)
    for b, n in enumerate(lengths):
        padded[b, n:] = math.nan
    with varlen.use_backend(backend):
        x = varlen.JaggedTensor.from_padded(padded, lengths)
        again = x.to_padded(padding_value=0.0)
    assert torch.isfinite(x.values).all()
    assert torch.equal(x.values, torch.cat([padded[b, :n] for b, n in enumerate(lengths)]))
    assert torch.equal(again, padded[:, :17].nan_to_num(0.0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs(backend, device):
    """Values with a row stride wider than the row and a transposed padded tensor: strides, no copies."""
    lengths = [4, 0, 9]
    big = torch.full((13, 7), math.nan, device=device)
    big[:, :5] = torch.randn(13, 5, device=device)
    offsets = torch.tensor([0, 4, 4, 13], device=device)
    x = varlen.JaggedTensor(big[:, :5], offsets)
    padded_t = torch.randn(3, 5, 9, device=device).transpose(1, 2)  # (B, width, F) with col stride 9
    with varlen.use_backend(backend):
        p = x.to_padded()
        v = padded_ops.padded_to_jagged(padded_t, offsets, 13, 9)
    assert torch.equal(p, padded_reference(big[:, :5], lengths, 9, 0.0))
    assert torch.equal(v, torch.cat([padded_t[b, :n] for b, n in enumerate(lengths)]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_broadcast_padded_inputs(backend, device):
    """Padded tensors with stride-0 dims, as the gradients of sums over the padded rows arrive: (B, 1, F)
    expanded over the rows, one row expanded over everything, and a batch stride that is no whole number
    of rows."""
    lengths = [4, 0, 9, 2]
    offsets = torch.tensor([0, 4, 4, 13, 15], device=device)
    per_batch = torch.randn(4, 1, 6, device=device).expand(4, 9, 6)
    everywhere = torch.randn(6, device=device).expand(4, 9, 6)
    rows_outer = torch.randn(9, 4, 6, device=device).transpose(0, 1)  # batch stride 6, row stride 24
    for padded in (per_batch, everywhere, rows_outer):
        with varlen.use_backend(backend):
            v = padded_ops.padded_to_jagged(padded, offsets, 15, 9)
        assert torch.equal(v, torch.cat([padded[b, :n] for b, n in enumerate(lengths)]))


@pytest.mark.parametrize("inner", [(2,), (), (3,)], ids=["tiles", "one-column", "flat-3"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.float16], ids=str)
def test_copy_kernels_move_any_dtype_exactly(dtype, inner, device):
    """Both kernels: tiles, and flat runs for rows of an odd number of elements (``padding.FLAT_BLOCK``)."""
    lengths = [3, 0, 5]
    if dtype.is_floating_point:
        parts = [torch.randn(n, *inner).to(dtype) for n in lengths]
    else:
        high = {torch.int64: 2**62, torch.int32: 2**31 - 1, torch.uint8: 256, torch.bool: 2}[dtype]
        parts = [torch.randint(0, high, (n, *inner)).to(dtype) for n in lengths]
    x = varlen.jagged(parts, device=device)
    with varlen.use_backend("triton"):
        p = x.to_padded(padding_value=1)
        back = varlen.JaggedTensor.from_padded(p, lengths)
    assert torch.equal(p, padded_reference(x.values, lengths, 5, 1))
    assert torch.equal(back.values, x.values)


def test_flat_runs_across_blocks_and_cut_at_the_width(device, poison_empty):
    """Rows of 3 elements (flat runs): sequences ending just before, at and past a block of FLAT_BLOCK elements, one
    longer than the padded width (cut there both ways), the padding value after each run; rows of 2 or not one after
    another, and single columns, take the tiles."""
    per_block = padded_ops.FLAT_BLOCK // 3
    lengths = [0, 1, per_block, per_block + 1, 2 * per_block + 5]
    x = random_jagged(lengths, (3,), device=device)
    width = per_block + 3  # shorter than the last sequence
    p = padded_ops._to_padded_triton(x.values, x.offsets, width, 0.5)
    assert torch.equal(p, padded_reference(x.values, lengths, max(lengths), 0.5)[:, :width])
    v = padded_ops._from_padded_triton(p, x.offsets, x.total, x.max_len)
    kept = torch.cat([torch.arange(start, start + min(n, width)) for start, n in
                      zip(torch.tensor([0] + lengths).cumsum(0).tolist(), lengths, strict=False)])
    assert torch.equal(v[kept.to(device)], x.values[kept.to(device)])
    assert padded_ops._flat_rows(3, 3) and padded_ops._flat_rows(5, 5)
    assert not padded_ops._flat_rows(1, 1) and not padded_ops._flat_rows(2, 2)
    assert not padded_ops._flat_rows(3, 5)  # (rows 5 apart: tiles)


@pytest.mark.parametrize("block", [(1, 1), (4, 2), (16, 8)], ids=str)
def test_small_tiles_cover_every_element(block, device, poison_empty):
    """Launchers with forced tiny tiles: many programs, row and column edges inside a tile."""
    lengths = [0, 1, 9, 4]
    x = random_jagged(lengths, (3,), device=device)
    p = padded_ops._to_padded_triton(x.values, x.offsets, 11, 0.25, block_t=block[0], block_f=block[1])
    assert torch.equal(p, padded_reference(x.values, lengths, 11, 0.25))
    v = padded_ops._from_padded_triton(p, x.offsets, x.total, x.max_len, block_t=block[0], block_f=block[1])
    assert torch.equal(v, x.values)


@pytest.mark.parametrize("layout", ROW_LAYOUTS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float64] + ([torch.float32, torch.bfloat16] if ON_GPU else []), ids=str)
def test_rows_not_16_apart(layout, dtype, device, poison_empty):
    """Jagged values and padded tensors whose rows are not 16 elements apart (the kernels load ROW_ALIGN elements at
    once)."""
    lengths = [0, 1, 17, 300, 40]
    offsets = varlen.jagged([torch.zeros(n) for n in lengths], device=device).offsets
    x = strided_rows(sum(lengths), layout, dtype, device)
    p = padded_ops._to_padded_triton(x, offsets, 300, 0.5)
    assert torch.equal(p, padded_reference(x, lengths, 300, 0.5))
    n_cols = layout[0]
    padded = strided_rows(len(lengths) * 300, layout, dtype, device).unflatten(0, (len(lengths), 300))
    assert padded.stride() == (300 * layout[1], layout[1], 1)
    v = padded_ops._from_padded_triton(padded, offsets, sum(lengths), 300)
    assert v.shape == (sum(lengths), n_cols)
    assert torch.equal(v, torch.cat([padded[b, :n] for b, n in enumerate(lengths)]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_float64(backend, device):
    x = random_jagged([2, 0, 1], (), dtype=torch.float64, device=device)
    with varlen.use_backend(backend):
        v = x.values.clone().requires_grad_()
        assert torch.autograd.gradcheck(lambda v: padded_ops.jagged_to_padded(v, x.offsets, 3, 0.5), (v,))
        padded = torch.randn(3, 2, dtype=torch.float64, device=device, requires_grad=True)
        assert torch.autograd.gradcheck(lambda p: padded_ops.padded_to_jagged(p, x.offsets, x.total, 2), (padded,))
        # Each direction's backward is the other direction, so second derivatives exist too.
        assert torch.autograd.gradgradcheck(lambda v: padded_ops.jagged_to_padded(v, x.offsets, 2, 0.0), (v,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_empty_and_batch_one(backend, device):
    empty = varlen.JaggedTensor(torch.zeros(0, 3, device=device), torch.zeros(3, dtype=torch.int32, device=device))
    one = random_jagged([LONG], (3,), device=device)
    with varlen.use_backend(backend):
        assert torch.equal(empty.to_padded(padding_value=2.0), torch.full((2, 0, 3), 2.0, device=device))
        assert torch.equal(empty.to_padded(padding_value=2.0, max_len=2), torch.full((2, 2, 3), 2.0, device=device))
        assert torch.equal(one.to_padded(), one.values[None])
        assert torch.equal(varlen.JaggedTensor.from_padded(one.values[None], [LONG]).values, one.values)


@pytest.mark.gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_large_batch_on_gpu(dtype, device):
    lengths = random_lengths(64, 4096, include=(0, 1, 17, 4096))
    x = random_jagged(lengths, (256,), dtype=dtype, device=device)
    p = x.to_padded(padding_value=math.nan)
    assert torch.equal(p.nan_to_num(0.0), padded_reference(x.values, lengths, x.max_len, 0.0))
    assert torch.equal(varlen.JaggedTensor.from_padded(p, x.lengths, max_len=x.max_len).values, x.values)
