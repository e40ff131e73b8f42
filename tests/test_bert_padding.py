"""``varlen.bert_padding`` against flash-attn 2.x's ``flash_attn.bert_padding``.

Names and signatures are compared with flash-attn's, hard-coded below from its source. Every return is
compared for exact equality with the same quantity built by Python loops and plain torch ops, gradients
with those of plain indexing, and the whole flow ``unpad_input -> flash_attn_varlen_func -> pad_input``
with ``varlen.attention_reference`` on the padded batch in float64.
"""

from __future__ import annotations

import inspect
import itertools
import re

import pytest
import torch

import varlen.bert_padding as module
from utils import assert_close
from varlen.attn.reference import attention_reference
from varlen.bert_padding import (
    IndexFirstAxis,
    IndexFirstAxisResidual,
    IndexPutFirstAxis,
    index_first_axis,
    index_first_axis_residual,
    index_put_first_axis,
    pad_input,
    unpad_input,
    unpad_input_for_concatenated_sequences,
)
from varlen.flash_attn_interface import flash_attn_varlen_func

F64 = torch.float64


# ------------------------------------------------------------------------------------- signatures
class FlashAttn2:
    """The public names of ``flash_attn/bert_padding.py`` in flash-attn 2.7 / 2.8 (read at tag v2.8.3 of
    Dao-AILab/flash-attention; unchanged since v2.7.0, where ``unpad_input`` gained ``unused_mask`` and a
    fifth return, ``seqused``). ``index_first_axis`` etc. are ``Function.apply`` there, so their arguments
    are those of the forwards. Update this, with the version, if flash-attn changes them."""

    class IndexFirstAxis:
        @staticmethod
        def forward(ctx, input, indices): ...

    class IndexPutFirstAxis:
        @staticmethod
        def forward(ctx, values, indices, first_axis_dim): ...

    class IndexFirstAxisResidual:
        @staticmethod
        def forward(ctx, input, indices): ...

    @staticmethod
    def unpad_input(hidden_states, attention_mask, unused_mask=None): ...

    @staticmethod
    def unpad_input_for_concatenated_sequences(hidden_states, attention_mask_in_length): ...

    @staticmethod
    def pad_input(hidden_states, indices, batch, seqlen): ...


APPLIED = {"index_first_axis": "IndexFirstAxis", "index_put_first_axis": "IndexPutFirstAxis",
           "index_first_axis_residual": "IndexFirstAxisResidual"}
FUNCTIONS = ["unpad_input", "unpad_input_for_concatenated_sequences", "pad_input"]


def _params(fn) -> list:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_module_exports_exactly_flash_attns_names():
    public = {n for n, obj in vars(module).items() if not n.startswith("_")
              and getattr(obj, "__module__", None) == module.__name__}
    assert public == set(module.__all__) == {*APPLIED, *APPLIED.values(), *FUNCTIONS}
    for name in APPLIED.values():
        assert issubclass(getattr(module, name), torch.autograd.Function)


@pytest.mark.parametrize("name", FUNCTIONS)
def test_function_signatures_match_flash_attn_2(name):
    assert _params(getattr(module, name)) == _params(getattr(FlashAttn2, name))


@pytest.mark.parametrize("name", APPLIED)
def test_autograd_functions_match_flash_attn_2(name):
    cls = APPLIED[name]
    expected = _params(getattr(FlashAttn2, cls).forward)
    assert _params(getattr(module, cls).forward) == expected
    assert _params(getattr(module, name)) == expected[1:]  # the function is `apply` without ctx


# -------------------------------------------------------------------------------- plain references
def _unpad_by_loops(x: torch.Tensor, mask: torch.Tensor, unused: torch.Tensor | None = None):
    """unpad_input's five returns, built token by token on the CPU."""
    B, S = mask.shape
    mask = mask.cpu() != 0
    either = mask if unused is None else mask | (unused.cpu() != 0)
    taken = [(b, s) for b in range(B) for s in range(S) if either[b, s]]
    rows = torch.stack([x[b, s] for b, s in taken]) if taken else x.new_empty(0, *x.shape[2:])
    lengths = [sum(1 for bb, _ in taken if bb == b) for b in range(B)]
    return (rows, torch.tensor([b * S + s for b, s in taken], dtype=torch.int64),
            torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32), max(lengths, default=0),
            torch.tensor([int(mask[b].sum()) for b in range(B)], dtype=torch.int32))


