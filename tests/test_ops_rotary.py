"""varlen.rotary against a per-sequence float64 reference (each pair of features as a complex number)."""

import math
import re

import pytest
import torch

import varlen
from conftest import DEVICE, ON_GPU
from utils import assert_close, check_jagged_op, random_jagged, rotary_reference
from varlen.ops.rotary import rotate_with_tables

LENGTHS = {"mixed": [0, 1, 17, 1000 if ON_GPU else 60, 4], "batch1": [1]}
DTYPES = [torch.float32, torch.float64] + ([torch.float16, torch.bfloat16] if ON_GPU else [])
INNER = [(8,), (2, 40), (3, 80), (1, 96)]
BACKENDS = ["torch", "triton"]


def reference(x: varlen.JaggedTensor, base: float) -> torch.Tensor:
    return torch.cat([rotary_reference(part, base) for part in x.unbind()])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inner", INNER, ids=str)
@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_forward_backward(dtype, lengths, inner, backend):
    x = random_jagged(LENGTHS[lengths], inner, dtype=dtype, requires_grad=True)
    out = varlen.rotary(x, 500.0, backend=backend)
    x64 = x.with_values(x.values.detach().double().requires_grad_(True))
    # (Below float64 the angles are float32, as transformers' Llama computes them.)
    check_jagged_op(x, out, torch.randn_like(out.values), reference(x64, 500.0), dtype, {"x": (x.values, x64.values)})


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_and_gradgradcheck(backend):
    x = random_jagged([2, 0, 3], (2, 6), dtype=torch.float64)
    values = x.values.detach().clone().requires_grad_(True)

    def turn(v):
        return varlen.rotary(x.with_values(v), 10000.0, backend=backend).values
    assert torch.autograd.gradcheck(turn, (values,))
    assert torch.autograd.gradgradcheck(turn, (values,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_any_gradient_layout_and_no_rows(backend):
    # .sum()'s gradient is expanded (every stride 0); a transposed one has a last-dim stride other than 1.
    x = random_jagged([3, 0, 4], (2, 8), dtype=torch.float64, requires_grad=True)
    x64 = x.with_values(x.values.detach().clone().requires_grad_(True))
    varlen.rotary(x, backend=backend).values.sum().backward()
    reference(x64, 10000.0).sum().backward()
    assert_close(x.values.grad, x64.values.grad)
    x.values.grad = None
    g = torch.randn(7, 8, 2, dtype=torch.float64, device=DEVICE).transpose(1, 2)
    varlen.rotary(x, backend=backend).values.backward(g)
    assert_close(x.values.grad, torch.autograd.grad(reference(x64, 10000.0), x64.values, g)[0])
    empty = varlen.JaggedTensor(torch.randn(0, 2, 8, device=DEVICE), torch.zeros(3, dtype=torch.int32, device=DEVICE),
                                0)
    assert varlen.rotary(empty, backend=backend).values.shape == (0, 2, 8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_heads_as_views_of_a_projection(backend):
    # q and k as the nn modules make them: views of one (N, 3 * H * D) projection, rows 3 * H * D apart.
    x = random_jagged([5, 0, 9], (3 * 2 * 8,))
    q = x.with_values(x.values[:, 16:32].unflatten(-1, (2, 8)))
    assert not q.values.is_contiguous()
    got = varlen.rotary(q, backend=backend).values
    assert torch.equal(got, varlen.rotary(q.with_values(q.values.contiguous()), backend=backend).values)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotation_from_tables(dtype):
    """The kernel behind transformers' apply_rotary_pos_emb (varlen.integrations.transformers_kernels): cosines and
    sines from tables as transformers builds them (both halves equal, in x's dtype), against the float64 reference;
    its gradient turns back; any gradient layout; no rows."""
    rows, base = 23, 500.0
    x = torch.randn(rows, 3, 40, dtype=dtype, device=DEVICE, requires_grad=True)
    positions = torch.arange(rows, device=DEVICE)
    inv_freq = 1.0 / base ** (torch.arange(0, 40, 2, device=DEVICE, dtype=torch.float64) / 40)
    angles = positions[:, None].double() * inv_freq[None, :]
    tables = [f(torch.cat([angles, angles], -1)).to(dtype) for f in (torch.cos, torch.sin)]
    out = rotate_with_tables(x, *tables)
    dy = torch.randn_like(out).transpose(0, 1).contiguous().transpose(0, 1)  # a gradient with other strides
    out.backward(dy)
    x64 = x.detach().double().requires_grad_(True)
    ref = rotary_reference(x64, base)
    ref.backward(dy.double())
    assert out.dtype == dtype and out.is_contiguous()
    assert_close(out, ref, dtype, name="out")
    assert_close(x.grad, x64.grad, dtype, name="dx")
    assert rotate_with_tables(x[:0], *(t[:0] for t in tables)).shape == (0, 3, 40)


@pytest.mark.parametrize("wider", ["cos", "sin"])
def test_rotation_from_tables_of_other_row_strides(wider):
    """Tables whose rows are apart by different strides (one a view of a wider tensor, its other columns NaN): each
    is read with its own stride (both were once read with the cosines' stride)."""
    rows = 37
    x = torch.randn(rows, 2, 40, device=DEVICE)
    angles = torch.randn(rows, 20, device=DEVICE)
    tables = {"cos": torch.cat([angles, angles], -1).cos(), "sin": torch.cat([angles, angles], -1).sin()}
    expected = rotate_with_tables(x, tables["cos"], tables["sin"])
    big = torch.full((rows, 72), math.nan, device=DEVICE)
    big[:, 8:48] = tables[wider]
    tables[wider] = big[:, 8:48]
    assert torch.equal(rotate_with_tables(x, tables["cos"], tables["sin"]), expected)


@pytest.mark.parametrize("backend", BACKENDS)
def test_heads_not_16_apart(backend):
    """Heads of 16 features 20 apart (the kernels load ROW_ALIGN elements at once: 4 here, 8 for the pairs alone),
    by positions and by tables: the same as contiguous heads."""
    x = torch.randn(37, 3, 20, device=DEVICE)[..., 2:18]
    lengths = [0, 17, 20]
    jagged = varlen.JaggedTensor(x, torch.tensor([0, 0, 17, 37], device=DEVICE), 20)
    got = varlen.rotary(jagged, backend=backend).values
    assert torch.equal(got, varlen.rotary(jagged.with_values(x.contiguous()), backend=backend).values)
    assert_close(got, torch.cat([rotary_reference(part.double(), 10000.0) for part in x.split(lengths)]))
    angles = torch.randn(37, 8, device=DEVICE)
    tables = [f(torch.cat([angles, angles], -1)) for f in (torch.cos, torch.sin)]
    assert torch.equal(rotate_with_tables(x, *tables), rotate_with_tables(x.contiguous(), *tables))


def test_rotation_from_tables_bad_input():
    x, table = torch.randn(4, 2, 6, device=DEVICE), torch.randn(4, 6, device=DEVICE)
    with pytest.raises(ValueError, match=re.escape("x: rotary embeddings turn pairs of the last dim, which must be "
                                                   "even; got shape (4, 2, 5)")):
        rotate_with_tables(x[..., :5], table, table)
    with pytest.raises(ValueError, match=re.escape("cos: expected a table of shape (4, >= 3) for x of shape (4, 2, 6); "
                                                   "got (2, 6)")):
        rotate_with_tables(x, table[:2], table)
    with pytest.raises(ValueError, match=re.escape("sin: expected a table of shape (4, >= 3)")):
        rotate_with_tables(x, table, table[:, :2])
    with pytest.raises(ValueError, match="sin: expected x's dtype and device"):
        rotate_with_tables(x, table, table.double())


def test_rotation_from_tables_gradgradcheck():
    x = torch.randn(5, 2, 6, dtype=torch.float64, device=DEVICE, requires_grad=True)
    cos, sin = torch.rand(2, 5, 6, dtype=torch.float64, device=DEVICE)
    assert torch.autograd.gradcheck(lambda v: rotate_with_tables(v, cos, sin), (x,))
    assert torch.autograd.gradgradcheck(lambda v: rotate_with_tables(v, cos, sin), (x,))


def test_positions_restart_at_each_sequence_and_norms_stay():
    x = random_jagged([5, 3], (2, 8))
    out = varlen.rotary(x)
    first = torch.tensor([0, 5], device=DEVICE)
    assert torch.equal(out.values[first], x.values[first])  # position 0: no turn
    assert_close(out.values.norm(dim=-1), x.values.norm(dim=-1))
    # A relative property: q_m . k_n depends on m - n only.
    q = varlen.rotary(varlen.jagged([torch.ones(6, 8)], device=DEVICE)).values
    assert math.isclose(float(q[1] @ q[3]), float(q[2] @ q[4]), rel_tol=1e-5)


def test_nested_input():
    x = random_jagged([3, 0, 5], (2, 8))
    assert torch.equal(varlen.rotary(x.to_nested()).values, varlen.rotary(x).values)


BAD = [
    pytest.param(lambda: varlen.rotary(random_jagged([2, 3], (2, 8)).values), TypeError,
                 "x: expected a varlen.JaggedTensor", id="plain-x"),
    pytest.param(lambda: varlen.rotary(random_jagged([2, 3], (2, 7))), ValueError,
                 "x: rotary embeddings turn pairs of the last dim, which must be even; got inner shape (2, 7)",
                 id="odd-dim"),
    pytest.param(lambda: varlen.rotary(random_jagged([2, 3], ())), ValueError, "got inner shape ()", id="no-inner"),
    pytest.param(lambda: varlen.rotary(random_jagged([2, 3], (8,)), 0.0), ValueError,
                 "base: expected a real number > 0", id="base-zero"),
    pytest.param(lambda: varlen.rotary(random_jagged([2, 3], (8,)), "1e4"), TypeError, "base: expected a real",
                 id="base-type"),
    pytest.param(lambda: varlen.rotary(random_jagged([2, 3], (8,)).to(torch.int64)), TypeError,
                 "x.values: dtype int64", id="int-dtype"),
]


@pytest.mark.parametrize("call, error, message", BAD)
def test_bad_input(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()


@pytest.mark.parametrize("offsets, width", [
    ([0, 3, 3, 10, 11], 7),  # an empty sequence; the longest length
    ([0, 3, 3, 10, 11], 4),  # a width below the longest length: positions clamped to width - 1
    ([2, 5, 9], 6),  # rows before the first offset (position clamped at 0)
    ([0, 4, 100], 100),  # an end past the rows
    ([0, 6, 2, 9, 11], 11),  # decreasing offsets (untrusted metadata): the same sequence ids as searchsorted's
    ([0], 1),  # no sequence
], ids=["empty", "clamped", "before-first", "end-past-rows", "decreasing", "no-sequence"])
def test_kernel_positions_from_offsets_match_row_positions(offsets, width):
    """The Triton kernel finds each row's position from the offsets itself; it turns every row as the positions
    ``offsets.row_positions`` computes (the PyTorch path's) would, bit for bit, whatever the offsets say."""
    from varlen.offsets import row_positions
    from varlen.ops.rotary import rotary_triton

    x = torch.randn(11, 2, 8, device=DEVICE)
    inv_freq = torch.tensor([1.0, 0.3, 0.1, 0.01], device=DEVICE)
    offsets = torch.tensor(offsets, dtype=torch.int32, device=DEVICE)
    positions = row_positions(offsets, 11, width)[1]
    assert torch.equal(rotary_triton(x, offsets, inv_freq, 1, width), rotary_triton(x, positions, inv_freq, 1))


def test_kernel_positions_many_sequences():
    """A binary search over 1000 sequences (ten steps), empty ones included, against the positions' tensor."""
    from varlen.offsets import row_positions
    from varlen.ops.rotary import rotary_triton

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(0, 5, (1000,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(DEVICE)
    total, width = int(offsets[-1]), int(lengths.max())
    x = torch.randn(total, 1, 4, device=DEVICE)
    inv_freq = torch.tensor([1.0, 0.1], device=DEVICE)
    positions = row_positions(offsets, total, width)[1]
    assert torch.equal(rotary_triton(x, offsets, inv_freq, -1, width), rotary_triton(x, positions, inv_freq, -1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_op_width_and_strided_offsets(backend):
    """The custom op called directly: a negative width is refused (the backends would read it differently), and
    offsets given as a strided view turn the rows as their contiguous copy does."""
    x = torch.randn(11, 2, 8, device=DEVICE)
    inv_freq = torch.tensor([1.0, 0.3, 0.1, 0.01], device=DEVICE)
    spaced = torch.tensor([0, 99, 3, 99, 10, 99, 11], dtype=torch.int32, device=DEVICE)[::2]
    with pytest.raises(ValueError, match="width: expected 0 .* got -1"):
        torch.ops.varlen.rotary(x, spaced.contiguous(), inv_freq, 1, backend, -1)
    assert torch.equal(torch.ops.varlen.rotary(x, spaced, inv_freq, 1, backend, 7),
                       torch.ops.varlen.rotary(x, spaced.contiguous(), inv_freq, 1, backend, 7))
