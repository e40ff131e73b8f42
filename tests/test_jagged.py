"""The JaggedTensor class (varlen.jagged): construction, validation, conversions, shape helpers."""

import pytest
import torch

import varlen
from utils import random_jagged
from varlen.jagged import as_jagged, check_same_offsets
from varlen.offsets import segment_ids

BACKENDS = ["torch", "triton"]


def test_from_list_shapes_and_host_offsets(device):
    parts = [torch.randn(n, 2, 3) for n in (3, 0, 5, 1)]
    x = varlen.jagged(parts, device=device)
    assert x.batch_size == 4 and x.max_len == 5 and x.total == 9
    assert x.shape == (4, None, 2, 3) and x.dim() == x.ndim == 4 and x.inner_shape == (2, 3)
    assert x.offsets.dtype == torch.int32 and x.offsets.device == x.values.device
    assert x.values.device.type == device.type
    assert x.offsets.tolist() == [0, 3, 3, 8, 9] and x.lengths.tolist() == [3, 0, 5, 1]
    assert x._host_offsets.tolist() == [0, 3, 3, 8, 9]  # no device-to-host copy needed later
    assert torch.equal(x.values.cpu(), torch.cat(parts))
    assert varlen.jagged(parts, offsets_dtype=torch.int64).offsets.dtype == torch.int64
    assert varlen.jagged(parts, dtype=torch.float64).dtype == torch.float64
    assert "batch_size=4" in repr(x)


def test_unbind_and_segment_ids(device):
    parts = [torch.randn(n, 2) for n in (2, 0, 3)]
    x = varlen.jagged(parts, device=device)
    seqs = x.unbind()
    assert len(seqs) == 3 and all(torch.equal(s.cpu(), p) for s, p in zip(seqs, parts, strict=True))
    assert seqs[2].data_ptr() == x.values[2].data_ptr()  # views, no copies
    assert x.segment_ids().tolist() == [0, 0, 2, 2, 2]
    assert segment_ids(x.offsets, x.total).tolist() == [0, 0, 2, 2, 2]


def test_constructor_computes_and_checks_max_len(device):
    values = torch.randn(6, 2, device=device)
    offsets = torch.tensor([0, 2, 2, 6], device=device)
    assert varlen.JaggedTensor(values, offsets).max_len == 4
    assert varlen.JaggedTensor(values, offsets, 4).max_len == 4
    with pytest.raises(ValueError, match="max_len: got 3, but sequence 2 has length 4"):
        varlen.JaggedTensor(values, offsets, 3)
    trusted = varlen.JaggedTensor(values, offsets, 4, validate=False)
    # On a GPU nothing was copied to the host; on the CPU the offsets are always checked (no sync to save).
    assert (trusted._host_offsets is None) == (device.type != "cpu")
    assert varlen.JaggedTensor(values, offsets, 9).max_len == 9  # an upper bound is legal


@pytest.mark.parametrize(("offsets", "match"), [
    ([1, 2, 6], "must start at 0, got offsets\\[0\\] = 1"),
    ([0, 4, 2, 6], "must not decrease, got offsets\\[1\\] = 4 > offsets\\[2\\] = 2"),
    ([0, 2, 5], "must end at values.shape\\[0\\] = 6, got offsets\\[-1\\] = 5"),
    ([0], "expected shape \\(B \\+ 1,\\) with B >= 1"),
], ids=["start", "decreasing", "end", "no-sequence"])
def test_offsets_validation(offsets, match, device):
    with pytest.raises(ValueError, match=match):
        varlen.JaggedTensor(torch.zeros(6, device=device), torch.tensor(offsets, device=device))


def test_other_validation_errors(device):
    values = torch.zeros(6, device=device)
    with pytest.raises(TypeError, match="offsets: dtype float32 is not supported"):
        varlen.JaggedTensor(values, torch.tensor([0.0, 6.0], device=device))
    with pytest.raises(ValueError, match="offsets: on device meta"):
        varlen.JaggedTensor(values, torch.tensor([0, 6], device="meta"))
    with pytest.raises(ValueError, match="values: expected at least 1 dim"):
        varlen.JaggedTensor(torch.tensor(1.0, device=device), torch.tensor([0, 1], device=device))
    with pytest.raises(TypeError, match="values: expected a torch.Tensor"):
        varlen.JaggedTensor([1.0], torch.tensor([0, 1], device=device))
    with pytest.raises(TypeError, match="max_len: expected an int"):
        varlen.JaggedTensor(values, torch.tensor([0, 6], device=device), 6.0)
    with pytest.raises(TypeError, match="padding_value: expected a real number, got complex 1j"):
        varlen.JaggedTensor(values, torch.tensor([0, 6], device=device)).to_padded(1j)
    with pytest.raises(TypeError, match="padding_value: expected a real number, got NoneType None"):
        varlen.JaggedTensor(values, torch.tensor([0, 6], device=device)).to_padded(None)
    with pytest.raises(TypeError, match="validate: expected a bool, got NoneType None"):
        varlen.JaggedTensor(values, torch.tensor([0, 6], device=device), validate=None)
    x = varlen.JaggedTensor(values, torch.tensor([0, 2, 6], device=device))
    with pytest.raises(TypeError, match="values: expected a torch.Tensor, got list"):
        x.with_values([1.0] * 6)
    with pytest.raises(ValueError, match="values: expected at least 1 dim"):
        x.with_values(torch.tensor(1.0, device=device))
    with pytest.raises(ValueError, match="values: on device meta, but the offsets are on"):
        x.with_values(torch.zeros(6, device="meta"))
    # 2**31 rows without the memory: a zero-stride expanded view.
    huge = torch.zeros(1, device=device).expand(2**31)
    with pytest.raises(ValueError, match="int32 can't index values with 2147483648 rows"):
        varlen.JaggedTensor(huge, torch.tensor([0, 5], dtype=torch.int32, device=device), 5, validate=False)