def _assert_same(got, expected, device):
    """unpad_input-style returns equal, with the same dtypes, on ``device`` (ints on the host)."""
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        if isinstance(e, int):
            assert type(g) is int and g == e
        else:
            assert g.dtype == e.dtype and g.device.type == torch.device(device).type, (g.dtype, g.device)
            assert torch.equal(g.cpu(), e.cpu())


def _mask(kind: str, B: int, S: int, device) -> torch.Tensor:
    """Padding masks: ``right`` (lengths, one of them 0 and one S), ``scattered`` (any pattern, int64),
    ``uint8`` (right padding as 0/1 bytes), ``float`` (scattered as 0.0/1.0, as after ``mask.to(dtype)``: flash-attn
    takes them), ``empty`` (no token at all)."""
    lengths = torch.tensor([S, 0, *torch.randint(1, S, (B - 2,)).tolist()])
    right = torch.arange(S).view(1, -1) < lengths.view(-1, 1)
    scattered = torch.rand(B, S) < 0.6
    masks = {"right": right, "scattered": scattered.to(torch.int64), "uint8": right.to(torch.uint8),
             "float": scattered.to(torch.bfloat16), "empty": torch.zeros(B, S, dtype=torch.bool)}
    return masks[kind].to(device)


# ---------------------------------------------------------------------------------------- unpad_input
@pytest.mark.parametrize("kind", ["right", "scattered", "uint8", "float", "empty"])
@pytest.mark.parametrize("inner", [(3, 4), ()], ids=["heads-dim", "no-inner-dims"])
def test_unpad_input_matches_loops(kind, inner, device):
    x = torch.randn(4, 7, *inner, device=device)
    mask = _mask(kind, 4, 7, device)
    _assert_same(unpad_input(x, mask), _unpad_by_loops(x, mask), device)


@pytest.mark.parametrize("kind", ["right", "scattered"])
def test_unpad_input_with_unused_mask(kind, device):
    """Unused tokens are kept and counted in cu_seqlens and the max, but not in seqused."""
    x = torch.randn(4, 9, 2, 3, device=device)
    mask = _mask(kind, 4, 9, device).bool()
    unused = (torch.rand(4, 9, device=device) < 0.3) & ~mask
    got = unpad_input(x, mask, unused)
    _assert_same(got, _unpad_by_loops(x, mask, unused), device)
    assert torch.equal(got[4].cpu(), mask.sum(-1, dtype=torch.int32).cpu())


def test_concatenated_sequences_docstring_example(device):
    """flash-attn's docstring example: rows holding sequences of lengths (2, 3), (3, 2) and (6,)."""
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [3, 2, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]], device=device)
    x = torch.randn(3, 6, 4, device=device)
    rows, indices, cu, max_len = unpad_input_for_concatenated_sequences(x, lengths)
    expected_indices = [*range(0, 5), *range(6, 11), *range(12, 18)]
    assert indices.dtype == torch.int64 and indices.tolist() == expected_indices
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 5, 8, 10, 16]
    assert type(max_len) is int and max_len == 6
    assert torch.equal(rows, x.flatten(0, 1)[expected_indices])


def test_concatenated_sequences_without_any():
    rows, indices, cu, max_len = unpad_input_for_concatenated_sequences(torch.randn(2, 3, 4),
                                                                        torch.zeros(2, 3, dtype=torch.int64))
    assert rows.shape == (0, 4) and indices.numel() == 0 and cu.tolist() == [0] and max_len == 0


# ---------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("kind", ["right", "scattered", "empty"])
def test_pad_input_inverts_unpad_input(kind, device):
    x = torch.randn(5, 6, 2, 3, device=device)
    mask = _mask(kind, 5, 6, device)
    rows, indices, *_ = unpad_input(x, mask)
    padded = pad_input(rows, indices, 5, 6)
    assert torch.equal(padded, torch.where(mask.bool()[..., None, None], x, 0.0))
    assert torch.equal(unpad_input(padded, mask)[0], rows)


