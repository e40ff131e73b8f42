"""The argument checks every public function shares (varlen._checks): numpy's integers taken as ints, as torch takes
them; bools strictly Python's, with errors that name numpy's bool as such."""

import re

import numpy as np
import pytest
import torch

import varlen
from utils import random_jagged
from varlen import _checks
from varlen.distributed import make_plan


@pytest.mark.parametrize("value", [3, np.int64(3), np.int32(3), np.uint8(3)], ids=repr)
def test_check_int_takes_integral_numbers_as_python_ints(value):
    got = _checks.check_int("n", value, minimum=0)
    assert got == 3 and type(got) is int


# (numpy's bool is numpy.bool in numpy 2, numpy.bool_ before)
@pytest.mark.parametrize("value, kind", [(True, "bool"), (np.True_, r"numpy\.bool_?"), (3.0, "float"),
                                         (np.float32(3), r"numpy\.float32"), ("3", "str"),
                                         (torch.tensor(3), r"torch\.Tensor")], ids=repr)
def test_check_int_refuses_what_is_not_an_integer(value, kind):
    with pytest.raises(TypeError, match=f"^n: expected an int, got {kind} {re.escape(repr(value))}$"):
        _checks.check_int("n", value)
    with pytest.raises(ValueError, match=r"^n: got -1; must be >= 0$"):
        _checks.check_int("n", np.int64(-1), minimum=0)


def test_check_bool_names_numpy_bools():
    assert _checks.check_bool("flag", False) is False
    assert _checks.check_bool("flag", None, allow_none=True) is None
    with pytest.raises(TypeError, match=rf"^flag: expected a bool, got numpy\.bool_? {re.escape(repr(np.True_))}$"):
        _checks.check_bool("flag", np.True_)
    with pytest.raises(TypeError, match=r"^flag: expected a bool or None, got int 1$"):
        _checks.check_bool("flag", 1, allow_none=True)


def test_other_checks_name_qualified_types():
    with pytest.raises(TypeError, match=r"^x: expected a torch.Tensor, got numpy\.ndarray$"):
        _checks.check_tensor("x", np.zeros(3))
    with pytest.raises(TypeError, match=r"^s: expected a real number, got str '1'$"):
        _checks.check_real("s", "1")
    with pytest.raises(TypeError, match=r"^g: expected a torch.Generator or None, got numpy\.random\..*Generator$"):
        _checks.check_generator("g", np.random.default_rng(0))


def test_public_functions_take_numpy_ints():
    """Each integer argument given as a numpy int gives what the Python int gives (and is stored as a Python int)."""
    x = random_jagged([3, 0, 5], (2, 4))
    assert type(varlen.JaggedTensor(x.values, x.offsets, np.int64(5)).max_len) is int
    padded = x.to_padded()
    assert type(varlen.JaggedTensor.from_padded(padded, [3, 0, 5], max_len=np.int64(5)).max_len) is int
    assert torch.equal(x.to_padded(max_len=np.int64(6)), x.to_padded(max_len=6))
    assert torch.equal(varlen.sum(x, dim=np.int64(1)), varlen.sum(x, dim=1))
    assert torch.equal(varlen.sum(x, dim=(1, np.int32(3))), varlen.sum(x, dim=(1, 3)))
    assert torch.equal(varlen.select(x, 1, np.int64(-1), fill_value=0.0), varlen.select(x, 1, -1, fill_value=0.0))
    assert torch.equal(varlen.layer_norm(x, np.int64(4)).values, varlen.layer_norm(x, 4).values)
    assert torch.equal(varlen.layer_norm(x, (2, np.int64(4))).values, varlen.layer_norm(x, (2, 4)).values)
    logits, targets = torch.randn(6, 5), torch.tensor([0, 1, 2, 3, 4, 1])
    assert torch.equal(varlen.cross_entropy(logits, targets, ignore_index=np.int64(1)),
                       varlen.cross_entropy(logits, targets, ignore_index=1))
    q = random_jagged([3, 0, 5], (2, 8))
    for options in (dict(window=(np.int64(1), None)), dict(causal=True, prefix_len=np.int64(2)),
                    dict(query_offset=np.int64(1))):
        plain = {k: (tuple(None if s is None else int(s) for s in v) if isinstance(v, tuple) else
                     int(v) if isinstance(v, np.integer) else v) for k, v in options.items()}
        assert torch.equal(varlen.attention(q, q, q, **options).values, varlen.attention(q, q, q, **plain).values)
        assert torch.equal(varlen.attention_reference(q, q, q, **options)[0].values,
                           varlen.attention_reference(q, q, q, **plain)[0].values)
    mask = varlen.dropout_keep_mask(np.int64(2), 1, 3, 3, 0.5, seed=np.uint64(7), offset=np.int64(0))
    assert torch.equal(mask, varlen.dropout_keep_mask(2, 1, 3, 3, 0.5, seed=7, offset=0))
    layer = varlen.nn.TransformerEncoderLayer(np.int64(16), np.int64(2), np.int64(32), window=(np.int64(3), None))
    assert (type(layer.self_attn.embed_dim), type(layer.self_attn.num_heads)) == (int, int)
    # (stored as Python's ints: a compiled forward turns numpy's into tensors)
    assert layer.self_attn.window == (3, None) and type(layer.self_attn.window[0]) is int
    assert len(varlen.nn.TransformerEncoder(layer, np.int64(2)).layers) == 2
    assert make_plan([np.int64(5), 3], np.int64(2)) == make_plan([5, 3], 2)


@pytest.mark.parametrize("call, name", [
    (lambda q: varlen.attention(q, q, q, causal=np.True_), "causal"),
    (lambda q: varlen.attention(q, q, q, return_lse=np.False_), "return_lse"),
    (lambda q: varlen.sum(q, 1, keepdim=np.True_), "keepdim"),
    (lambda q: varlen.JaggedTensor(q.values, q.offsets, validate=np.True_), "validate"),
    (lambda q: varlen.nn.MultiheadAttention(16, 2, causal=np.True_), "causal"),
    (lambda q: varlen.set_checks(np.True_), "enabled"),
], ids=["attention", "return_lse", "sum", "JaggedTensor", "MultiheadAttention", "set_checks"])
def test_numpy_bools_are_refused_by_name(call, name):
    q = random_jagged([3, 5], (2, 8))
    with pytest.raises(TypeError, match=f"^{name}: expected a bool, got numpy.bool"):
        call(q)
