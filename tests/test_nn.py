"""varlen.nn modules against torch.nn's on padded batches with key padding masks (copied weights)."""

from itertools import pairwise

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import varlen
from conftest import DEVICE
from utils import REL_TOL, assert_close, random_jagged, rotary_reference
from varlen.nn import MultiheadAttention, TransformerEncoder, TransformerEncoderLayer

E, H = 16, 4
LENGTHS = [3, 1, 17, 6]  # batch of 4 with lengths 1 and 17; length 0 has its own test
DTYPES = [torch.float64, torch.float32]


def _padding_mask(x: varlen.JaggedTensor) -> torch.Tensor:
    """torch's key_padding_mask: True at padding."""
    return torch.arange(x.max_len, device=x.device)[None, :] >= x.lengths[:, None]


def _valid(padded: torch.Tensor, like: varlen.JaggedTensor) -> torch.Tensor:
    """The rows of a padded output at real positions, as jagged values."""
    return varlen.JaggedTensor.from_padded(padded, like.lengths.cpu()).values


def _tol(dtype):
    # Outputs and gradients go through several layers of float32 (tf32 matmuls on the GPU).
    return REL_TOL[dtype] * (1 if dtype == torch.float64 else 10)


def _grads(loss, tensors):
    return torch.autograd.grad(loss, tensors)