def test_pad_input_takes_int32_indices_and_tensor_sizes(device):
    rows, indices = torch.randn(3, 2, device=device), torch.tensor([5, 0, 2], device=device)
    expected = pad_input(rows, indices, 2, 3)
    assert torch.equal(pad_input(rows, indices.int(), torch.tensor(2), torch.tensor([3])), expected)
    assert torch.equal(expected.flatten(0, 1)[[5, 0, 2]], rows) and expected.flatten(0, 1)[[1, 3, 4]].eq(0).all()


# ------------------------------------------------------------------------------------ gradients
def _grads(outputs, leaves, douts):
    return torch.autograd.grad(sum((o * d).sum() for o, d in zip(outputs, douts, strict=True)), leaves)


def test_index_first_axis_gradient_is_plain_indexings(device):
    """Its backward scatters into zeros; repeated indices add up, as with plain indexing."""
    x = torch.randn(7, 2, 3, dtype=F64, device=device, requires_grad=True)
    indices = torch.tensor([4, 0, 6, 4, 2, 4], device=device)
    out = index_first_axis(x, indices)
    assert torch.equal(out, x[indices])
    dout = torch.randn_like(out)
    (grad,) = _grads([out], [x], [dout])
    (ref,) = _grads([x[indices]], [x], [dout])
    assert_close(grad, ref, name="dinput")
    assert grad[[1, 3, 5]].eq(0).all()


def test_index_put_first_axis_and_pad_input_gradients(device):
    values = torch.randn(4, 3, dtype=F64, device=device, requires_grad=True)
    indices = torch.tensor([5, 1, 0, 3], device=device)
    out = index_put_first_axis(values, indices, 6)
    ref = torch.zeros(6, 3, dtype=F64, device=device).index_put((indices,), values)
    assert torch.equal(out, ref)
    dout = torch.randn_like(out)
    assert torch.equal(_grads([out], [values], [dout])[0], _grads([ref], [values], [dout])[0])
    padded = pad_input(values, indices, 2, 3)
    assert torch.equal(_grads([padded], [values], [dout.view(2, 3, 3)])[0], dout[indices])


def test_index_first_axis_residual_gradient(device):
    x = torch.randn(6, 4, dtype=F64, device=device, requires_grad=True)
    indices = torch.tensor([3, 0, 5], device=device)
    rows, residual = index_first_axis_residual(x, indices)
    assert torch.equal(rows, x[indices]) and torch.equal(residual, x)
    douts = [torch.randn_like(rows), torch.randn_like(residual)]
    (grad,) = _grads([rows, residual], [x], douts)
    (ref,) = _grads([x[indices], x], [x], douts)
    assert_close(grad, ref, name="dinput")


def test_unpad_input_gradient(device):
    x = torch.randn(3, 5, 2, dtype=F64, device=device, requires_grad=True)
    mask = _mask("scattered", 3, 5, device)
    rows = unpad_input(x, mask)[0]
    dout = torch.randn_like(rows)
    (grad,) = _grads([rows], [x], [dout])
    (ref,) = _grads([x[mask.bool()]], [x], [dout])
    assert torch.equal(grad, ref)


def test_gradcheck(device):
    x = torch.randn(5, 3, dtype=F64, device=device, requires_grad=True)
    indices = torch.tensor([4, 1, 2], device=device)
    assert torch.autograd.gradcheck(lambda t: index_first_axis(t, indices), (x,))
    assert torch.autograd.gradcheck(lambda t: pad_input(t, indices, 2, 3), (x[:3].detach().requires_grad_(),))
    assert torch.autograd.gradcheck(lambda t: IndexFirstAxisResidual.apply(t, indices), (x,))