def test_meta_tensors_take_shapes_only():
    """Meta values and offsets hold no data: nothing is read (it raised torch's NotImplementedError), and max_len,
    which can't be found from them, must be given."""
    x = varlen.JaggedTensor(torch.empty(6, 3, device="meta"), torch.empty(3, dtype=torch.int64, device="meta"), 4)
    assert x.max_len == 4 and x.values.device.type == "meta"
    with pytest.raises(ValueError, match="max_len: required for meta tensors"):
        varlen.JaggedTensor(torch.empty(6, 3, device="meta"), torch.empty(3, dtype=torch.int64, device="meta"))


def test_jagged_list_errors():
    with pytest.raises(TypeError, match="non-empty list of tensors"):
        varlen.jagged([])
    with pytest.raises(TypeError, match="non-empty list of tensors"):
        varlen.jagged(torch.zeros(3, 2))
    with pytest.raises(ValueError, match="tensors\\[1\\]: inner shape \\(3,\\) differs"):
        varlen.jagged([torch.zeros(2, 2), torch.zeros(2, 3)])
    with pytest.raises(ValueError, match="tensors\\[1\\]: expected shape \\(L, \\*inner\\)"):
        varlen.jagged([torch.zeros(2), torch.tensor(1.0)])
    with pytest.raises(ValueError, match="tensors\\[1\\]: dtype/device"):
        varlen.jagged([torch.zeros(2), torch.zeros(2, dtype=torch.float64)])
    with pytest.raises(TypeError, match="offsets_dtype: expected one of torch.int32, torch.int64, got torch.float32"):
        varlen.jagged([torch.zeros(2)], offsets_dtype=torch.float32)
    with pytest.raises(TypeError, match="offsets_dtype: expected one of torch.int32, torch.int64, got None"):
        varlen.jagged([torch.zeros(2)], offsets_dtype=None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_round_trip_and_gradients_both_ways(backend, device):
    lengths = [3, 0, 17, 1]
    x = random_jagged(lengths, (2,), dtype=torch.float64, device=device, requires_grad=True)
    with varlen.use_backend(backend):
        padded = x.to_padded(padding_value=-9.0)
        assert padded.shape == (4, 17, 2)
        assert (padded[1] == -9).all() and (padded[0, 3:] == -9).all()
        back = varlen.JaggedTensor.from_padded(padded, lengths)
        assert torch.equal(back.values, x.values) and back.max_len == 17
        assert back._host_offsets.tolist() == [0, 3, 3, 20, 21]
        small = random_jagged([2, 0, 1], (), dtype=torch.float64, device=device, requires_grad=True)
        assert torch.autograd.gradcheck(lambda v: small.with_values(v).to_padded(2.0, max_len=3), (small.values,))
        p = torch.randn(3, 3, dtype=torch.float64, device=device, requires_grad=True)
        assert torch.autograd.gradcheck(lambda q: varlen.JaggedTensor.from_padded(q, [2, 0, 1]).values, (p,))


def test_from_padded_length_forms_and_errors(device):
    padded = torch.randn(3, 4, device=device)
    as_tensor = varlen.JaggedTensor.from_padded(padded, torch.tensor([1, 4, 0], device=device))
    trusted = varlen.JaggedTensor.from_padded(padded, torch.tensor([1, 4, 0], device=device), max_len=4)
    assert as_tensor.offsets.tolist() == trusted.offsets.tolist() == [0, 1, 5, 5]
    assert (trusted._host_offsets is None) == (device.type != "cpu") and trusted.max_len == 4
    with pytest.raises(ValueError, match="lengths\\[1\\] = 5 is outside \\[0, 4\\]"):
        varlen.JaggedTensor.from_padded(padded, [1, 5, 0])
    with pytest.raises(ValueError, match="lengths\\[0\\] = -1 is outside"):
        varlen.JaggedTensor.from_padded(padded, [-1, 1, 0])
    with pytest.raises(ValueError, match="expected 3 lengths"):
        varlen.JaggedTensor.from_padded(padded, [1, 1])
    for lengths in (None, 3, "123"):
        with pytest.raises(TypeError, match="lengths: expected a list of ints or an integer tensor of shape \\(3,\\)"):
            varlen.JaggedTensor.from_padded(padded, lengths)
    with pytest.raises(ValueError, match="lengths: expected shape \\(3,\\)"):
        varlen.JaggedTensor.from_padded(padded, torch.tensor([1, 1], device=device))
    with pytest.raises(TypeError, match="lengths: dtype float32 is not supported"):
        varlen.JaggedTensor.from_padded(padded, torch.tensor([1.0, 1.0, 1.0], device=device))
    with pytest.raises(ValueError, match="padded: expected \\(B, max_len, \\*inner\\)"):
        varlen.JaggedTensor.from_padded(padded[0], [1])
    with pytest.raises(ValueError, match="max_len: 5 exceeds padded.shape\\[1\\] = 4"):
        varlen.JaggedTensor.from_padded(padded, torch.tensor([1, 1, 1], device=device), max_len=5)
    with pytest.raises(ValueError, match="max_len: got 2; must be >= 4"):
        varlen.jagged([torch.zeros(4)], device=device).to_padded(max_len=2)


def test_from_padded_empty_batch_is_a_clear_error(device):
    with pytest.raises(ValueError, match="padded"):
        varlen.JaggedTensor.from_padded(torch.zeros(0, 3, device=device), [])


def test_from_padded_rejects_float_lengths(device):
    with pytest.raises(TypeError, match="lengths"):
        varlen.JaggedTensor.from_padded(torch.zeros(2, 3, device=device), [1.7, 2])


def test_non_contiguous_offsets(device):
    every_other = torch.tensor([0, 99, 2, 99, 5], device=device)[::2]
    x = varlen.JaggedTensor(torch.arange(5.0, device=device), every_other)
    with varlen.use_backend("triton"):
        padded = x.to_padded()
    assert padded.tolist() == [[0.0, 1.0, 0.0], [2.0, 3.0, 4.0]]


def test_nested_round_trip_is_zero_copy(device):
    x = random_jagged([2, 0, 3], (4,), device=device)
    nt = x.to_nested()
    assert nt.is_nested and nt.values().data_ptr() == x.values.data_ptr()
    back = varlen.JaggedTensor.from_nested(nt)
    assert back.values.data_ptr() == x.values.data_ptr() and back.max_len == 3
    assert back.offsets.tolist() == [0, 2, 2, 5]
    # Without a cached max_seqlen, from_nested validates and computes it.
    bare = torch.nested.nested_tensor_from_jagged(x.values, x.offsets.long())
    assert varlen.JaggedTensor.from_nested(bare).max_len == 3
    assert as_jagged(nt, "x").values.data_ptr() == x.values.data_ptr() and as_jagged(x, "x") is x
    with pytest.raises(TypeError, match="nt: expected a torch.nested tensor"):
        varlen.JaggedTensor.from_nested(x.values)
    with pytest.raises(TypeError, match="y: expected a varlen.JaggedTensor"):
        as_jagged(x.values, "y")


def test_to_moves_offsets_with_values_and_keeps_them_for_dtype(device):
    x = random_jagged([2, 3], (2,), device=device)
    doubled = x.to(torch.float64)
    assert doubled.dtype == torch.float64 and doubled.offsets is x.offsets and doubled.max_len == 3
    meta = x.to("meta")
    assert meta.values.device.type == meta.offsets.device.type == "meta"
    assert meta._host_offsets is x._host_offsets
    assert x.cpu().device.type == "cpu"


def test_grad_detach_with_values(device):
    x = random_jagged([2, 1], (), device=device, requires_grad=True)
    assert x.requires_grad and x.grad is None
    (x.values * 2).sum().backward()
    assert isinstance(x.grad, varlen.JaggedTensor) and torch.equal(x.grad.values, torch.full((3,), 2.0, device=device))
    assert not x.detach().requires_grad and x.detach().offsets is x.offsets
    with pytest.raises(ValueError, match="values: expected 3 rows"):
        x.with_values(torch.zeros(4, device=device))


def test_batch_one_and_all_empty(device):
    one = varlen.jagged([torch.randn(7, 2)], device=device)
    assert one.batch_size == 1 and one.max_len == 7 and torch.equal(one.to_padded()[0], one.values)
    empty = varlen.JaggedTensor(torch.zeros(0, 2, device=device), torch.zeros(3, dtype=torch.int64, device=device))
    assert empty.max_len == 0 and empty.lengths.tolist() == [0, 0] and empty.to_padded().shape == (2, 0, 2)
    assert empty.unbind()[1].shape == (0, 2)


def test_check_same_offsets(device):
    a = random_jagged([2, 3], (), device=device)
    check_same_offsets("a", a, "b", a.with_values(a.values * 2))
    check_same_offsets("a", a, "b", random_jagged([2, 3], (), device=device))
    with pytest.raises(ValueError, match="a: lengths differ from b's"):
        check_same_offsets("a", a, "b", random_jagged([3, 2], (), device=device))
    with pytest.raises(ValueError, match="a: batch size 2 differs from b's 3"):
        check_same_offsets("a", a, "b", random_jagged([2, 3, 0], (), device=device))