# ----------------------------------------------------------------------------- MultiheadAttention
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_mha_matches_torch_self_attention(dtype, causal, bias):
    common = dict(batch_first=True, device=DEVICE, dtype=dtype)  # (torch's arguments, taken as they are)
    ours = MultiheadAttention(E, H, 0.0, bias, causal=causal, **common)  # (dropout and bias in torch's places)
    theirs = torch.nn.MultiheadAttention(E, H, 0.0, bias, **common)
    theirs.load_state_dict(ours.state_dict())
    x = random_jagged(LENGTHS, (E,), dtype=dtype, requires_grad=True)
    padded = x.to_padded()
    mask = None
    if causal:
        mask = torch.ones(x.max_len, x.max_len, dtype=torch.bool, device=DEVICE).triu(1)
    ref, _ = theirs(padded, padded, padded, key_padding_mask=_padding_mask(x), attn_mask=mask, need_weights=False)
    out = ours(x)
    assert isinstance(out, varlen.JaggedTensor) and out.offsets is x.offsets
    ref = _valid(ref, x)
    assert_close(out.values, ref, tol=_tol(dtype))

    g = torch.randn_like(ref)
    params = [ours.in_proj_weight, ours.out_proj.weight] + ([ours.in_proj_bias] if bias else [])
    their_params = [theirs.in_proj_weight, theirs.out_proj.weight] + ([theirs.in_proj_bias] if bias else [])
    got = _grads((out.values * g).sum(), [x.values, *params])
    want = _grads((ref * g).sum(), [x.values, *their_params])
    for name, a, b in zip(["x", "in_proj_weight", "out_proj.weight", "in_proj_bias"], got, want, strict=False):
        assert_close(a, b, tol=_tol(dtype), name=name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mha_cross_attention_matches_torch(dtype):
    ours = MultiheadAttention(E, H, device=DEVICE, dtype=dtype)
    theirs = torch.nn.MultiheadAttention(E, H, batch_first=True, device=DEVICE, dtype=dtype)
    theirs.load_state_dict(ours.state_dict())
    q = random_jagged(LENGTHS, (E,), dtype=dtype)
    k = random_jagged([5, 2, 1, 9], (E,), dtype=dtype)
    v = k.with_values(torch.randn_like(k.values))
    ref, _ = theirs(q.to_padded(), k.to_padded(), v.to_padded(), key_padding_mask=_padding_mask(k),
                    need_weights=False)
    assert_close(ours(q, k, v).values, _valid(ref, q), tol=_tol(dtype))
    # value=None means value = key: one fused k/v projection.
    ref_kk, _ = theirs(q.to_padded(), k.to_padded(), k.to_padded(), key_padding_mask=_padding_mask(k),
                       need_weights=False)
    assert_close(ours(q, k).values, _valid(ref_kk, q), tol=_tol(dtype))


def test_mha_grouped_query_heads_match_repeated_kv_heads():
    """GQA: 2 kv heads for 4 query heads equals MHA whose k/v projections repeat each kv head twice."""
    dtype, kv_heads, dh = torch.float64, 2, E // H
    ours = MultiheadAttention(E, H, num_kv_heads=kv_heads, device=DEVICE, dtype=dtype)
    assert ours.in_proj_weight.shape == (E + 2 * kv_heads * dh, E)
    theirs = torch.nn.MultiheadAttention(E, H, batch_first=True, device=DEVICE, dtype=dtype)

    def repeat(rows):  # (kv_heads * dh, ...) -> (H * dh, ...): query head h reads kv head h // group
        return rows.unflatten(0, (kv_heads, dh)).repeat_interleave(H // kv_heads, 0).flatten(0, 1)

    with torch.no_grad():
        w, b = ours.in_proj_weight, ours.in_proj_bias
        k_rows, v_rows = slice(E, E + kv_heads * dh), slice(E + kv_heads * dh, None)
        theirs.in_proj_weight.copy_(torch.cat([w[:E], repeat(w[k_rows]), repeat(w[v_rows])]))
        theirs.in_proj_bias.copy_(torch.cat([b[:E], repeat(b[k_rows]), repeat(b[v_rows])]))
        theirs.out_proj.load_state_dict(ours.out_proj.state_dict())
    x = random_jagged(LENGTHS, (E,), dtype=dtype)
    padded = x.to_padded()
    ref, _ = theirs(padded, padded, padded, key_padding_mask=_padding_mask(x), need_weights=False)
    assert_close(ours(x).values, _valid(ref, x))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mha_dense_input_and_bias_as_padding_mask(dtype):
    """Dense (B, S, E) input; a bool attn_bias (B, 1, 1, S) plays torch's key_padding_mask."""
    ours = MultiheadAttention(E, H, device=DEVICE, dtype=dtype)
    theirs = torch.nn.MultiheadAttention(E, H, batch_first=True, device=DEVICE, dtype=dtype)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(3, 7, E, dtype=dtype, device=DEVICE)
    pad = torch.zeros(3, 7, dtype=torch.bool, device=DEVICE)
    pad[1, 4:] = True
    ref, _ = theirs(x, x, x, key_padding_mask=pad, need_weights=False)
    out = ours(x, attn_bias=~pad[:, None, None, :])
    assert isinstance(out, torch.Tensor) and out.shape == x.shape
    assert_close(out, ref, tol=_tol(dtype))


def test_mha_empty_sequence_gives_no_rows_and_finite_gradients():
    ours = MultiheadAttention(E, H, device=DEVICE, dtype=torch.float64)
    x = random_jagged([0, 4, 0, 2], (E,), dtype=torch.float64, requires_grad=True)
    out = ours(x)
    assert out.values.shape == (6, E) and torch.isfinite(out.values).all()
    out.values.sum().backward()
    assert torch.isfinite(x.values.grad).all() and torch.isfinite(ours.in_proj_weight.grad).all()


def test_mha_dropout_only_in_training():
    ours = MultiheadAttention(E, H, dropout=0.5, device=DEVICE, dtype=torch.float64)
    plain = MultiheadAttention(E, H, device=DEVICE, dtype=torch.float64)
    plain.load_state_dict(ours.state_dict())
    x = random_jagged(LENGTHS, (E,), dtype=torch.float64)
    ours.eval()
    evaluated = ours(x).values
    assert torch.equal(evaluated, ours(x).values)
    assert_close(evaluated, plain(x).values)
    ours.train()
    first, second = ours(x).values, ours(x).values
    assert not torch.allclose(first, evaluated) and not torch.allclose(first, second)
    plain.train()  # dropout 0: training changes nothing
    assert_close(plain(x).values, evaluated)


# ------------------------------------------------------------------------- TransformerEncoderLayer
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_norm", "pre_norm"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_matches_torch(dtype, norm_first, activation):
    # (torch's arguments, batch_first=True included, taken as they are)
    kwargs = dict(dim_feedforward=24, dropout=0.1, activation=activation, norm_first=norm_first, batch_first=True,
                  device=DEVICE, dtype=dtype)
    ours = TransformerEncoderLayer(E, H, **kwargs)
    theirs = torch.nn.TransformerEncoderLayer(E, H, **kwargs)
    theirs.load_state_dict(ours.state_dict())
    ours.eval()
    theirs.eval()
    x = random_jagged(LENGTHS, (E,), dtype=dtype, requires_grad=True)
    ref = _valid(theirs(x.to_padded(), src_key_padding_mask=_padding_mask(x)), x)
    out = ours(x)
    assert isinstance(out, varlen.JaggedTensor) and out.offsets is x.offsets
    assert_close(out.values, ref, tol=_tol(dtype))

    g = torch.randn_like(ref)
    names = [n for n, _ in ours.named_parameters()]
    assert names == [n for n, _ in theirs.named_parameters()]
    got = _grads((out.values * g).sum(), [x.values, *ours.parameters()])
    want = _grads((ref * g).sum(), [x.values, *theirs.parameters()])
    for name, a, b in zip(["x", *names], got, want, strict=True):
        assert_close(a, b, tol=_tol(dtype), name=name)


def test_encoder_layer_causal_matches_torch_with_causal_mask():
    dtype = torch.float64
    ours = TransformerEncoderLayer(E, H, 24, dropout=0.0, causal=True, device=DEVICE, dtype=dtype)
    theirs = torch.nn.TransformerEncoderLayer(E, H, 24, dropout=0.0, batch_first=True, device=DEVICE, dtype=dtype)
    theirs.load_state_dict(ours.state_dict())
    x = random_jagged(LENGTHS, (E,), dtype=dtype)
    causal = torch.ones(x.max_len, x.max_len, dtype=torch.bool, device=DEVICE).triu(1)
    ref = theirs(x.to_padded(), src_mask=causal, src_key_padding_mask=_padding_mask(x), is_causal=True)
    assert_close(ours(x).values, _valid(ref, x))


def test_encoder_layer_dense_input_matches_torch():
    dtype = torch.float64
    ours = TransformerEncoderLayer(E, H, 24, dropout=0.0, device=DEVICE, dtype=dtype)
    theirs = torch.nn.TransformerEncoderLayer(E, H, 24, dropout=0.0, batch_first=True, device=DEVICE, dtype=dtype)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(2, 5, E, dtype=dtype, device=DEVICE)
    assert_close(ours(x), theirs(x))


@pytest.mark.parametrize("final_norm", [False, True], ids=["no_norm", "norm"])
def test_encoder_stack_matches_torch(final_norm):
    # varlen.nn.TransformerEncoder: torch's stack (its parameter names, deep copies of the layer, the final norm) on
    # jagged batches; its state dict loads into torch's and the outputs and gradients agree.
    dtype = torch.float64
    norm = torch.nn.LayerNorm(E, device=DEVICE, dtype=dtype) if final_norm else None
    ours = TransformerEncoder(TransformerEncoderLayer(E, H, 24, dropout=0.0, device=DEVICE, dtype=dtype), 3,
                              norm=norm)
    theirs = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(E, H, 24, dropout=0.0, batch_first=True, device=DEVICE, dtype=dtype), 3,
        norm=None if norm is None else torch.nn.LayerNorm(E, device=DEVICE, dtype=dtype), enable_nested_tensor=False)
    for layer in ours.layers:  # (different weights per layer: the copies are independent)
        layer.linear1.reset_parameters()
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    theirs.load_state_dict(ours.state_dict())
    x = random_jagged(LENGTHS, (E,), dtype=dtype, requires_grad=True)
    out = ours(x)
    ref = _valid(theirs(x.to_padded(), src_key_padding_mask=_padding_mask(x)), x)
    assert_close(out.values, ref)
    g = torch.randn_like(ref)
    got = _grads((out.values * g).sum(), [x.values, *ours.parameters()])
    want = _grads((ref * g).sum(), [x.values, *theirs.parameters()])
    for a, b in zip(got, want, strict=True):
        assert_close(a, b)
    dense = torch.randn(2, 5, E, dtype=dtype, device=DEVICE)
    assert_close(ours(dense), theirs(dense))


def test_torch_encoder_stacks_varlen_layers_on_dense_inputs():
    # torch.nn.TransformerEncoder reads self_attn.batch_first and calls each layer with src_mask, is_causal and
    # src_key_padding_mask: varlen's layers take them (None, None, False or their own causal).
    dtype = torch.float64
    for causal in (False, True):
        layer = TransformerEncoderLayer(E, H, 24, dropout=0.0, causal=causal, device=DEVICE, dtype=dtype)
        stack = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        x = torch.randn(2, 5, E, dtype=dtype, device=DEVICE)
        assert_close(stack(x, is_causal=causal), stack.layers[1](stack.layers[0](x)))


def test_modules_take_dropout_as_any_real_number():
    # (numpy's floats, as torch.nn's modules take them; the probability check is varlen's one, _checks')
    assert MultiheadAttention(E, H, dropout=np.float32(0.25)).dropout == 0.25
    layer = TransformerEncoderLayer(E, H, 24, dropout=np.float64(0.25))
    assert layer.dropout.p == layer.self_attn.dropout == 0.25


def test_encoder_stack_bad_arguments():
    layer = TransformerEncoderLayer(E, H, 24, device=DEVICE)
    with pytest.raises(TypeError, match="encoder_layer: expected a varlen.nn.TransformerEncoderLayer, got "
                                        "TransformerEncoderLayer"):
        TransformerEncoder(torch.nn.TransformerEncoderLayer(E, H, 24, batch_first=True), 2)
    with pytest.raises(ValueError, match="num_layers: got 0; must be >= 1"):
        TransformerEncoder(layer, 0)
    with pytest.raises(TypeError, match="norm: expected a torch.nn.LayerNorm, a torch.nn.RMSNorm or None, got Linear"):
        TransformerEncoder(layer, 2, norm=torch.nn.Linear(E, E))
    with pytest.raises(TypeError, match="mask_check: expected a bool, got str"):
        TransformerEncoder(layer, 2, mask_check="yes")
    stack = TransformerEncoder(layer, 2)
    x = random_jagged(LENGTHS, (E,))
    causal_mask = torch.ones(5, 5, dtype=torch.bool, device=DEVICE).triu(1)
    with pytest.raises(ValueError, match="mask: not taken by varlen.nn layers; build the layer with causal=True"):
        stack(x, mask=causal_mask)
    with pytest.raises(ValueError, match="src_key_padding_mask: not taken by varlen.nn layers; pass the batch as a "
                                         "JaggedTensor"):
        stack(x, src_key_padding_mask=torch.zeros(len(LENGTHS), x.max_len, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="is_causal: True, but the layer was built with causal=False"):
        stack(x, is_causal=True)
    with pytest.raises(TypeError, match="is_causal: expected a bool or None, got str"):
        layer(x, is_causal="yes")
    with pytest.raises(ValueError, match="src_mask: not taken by varlen.nn layers"):
        layer(x, src_mask=causal_mask)


def test_encoder_layer_dropout_only_in_training():
    layer = TransformerEncoderLayer(E, H, 24, dropout=0.3, device=DEVICE, dtype=torch.float64)
    x = random_jagged(LENGTHS, (E,), dtype=torch.float64)
    layer.eval()
    evaluated = layer(x).values
    assert torch.equal(evaluated, layer(x).values)
    layer.train()
    first, second = layer(x).values, layer(x).values
    assert not torch.allclose(first, evaluated) and not torch.allclose(first, second)
    for module in (layer.self_attn, layer.dropout, layer.dropout1, layer.dropout2):
        assert getattr(module, "p", getattr(module, "dropout", None)) == 0.3


# ---------------------------------------------------------------- Llama pieces: RMSNorm, SwiGLU, rotary
def _attention_reference(q, k, v, causal):
    """One sequence in float64: q (Sq, H, D), k and v (Sk, Hkv, D) -> (Sq, H * D)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    if causal:
        scores = scores.masked_fill(torch.ones_like(scores[0], dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).flatten(1)


def _llama_block_reference(layer: TransformerEncoderLayer, x: torch.Tensor, base: float) -> torch.Tensor:
    """One sequence (S, E) through a pre-norm Llama block, written out: RMSNorm, q/k/v, rotary on q and k,
    causal attention, output projection, RMSNorm, SwiGLU."""
    attn, E = layer.self_attn, layer.self_attn.embed_dim
    kv, D = attn.kv_dim, attn.head_dim

    def rms(t, norm):
        return t / (t.square().mean(-1, keepdim=True) + norm.eps).sqrt() * norm.weight

    h = rms(x, layer.norm1)
    q, k, v = (h @ attn.in_proj_weight[lo:hi].T for lo, hi in ((0, E), (E, E + kv), (E + kv, E + 2 * kv)))
    q, k, v = (t.unflatten(-1, (-1, D)) for t in (q, k, v))
    q, k = rotary_reference(q, base), rotary_reference(k, base)
    x = x + _attention_reference(q, k, v, causal=True) @ attn.out_proj.weight.T
    gate, up = (rms(x, layer.norm2) @ layer.linear1.weight.T).chunk(2, -1)
    return x + (F.silu(gate) * up) @ layer.linear2.weight.T


def _llama_layer(dtype):
    layer = TransformerEncoderLayer(E, H, 12, dropout=0.0, activation="swiglu", layer_norm_eps=1e-6, norm_first=True,
                                    bias=False, causal=True, num_kv_heads=2, norm="rms", rotary_base=500.0,
                                    device=DEVICE, dtype=dtype)
    with torch.no_grad():  # away from 1, so that a missing norm weight shows
        for norm in (layer.norm1, layer.norm2):
            norm.weight.uniform_(0.5, 1.5)
    return layer


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_llama_block_matches_reference(dtype):
    layer = _llama_layer(dtype)
    assert isinstance(layer.norm1, torch.nn.RMSNorm) and layer.linear1.out_features == 24
    x = random_jagged([3, 0, 1, 17, 6], (E,), dtype=dtype, requires_grad=True)
    out = layer(x)
    params = list(layer.parameters())
    x64 = x.values.detach().double().requires_grad_(True)
    layer64 = _llama_layer(torch.float64)
    layer64.load_state_dict(layer.state_dict())
    host = x.host_offsets().tolist()
    ref = torch.cat([_llama_block_reference(layer64, x64[s:e], 500.0) for s, e in pairwise(host)])
    assert_close(out.values, ref, tol=_tol(dtype))
    g = torch.randn_like(ref)
    got = _grads((out.values * g.to(dtype)).sum(), [x.values, *params])
    want = _grads((ref * g).sum(), [x64, *layer64.parameters()])
    for name, a, b in zip(["x", *(n for n, _ in layer.named_parameters())], got, want, strict=True):
        assert_close(a, b, tol=_tol(dtype), name=name)


def test_mha_rotary_cross_attention_matches_reference():
    dtype = torch.float64
    mha = MultiheadAttention(E, H, num_kv_heads=2, bias=False, rotary_base=10000.0, device=DEVICE, dtype=dtype)
    q_in, kv_in = random_jagged([4, 1, 9], (E,), dtype=dtype), random_jagged([7, 3, 2], (E,), dtype=dtype)
    out = mha(q_in, kv_in)
    kv = mha.kv_dim
    for a, b, o in zip(q_in.unbind(), kv_in.unbind(), out.unbind(), strict=True):
        q = (a @ mha.in_proj_weight[:E].T).unflatten(-1, (H, -1))
        k = (b @ mha.in_proj_weight[E:E + kv].T).unflatten(-1, (2, -1))
        v = (b @ mha.in_proj_weight[E + kv:].T).unflatten(-1, (2, -1))
        ref = _attention_reference(rotary_reference(q, 1e4), rotary_reference(k, 1e4), v, causal=False)
        assert_close(o, ref @ mha.out_proj.weight.T)


def test_mha_rotary_on_a_batch_of_empty_sequences():
    mha = MultiheadAttention(E, H, rotary_base=1e4, device=DEVICE)
    out = mha(random_jagged([0, 0], (E,)))
    assert out.values.shape == (0, E)


def test_llama_block_dense_input_matches_jagged():
    layer = _llama_layer(torch.float64)
    x = torch.randn(2, 5, E, dtype=torch.float64, device=DEVICE)
    jagged = layer(varlen.jagged(list(x.unbind()), device=DEVICE))
    assert_close(layer(x).flatten(0, 1), jagged.values)
    assert "norm='rms'" in repr(layer) and "rotary_base=500.0" in repr(layer)


# ------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(embed_dim=10, num_heads=4), ValueError, "embed_dim: 10 is not a multiple of num_heads"),
    (dict(embed_dim=16, num_heads=0), ValueError, "num_heads: got 0"),
    (dict(embed_dim=16.0, num_heads=4), TypeError, "embed_dim: expected an int"),
    (dict(embed_dim=16, num_heads=4, num_kv_heads=3), ValueError, "num_kv_heads: 3 does not divide"),
    (dict(embed_dim=16, num_heads=4, dropout=1.0), ValueError, r"dropout: expected a float in \[0, 1\), got 1.0"),
    (dict(embed_dim=16, num_heads=4, causal=1), TypeError, "causal: expected a bool"),
    (dict(embed_dim=16, num_heads=4, window=(2,)), ValueError, "window: expected None or"),
    (dict(embed_dim=16, num_heads=4, rotary_base=0.0), ValueError, "rotary_base: expected a real number > 0"),
    (dict(embed_dim=6, num_heads=2, rotary_base=1e4), ValueError, "rotary_base: rotary embeddings need an even"),
    (dict(embed_dim=16, num_heads=4, batch_first=False), ValueError, "batch_first: varlen.nn modules take "
                                                                      "batch-first inputs only"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_mha_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        MultiheadAttention(**kwargs)


def test_mha_bad_inputs():
    mha = MultiheadAttention(E, H, device=DEVICE)
    x = random_jagged([2, 3], (E,))
    with pytest.raises(TypeError, match="query: expected a varlen.JaggedTensor"):
        mha([x.values])
    with pytest.raises(ValueError, match=r"query: expected a jagged \(B, j, E\) tensor with E = 16, got shape"):
        mha(random_jagged([2, 3], (8,)))
    with pytest.raises(ValueError, match=r"query: expected a dense \(B, S, E\) tensor with E = 16"):
        mha(torch.randn(3, E, device=DEVICE))
    with pytest.raises(TypeError, match="query: dtype torch.float64 differs from the module's parameters'"):
        mha(random_jagged([2, 3], (E,), dtype=torch.float64))
    with pytest.raises(TypeError, match="key: its layout"):
        mha(x, torch.randn(2, 3, E, device=DEVICE))
    with pytest.raises(ValueError, match="key: is None but value is given"):
        mha(x, None, x)
    with pytest.raises(ValueError, match="key: batch size 3 differs from query.s 2"):
        mha(x, random_jagged([1, 1, 1], (E,)))
    with pytest.raises(ValueError, match="value: batch size 3 differs from key.s 2"):
        mha(x, x, random_jagged([1, 1, 1], (E,)))
    dense = torch.randn(2, 3, E, device=DEVICE)
    with pytest.raises(ValueError, match="key: batch size 1 differs from query.s 2"):
        mha(dense, dense[:1])


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(activation="tanh"), ValueError, "activation: got 'tanh'; allowed: 'relu', 'gelu', 'swiglu'"),
    (dict(activation=torch.relu), TypeError, "activation: expected a name"),
    (dict(dim_feedforward=0), ValueError, "dim_feedforward: got 0"),
    (dict(dropout=-0.1), ValueError, r"dropout: expected a float in \[0, 1\), got -0.1"),
    (dict(layer_norm_eps=-1.0), ValueError, "layer_norm_eps: expected a finite real number >= 0"),
    (dict(norm_first="yes"), TypeError, "norm_first: expected a bool"),
    (dict(norm="batch"), ValueError, "norm: got 'batch'; allowed: 'layer', 'rms'"),
    (dict(rotary_base=-1.0), ValueError, "rotary_base: expected a real number > 0"),
    (dict(nhead=5), ValueError, "d_model: 16 is not a multiple of nhead = 5"),
    (dict(d_model=16.0), TypeError, "d_model: expected an int, got float"),
    (dict(nhead=0), ValueError, "nhead: got 0; must be >= 1"),
    (dict(layer_norm_eps=float("inf")), ValueError, "layer_norm_eps: expected a finite real number >= 0"),
    (dict(batch_first=False), ValueError, r"batch_first: .* got False\. Transpose \(S, B, E\) inputs"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_encoder_layer_bad_arguments(kwargs, error, match):
    kwargs = {"d_model": E, "nhead": H, **kwargs}
    with pytest.raises(error, match=match):
        TransformerEncoderLayer(**kwargs)


def test_encoder_layer_bad_input():
    layer = TransformerEncoderLayer(E, H, 24, device=DEVICE)
    with pytest.raises(ValueError, match=r"src: expected a jagged \(B, j, E\) tensor with E = 16"):
        layer(random_jagged([2, 3], (E, 2)))