def test_autograd_functions_apply_as_in_flash_attn(device):
    x = torch.randn(4, 3, device=device)
    indices = torch.tensor([2, 0], device=device)
    assert torch.equal(IndexFirstAxis.apply(x, indices), x[indices])
    assert torch.equal(IndexPutFirstAxis.apply(x[:2], indices, 4), index_put_first_axis(x[:2], indices, 4))


# ------------------------------------------------------------------ with flash_attn_varlen_func
FLOW_CASES = [  # (id, B, Sq, Sk, H, Hkv, q mask, k mask (None: q's, self-attention), options)
    ("self-causal-gqa-scattered", 4, 9, 9, 4, 2, "scattered", None, dict(causal=True)),
    ("self-right-padded", 3, 8, 8, 2, 2, "right", None, {}),
    ("cross-softcap-no-keys", 4, 6, 10, 2, 1, "right", "right", dict(softcap=3.0, softmax_scale=0.5)),
]


@pytest.mark.parametrize("case", FLOW_CASES, ids=lambda c: c[0])
def test_unpad_attend_pad_matches_the_reference_on_the_padded_batch(case, device):
    """A padded batch through unpad_input, flash_attn_varlen_func and pad_input is attention over each
    sequence's valid tokens: the reference on the padded batch with the key mask as a bias, at valid
    query positions; zeros (and zero gradients) at the padding."""
    name, B, Sq, Sk, H, Hkv, q_kind, k_kind, options = case
    q = torch.randn(B, Sq, H, 8, dtype=F64, device=device, requires_grad=True)
    k, v = (torch.randn(B, Sk, Hkv, 8, dtype=F64, device=device, requires_grad=True) for _ in range(2))
    q_mask = _mask(q_kind, B, Sq, device).bool()
    k_mask = q_mask if k_kind is None else _mask(k_kind, B, Sk, device).flip(0).bool()  # others' lengths
    q_unpad, q_indices, cu_q, max_q, _ = unpad_input(q, q_mask)
    k_unpad, _, cu_k, max_k, _ = unpad_input(k, k_mask)
    v_unpad, *_ = unpad_input(v, k_mask)
    out_unpad = flash_attn_varlen_func(q_unpad, k_unpad, v_unpad, cu_q, cu_k, max_q, max_k, **options)
    out = pad_input(out_unpad, q_indices, B, Sq)

    ref, _ = attention_reference(q, k, v, causal=options.get("causal", False), scale=options.get("softmax_scale"),
                                 softcap=options.get("softcap", 0.0), bias=k_mask[:, None, None, :])
    ref = torch.where(q_mask[..., None, None], ref, 0.0)
    assert out.shape == (B, Sq, H, 8)
    assert torch.equal(out[~q_mask], torch.zeros_like(out[~q_mask]))
    assert_close(out, ref, name="out")
    dout = torch.randn_like(out)
    grads = _grads([out], [q, k, v], [dout])
    ref_grads = _grads([ref], [q, k, v], [dout])
    for n, g, r, keep in zip("qkv", grads, ref_grads, (q_mask, k_mask, k_mask), strict=True):
        assert_close(g, r, name=f"d{n}", floor=1e-12)
        assert g[~keep].eq(0).all()


# ------------------------------------------------------------------------------------------ errors
def _x(*shape):
    return torch.randn(shape)


MASK = torch.ones(2, 3, dtype=torch.bool)
IDX = torch.tensor([0, 2])
ERRORS = [  # (id, call, exception, message)
    ("hidden_states dims", lambda: unpad_input(_x(6), MASK), ValueError,
     "hidden_states: expected at least 2 dims (batch, seqlen, ...), got shape (6,)"),
    ("mask shape", lambda: unpad_input(_x(2, 3, 4), MASK[:, :2]), ValueError,
     "attention_mask: expected shape (batch, seqlen) = (2, 3) to match hidden_states, got (2, 2)"),
    ("mask dtype", lambda: unpad_input(_x(2, 3, 4), MASK.to(torch.complex64)), TypeError,
     "attention_mask: dtype complex64 is not supported; allowed: bool, uint8, int8, int16, int32, int64, float16, "
     "bfloat16, float32, float64"),
    ("mask device", lambda: unpad_input(_x(2, 3, 4), MASK.to("meta")), ValueError,
     "attention_mask: on device meta, but hidden_states is on cpu"),
    ("unused_mask shape", lambda: unpad_input(_x(2, 3, 4), MASK, MASK[0]), ValueError,
     "unused_mask: expected shape (batch, seqlen) = (2, 3) to match hidden_states, got (3,)"),
    ("mask not a tensor", lambda: unpad_input(_x(2, 3, 4), [[1, 1, 0]]), TypeError,
     "attention_mask: expected a torch.Tensor, got list"),
    ("indices dtype", lambda: index_first_axis(_x(4, 2), IDX.float()), TypeError,
     "indices: dtype float32 is not supported; allowed: int32, int64"),
    ("indices dims", lambda: index_first_axis(_x(4, 2), IDX[None]), ValueError,
     "indices: expected 1 dim (n,), got shape (1, 2)"),
    ("indices device", lambda: index_first_axis(_x(4, 2), IDX.to("meta")), ValueError,
     "indices: on device meta, but input is on cpu"),
    ("index past the rows", lambda: index_first_axis(_x(4, 2), torch.tensor([1, 4, 0])), ValueError,
     "indices: [4] lie outside [0, 4)"),
    ("negative index", lambda: index_first_axis_residual(_x(4, 2), torch.tensor([-1, 0])), ValueError,
     "indices: [-1] lie outside [0, 4)"),
    ("index past the batch", lambda: pad_input(_x(2, 2), torch.tensor([0, 6]), 2, 3), ValueError,
     "indices: [6] lie outside [0, 6)"),
    ("repeated index", lambda: pad_input(_x(3, 2), torch.tensor([3, 1, 3]), 2, 3), ValueError,
     "indices: repeat a row ([3]); the rows they scatter to must be distinct"),
    ("input 0-dim", lambda: index_first_axis(torch.tensor(1.0), IDX), ValueError,
     "input: expected at least 1 dim (rows, ...), got shape ()"),
    ("one index per row", lambda: pad_input(_x(3, 2), IDX, 2, 3), ValueError,
     "indices: 2 indices for the 3 rows of values; there must be one index per row"),
    ("batch negative", lambda: pad_input(_x(2, 2), IDX, -1, 3), ValueError, "batch: got -1; must be >= 0"),
    ("seqlen float", lambda: pad_input(_x(2, 2), IDX, 2, 3.0), TypeError, "seqlen: expected an int, got float 3.0"),
    ("seqlen float tensor", lambda: pad_input(_x(2, 2), IDX, 2, torch.tensor(3.0)), TypeError,
     "seqlen: expected an int, got Tensor"),
    ("concatenated bool", lambda: unpad_input_for_concatenated_sequences(_x(2, 3, 4), MASK), TypeError,
     "attention_mask_in_length: dtype bool is not supported; allowed: uint8, int8, int16, int32, int64"),
    ("concatenated negative", lambda: unpad_input_for_concatenated_sequences(_x(1, 3, 4), torch.tensor([[2, -1, 0]])),
     ValueError, "attention_mask_in_length: has negative entries"),
    ("concatenated too long", lambda: unpad_input_for_concatenated_sequences(_x(2, 3, 4),
                                                                              torch.tensor([[1, 0, 0], [2, 2, 0]])),
     ValueError, "attention_mask_in_length: row 1 sums to 4, more than its 3 positions"),
]


def test_pad_input_takes_distinct_indices_in_any_order():
    """Distinct indices that don't increase (unpad_input's do) scatter each row to its place; repeats raise (above)."""
    x = torch.arange(6.0).view(3, 2)
    out = pad_input(x, torch.tensor([4, 0, 2]), 2, 3)
    want = torch.zeros(2, 3, 2)
    want.view(6, 2)[torch.tensor([4, 0, 2])] = x
    assert torch.equal(out, want)


@pytest.mark.parametrize("call,exc,message", [pytest.param(*e[1:], id=e[0]) for e in ERRORS])
def test_invalid_inputs(call, exc, message):
    with pytest.raises(exc, match=re.escape(message)):
        call()
