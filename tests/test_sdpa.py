"""``varlen.scaled_dot_product_attention`` against ``torch.nn.functional.scaled_dot_product_attention``.

The reference is torch's math backend in float64, on the same inputs: outputs and gradients (of q, k, v and
of a float mask) must agree to float64 rounding. Dropout is compared with varlen's reference on the call's
own keep mask (torch draws another random stream). Nested inputs are compared with torch run on each
sequence alone, and with torch's own nested SDPA where it supports the case.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import varlen
import varlen.sdpa
from utils import assert_close
from varlen.sdpa import scaled_dot_product_attention

F64 = torch.float64


def torch_sdpa(*args, **kwargs):
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(*args, **kwargs)


# ------------------------------------------------------------------------------------- signature
def _expected_signature(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                        enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention as documented for torch 2.5 - 2.13 (the builtin has
    no Python signature; its schema, parsed below, says the same)."""


def _params(signature: inspect.Signature) -> list:
    return [(p.name, p.kind, p.default) for p in signature.parameters.values()]


def test_signature_matches_torch():
    assert _params(inspect.signature(scaled_dot_product_attention)) == _params(inspect.signature(_expected_signature))
    assert varlen.sdpa.scaled_dot_product_attention is scaled_dot_product_attention


def test_expected_signature_matches_the_installed_torch():
    """The hard-coded signature against the installed torch's operator schema (fails if torch changes it)."""
    (schema,) = torch._C._jit_get_schemas_for_operator("aten::scaled_dot_product_attention")
    kinds = []
    for arg in schema.arguments:
        kind = inspect.Parameter.KEYWORD_ONLY if arg.kwarg_only else inspect.Parameter.POSITIONAL_OR_KEYWORD
        default = inspect.Parameter.empty if not arg.has_default_value() else arg.default_value
        kinds.append((arg.name, kind, default))
    assert kinds == _params(inspect.signature(_expected_signature))
    first_line = F.scaled_dot_product_attention.__doc__.strip().splitlines()[0]
    assert first_line.startswith("scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,")


# --------------------------------------------------------------------------------- dense vs torch
@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    q: tuple
    k: tuple
    v: tuple
    mask: tuple | None = None  # shape of the mask
    mask_kind: str = "float"  # "float" (requires grad) or "bool"
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False
    strided: bool = False  # q, k, v are (B, S, H, D) tensors seen as (B, H, S, D)


CASES = [
    Case("4d", (2, 4, 5, 8), (2, 4, 5, 8), (2, 4, 5, 8)),
    Case("4d-causal-L<S-Dv", (2, 4, 5, 8), (2, 4, 9, 8), (2, 4, 9, 6), is_causal=True),
    Case("4d-causal-L>S-batch1", (1, 2, 17, 8), (1, 2, 6, 8), (1, 2, 6, 8), is_causal=True),
    Case("4d-L1-batch1", (1, 2, 1, 16), (1, 2, 17, 16), (1, 2, 17, 16)),
    Case("3d-causal", (3, 7, 8), (3, 7, 8), (3, 7, 8), is_causal=True, scale=0.25),
    Case("2d", (5, 8), (6, 8), (6, 4), mask=(5, 6)),
    Case("5d-broadcast-bool", (2, 3, 2, 5, 8), (1, 3, 2, 6, 8), (3, 2, 6, 8), mask=(2, 1, 1, 5, 6), mask_kind="bool"),
    Case("5d-mask-per-lead", (2, 3, 2, 5, 8), (2, 3, 2, 6, 8), (2, 3, 2, 6, 8), mask=(2, 3, 1, 1, 6)),
    Case("gqa", (2, 4, 5, 8), (2, 2, 6, 8), (2, 2, 6, 8), mask=(1, 4, 1, 6), scale=0.3, enable_gqa=True),
    Case("gqa-causal", (2, 6, 7, 8), (2, 2, 7, 8), (2, 2, 7, 8), is_causal=True, enable_gqa=True),
    Case("mqa-broadcast", (2, 4, 5, 8), (2, 1, 6, 8), (2, 1, 6, 8), mask=(5, 6)),
    Case("float-mask-full", (2, 2, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), mask=(2, 2, 5, 7)),
    Case("bool-mask-empty-rows", (2, 2, 6, 8), (2, 2, 6, 8), (2, 2, 6, 8), mask=(2, 1, 6, 6), mask_kind="bool"),
    Case("strided", (2, 4, 9, 8), (2, 4, 9, 8), (2, 4, 9, 8), is_causal=True, strided=True),
    Case("no-keys", (1, 2, 3, 8), (1, 2, 0, 8), (1, 2, 0, 8)),
    Case("5d-empty-lead", (0, 2, 3, 5, 8), (0, 2, 3, 6, 8), (0, 2, 3, 6, 8), mask=(0, 2, 1, 5, 6)),
]


def _make(case: Case, dtype, device):
    torch.manual_seed(zlib.crc32(case.id.encode()))

    def tensor(shape):
        if case.strided:  # a (B, S, H, D) tensor transposed to (B, H, S, D)
            B, H, S, D = shape
            return torch.randn(B, S, H, D, dtype=dtype, device=device).transpose(1, 2).requires_grad_(True)
        return torch.randn(shape, dtype=dtype, device=device).requires_grad_(True)

    q, k, v = tensor(case.q), tensor(case.k), tensor(case.v)
    mask = None
    if case.mask is not None and case.mask_kind == "bool":
        mask = torch.rand(case.mask, device=device) < 0.7
        mask[..., 2, :] = False  # a query that sees no key
    elif case.mask is not None:
        mask = torch.randn(case.mask, dtype=dtype, device=device).requires_grad_(True)
    return q, k, v, mask


def _assert_same_grads(out, ref, leaves: dict, device):
    """Gradients of ``sum(out * dout)`` and ``sum(ref * dout)`` for a random dout, for each leaf requiring grad."""
    dout = torch.randn(ref.shape, dtype=ref.dtype, device=device)
    names = [n for n, t in leaves.items() if t is not None and t.requires_grad]
    wanted = [leaves[n] for n in names]
    grads = torch.autograd.grad((out * dout).sum(), wanted)
    # torch's math backend leaves an input of an empty batch out of its graph: its gradient is zeros.
    ref_grads = torch.autograd.grad((ref * dout).sum(), wanted, allow_unused=True)
    ref_grads = [torch.zeros_like(t) if g is None else g for t, g in zip(wanted, ref_grads, strict=True)]
    for name, grad, ref_grad in zip(names, grads, ref_grads, strict=True):
        assert grad.shape == ref_grad.shape, name
        assert_close(grad, ref_grad, name=f"d{name}", floor=1e-12)


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_matches_torch_math_backend(case, device):
    q, k, v, mask = _make(case, F64, device)
    kwargs = dict(attn_mask=mask, is_causal=case.is_causal, scale=case.scale, enable_gqa=case.enable_gqa)
    out = scaled_dot_product_attention(q, k, v, **kwargs)
    ref = torch_sdpa(q, k, v, **kwargs)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert_close(out, ref, name="out")
    _assert_same_grads(out, ref, dict(q=q, k=k, v=v, mask=mask), device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_low_precision_close_to_float64(dtype, device):
    case = next(c for c in CASES if c.id == "gqa")  # with a float mask
    q, k, v, mask = _make(case, dtype, device)
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=case.scale, enable_gqa=True)
    up = [t.detach().double() for t in (q, k, v, mask)]
    ref = torch_sdpa(*up[:3], attn_mask=up[3], scale=case.scale, enable_gqa=True)
    assert out.dtype == dtype
    assert_close(out, ref, dtype, name="out")


def test_dense_inputs_are_not_copied(device, monkeypatch):
    """4-dim inputs reach varlen.attention as transposed views of the caller's memory."""
    seen = []
    real = varlen.sdpa.attention
    monkeypatch.setattr(varlen.sdpa, "attention",
                        lambda q, k, v, **kw: seen.append((q, k, v)) or real(q, k, v, **kw))
    q, k, v = (torch.randn(2, 4, 6, 8, device=device) for _ in range(3))
    out = scaled_dot_product_attention(q, k, v, is_causal=True)
    ((vq, vk, vv),) = seen
    for given, passed in ((q, vq), (k, vk), (v, vv)):
        assert passed.data_ptr() == given.data_ptr() and passed.shape == (2, 6, 4, 8)
    assert out.shape == (2, 4, 6, 8) and out.stride(-1) == 1


def test_gradcheck(device):
    case = Case("gradcheck", (1, 2, 3, 4), (1, 1, 4, 4), (1, 1, 4, 3), mask=(2, 3, 4))
    q, k, v, mask = _make(case, F64, device)
    assert torch.autograd.gradcheck(lambda *t: scaled_dot_product_attention(*t[:3], attn_mask=t[3]),
                                    (q, k, v, mask), atol=1e-8, rtol=1e-6)


# ----------------------------------------------------------------------- 0-dim tensor scale, dropout_p
@pytest.mark.parametrize("scale", [torch.tensor(0.3), torch.tensor(0.3, dtype=F64), torch.tensor(2)],
                         ids=["float32", "float64", "int64"])
def test_scale_may_be_a_0dim_tensor_as_in_torch(scale, device):
    """torch's Python binding reads a 0-dim tensor given for a float argument; so does varlen."""
    q, k, v, _ = _make(Case("tensor-scale", (2, 2, 5, 8), (2, 2, 6, 8), (2, 2, 6, 8)), F64, device)
    scale = scale.to(device)
    out = scaled_dot_product_attention(q, k, v, scale=scale, is_causal=True)
    assert_close(out, torch_sdpa(q, k, v, scale=scale, is_causal=True), name="out")  # torch takes it too
    assert torch.equal(out, scaled_dot_product_attention(q, k, v, scale=scale.item(), is_causal=True))
    _, nq = _nested((3, 5), 2, 8, device)
    nested = scaled_dot_product_attention(nq, nq, nq, scale=scale)
    assert torch.equal(nested.values(), scaled_dot_product_attention(nq, nq, nq, scale=scale.item()).values())


@pytest.mark.parametrize("dropout_p", [torch.tensor(0.3), torch.tensor(0.25, dtype=F64), torch.tensor(0)],
                         ids=["float32", "float64", "int64-zero"])
def test_dropout_p_may_be_a_0dim_tensor_as_in_torch(dropout_p, device):
    q, k, v = (torch.randn(1, 2, 6, 8, dtype=F64, device=device) for _ in range(3))
    dropout_p = dropout_p.to(device)
    torch.manual_seed(5)
    out = scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    torch.manual_seed(5)
    assert torch.equal(out, scaled_dot_product_attention(q, k, v, dropout_p=dropout_p.item()))
    assert torch_sdpa(q, k, v, dropout_p=dropout_p).shape == out.shape  # torch takes it too


# ------------------------------------------------------------------------------------------ dropout
@pytest.mark.parametrize("is_causal", [False, True])
def test_dropout_matches_reference_on_the_calls_mask(is_causal, device):
    """torch's dropout RNG differs, so the reference is varlen's on the call's own keep mask."""
    p = 0.3
    q, k, v, mask = _make(Case("dropout", (2, 4, 7, 8), (2, 2, 9, 8), (2, 2, 9, 8),
                               mask=None if is_causal else (2, 1, 7, 9)), F64, device)
    keep = varlen.attention_dropout_mask(q.transpose(1, 2), k.transpose(1, 2), p)  # doesn't draw
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=is_causal, enable_gqa=True)
    ref, _ = varlen.attention_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=is_causal,
                                        bias=mask, dropout_mask=keep, dropout_p=p)
    ref = ref.transpose(1, 2)
    assert_close(out, ref, name="out")
    _assert_same_grads(out, ref, dict(q=q, k=k, v=v, mask=mask), device)
    assert not keep.all() and keep.any()


def test_dropout_is_reproducible_from_the_seed(device):
    q, k, v = (torch.randn(1, 2, 8, 8, dtype=F64, device=device) for _ in range(3))
    torch.manual_seed(3)
    a = scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    b = scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(3)
    c = scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, c) and not torch.equal(a, b)


# ------------------------------------------------------------------------------------------- nested
def _nested(lengths, heads, dim, device, dtype=F64):
    """A leaf values tensor and SDPA's nested layout (B, H, j, D) over it."""
    offsets = torch.tensor([0, *lengths], device=device).cumsum(0)
    values = torch.randn(int(offsets[-1]), heads, dim, dtype=dtype, device=device, requires_grad=True)
    nt = torch.nested.nested_tensor_from_jagged(values, offsets, max_seqlen=max(lengths), min_seqlen=min(lengths))
    return values, nt.transpose(1, 2)


NESTED_CASES = [  # (id, q lengths, k lengths or None for q's, H, Hkv, is_causal, enable_gqa, mask shape)
    ("self", (0, 1, 17, 9), None, 2, 2, False, False, None),
    ("self-causal-gqa", (0, 1, 17, 9), None, 4, 2, True, True, None),
    ("cross", (3, 17, 1, 0), (17, 0, 5, 9), 2, 2, False, False, None),
    ("cross-causal-mqa", (3, 17, 1, 0), (17, 0, 5, 9), 4, 1, True, False, None),
    ("batch1-mask", (20,), (13,), 2, 2, False, False, (1, 2, 20, 13)),
    ("bool-mask", (4, 6), (5, 3), 2, 2, False, False, (2, 1, 6, 5)),
]


@pytest.mark.parametrize("case", NESTED_CASES, ids=lambda c: c[0])
def test_nested_matches_torch_per_sequence(case, device):
    name, q_lens, k_lens, H, Hkv, is_causal, enable_gqa, mask_shape = case
    k_lens = q_lens if k_lens is None else k_lens
    torch.manual_seed(zlib.crc32(name.encode()))
    qv, q = _nested(q_lens, H, 8, device)
    kv_, k = _nested(k_lens, Hkv, 8, device)
    vv = torch.randn(kv_.shape[0], Hkv, 5, dtype=F64, device=device, requires_grad=True)
    v = torch.nested.nested_tensor_from_jagged(vv, k.offsets(), max_seqlen=max(k_lens)).transpose(1, 2)
    mask = None
    if mask_shape is not None and name.startswith("bool"):
        mask = torch.rand(mask_shape, device=device) < 0.6
    elif mask_shape is not None:
        mask = torch.randn(mask_shape, dtype=F64, device=device, requires_grad=True)
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=0.4,
                                       enable_gqa=enable_gqa or Hkv != H)
    assert out.is_nested and out._ragged_idx == 2 and out.offsets() is q.offsets()
    assert out.shape[:2] == (len(q_lens), H) and out.shape[2] == q.shape[2] and out.shape[3] == 5
    out_values = out.transpose(1, 2).values()  # (total_q, H, 5)

    # torch on each sequence alone, (1, H, L, D)
    refs, qs, ks = [], 0, 0
    for b, (lq, lk) in enumerate(zip(q_lens, k_lens, strict=True)):
        seq = lambda x, start, n: x[start:start + n].transpose(0, 1).unsqueeze(0)
        m = None if mask is None else mask[b if mask.shape[0] > 1 else 0, :, :lq, :lk]
        refs.append(torch_sdpa(seq(qv, qs, lq), seq(kv_, ks, lk), seq(vv, ks, lk), attn_mask=m, is_causal=is_causal,
                               scale=0.4, enable_gqa=True)[0].transpose(0, 1))
        qs, ks = qs + lq, ks + lk
    ref = torch.cat(refs)
    assert_close(out_values, ref, name="out")
    _assert_same_grads(out_values, ref, dict(q=qv, k=kv_, v=vv, mask=mask), device)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_nested_matches_torchs_own_nested_sdpa(device):
    """Where torch's nested SDPA runs (no mask, no causal, equal heads), its result is ours."""
    _, q = _nested((3, 9, 1), 2, 8, device)
    _, k = _nested((4, 2, 6), 2, 8, device)
    vv = torch.randn(12, 2, 8, dtype=F64, device=device)
    v = torch.nested.nested_tensor_from_jagged(vv, k.offsets(), max_seqlen=6).transpose(1, 2)
    with torch.no_grad():
        out = scaled_dot_product_attention(q, k, v, scale=0.5)
        ref = F.scaled_dot_product_attention(q, k, v, scale=0.5)
    assert ref.is_nested and ref._ragged_idx == out._ragged_idx == 2
    assert_close(out.transpose(1, 2).values(), ref.transpose(1, 2).values(), name="out")


def test_nested_inputs_are_not_copied(device, monkeypatch):
    seen = []
    real = varlen.sdpa.attention
    monkeypatch.setattr(varlen.sdpa, "attention",
                        lambda q, k, v, **kw: seen.append((q, k, v)) or real(q, k, v, **kw))
    values, q = _nested((3, 5), 2, 8, device)
    out = scaled_dot_product_attention(q, q, q, is_causal=True)
    ((vq, vk, vv),) = seen
    assert isinstance(vq, varlen.JaggedTensor) and vq.values.data_ptr() == values.data_ptr()
    assert vq.offsets is q.offsets() and vq.max_len == 5
    assert out.transpose(1, 2).values().shape == (8, 2, 8)


def test_nested_dropout_matches_reference(device):
    p = 0.25
    qv, q = _nested((5, 0, 9), 2, 8, device)
    keep = varlen.attention_dropout_mask(q.transpose(1, 2), q.transpose(1, 2), p)
    out = scaled_dot_product_attention(q, q, q, dropout_p=p, is_causal=True)
    qj = varlen.JaggedTensor.from_nested(q.transpose(1, 2))
    ref, _ = varlen.attention_reference(qj, qj, qj, causal=True, dropout_mask=keep, dropout_p=p)
    assert_close(out.transpose(1, 2).values(), ref.values, name="out")


@pytest.mark.gpu_only
def test_no_host_sync_on_gpu(device):
    """Dense and nested calls (with their backward) make no device-to-host copies."""
    _, q = _nested((3, 17, 0), 4, 64, device, torch.float16)
    dense = torch.randn(2, 4, 33, 64, device=device, dtype=torch.float16, requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = scaled_dot_product_attention(q, q, q, is_causal=True)
        out.transpose(1, 2).values().sum().backward()
        scaled_dot_product_attention(dense, dense, dense, is_causal=True).sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


# -------------------------------------------------------------------------------------------- errors
def _r(*shape, dtype=torch.float32):
    return torch.randn(shape, dtype=dtype)


def _nt(ragged_idx=2, batch=2):
    offsets = torch.tensor([0, 3, 8, 10][:batch + 1])
    nt = torch.nested.nested_tensor_from_jagged(torch.randn(int(offsets[-1]), 2, 8), offsets, max_seqlen=5)
    return nt.transpose(1, 2) if ragged_idx == 2 else nt


ERRORS = [  # (id, args, kwargs, varlen's exception, message, torch also rejects it)
    ("1-dim", (_r(8), _r(8), _r(8)), {}, ValueError, "query: expected at least 2 dims", True),
    ("head dim", (_r(2, 4, 5, 8), _r(2, 4, 6, 7), _r(2, 4, 6, 8)), {}, ValueError,
     "key: head dim 7 differs from query's 8", True),
    ("value length", (_r(2, 4, 5, 8), _r(2, 4, 6, 8), _r(2, 4, 7, 8)), {}, ValueError,
     "value: sequence length 7 differs from key's 6", True),
    ("heads without enable_gqa", (_r(2, 4, 5, 8), _r(2, 2, 6, 8), _r(2, 2, 6, 8)), {}, ValueError,
     "pass enable_gqa=True", True),
    ("gqa not a multiple", (_r(2, 4, 5, 8), _r(2, 3, 6, 8), _r(2, 3, 6, 8)), dict(enable_gqa=True), ValueError,
     "query: 4 heads are not a multiple of key/value's 3 heads", True),
    ("key and value heads", (_r(2, 4, 5, 8), _r(2, 2, 6, 8), _r(2, 1, 6, 8)), dict(enable_gqa=True), ValueError,
     "key and value must have the same number of heads", False),
    ("query broadcast over heads", (_r(2, 1, 5, 8), _r(2, 4, 6, 8), _r(2, 4, 6, 8)), {}, ValueError,
     "query: 1 heads, but key/value have 4", False),
    ("leading dims", (_r(2, 4, 5, 8), _r(3, 4, 6, 8), _r(3, 4, 6, 8)), {}, ValueError,
     "leading dims of shapes (2, 4, 5, 8), (3, 4, 6, 8), (3, 4, 6, 8) don't broadcast", True),
    ("mask shape", (_r(2, 4, 5, 8), _r(2, 4, 6, 8), _r(2, 4, 6, 8)), dict(attn_mask=_r(4, 6)), ValueError,
     "attn_mask: shape (4, 6) does not broadcast to the attention weights' shape (2, 4, 5, 6)", True),
    ("mask dims", (_r(2, 4, 5, 8), _r(2, 4, 6, 8), _r(2, 4, 6, 8)), dict(attn_mask=_r(3, 2, 4, 5, 6)), ValueError,
     "attn_mask: shape (3, 2, 4, 5, 6) does not broadcast", True),
    ("mask dtype", (_r(2, 4, 5, 8), _r(2, 4, 6, 8), _r(2, 4, 6, 8)),
     dict(attn_mask=torch.zeros(5, 6, dtype=torch.int64)), TypeError, "attn_mask: dtype int64 is not supported", True),
    ("mask with is_causal", (_r(2, 4, 5, 8), _r(2, 4, 6, 8), _r(2, 4, 6, 8)),
     dict(attn_mask=torch.ones(5, 6, dtype=torch.bool), is_causal=True), ValueError,
     "attn_mask: must be None when is_causal=True", True),
    ("dropout_p above 1", (_r(2, 4, 5, 8),) * 3, dict(dropout_p=1.5), ValueError,
     "dropout_p: expected a float in [0, 1), got 1.5", True),
    ("dropout_p 1", (_r(2, 4, 5, 8),) * 3, dict(dropout_p=1.0), ValueError, "dropout_p: expected a float in [0, 1)",
     False),
    ("scale 1-dim tensor", (_r(2, 4, 5, 8),) * 3, dict(scale=torch.tensor([0.5])), TypeError,
     "scale: expected a float or a 0-dim float or integer tensor, got a tensor of shape (1,) and dtype torch.float32",
     True),
    ("dropout_p 2-element tensor", (_r(2, 4, 5, 8),) * 3, dict(dropout_p=torch.tensor([0.1, 0.2])), TypeError,
     "dropout_p: expected a float or a 0-dim float or integer tensor, got a tensor of shape (2,)", True),
    ("scale bool tensor", (_r(2, 4, 5, 8),) * 3, dict(scale=torch.tensor(True)), TypeError,
     "scale: expected a float or a 0-dim float or integer tensor, got a tensor of shape () and dtype torch.bool",
     False),
    ("scale requires grad", (_r(2, 4, 5, 8),) * 3, dict(scale=torch.tensor(0.5, requires_grad=True)), TypeError,
     "scale: got a tensor that requires grad, but no gradient is computed for scale", True),
    ("dropout_p tensor above 1", (_r(2, 4, 5, 8),) * 3, dict(dropout_p=torch.tensor(1.5)), ValueError,
     "dropout_p: expected a float in [0, 1), got 1.5", True),
    ("scale nan tensor", (_r(2, 4, 5, 8),) * 3, dict(scale=torch.tensor(float("nan"))), ValueError,
     "scale: expected None or a nonzero finite float, got nan", False),
    ("is_causal not a bool", (_r(2, 4, 5, 8),) * 3, dict(is_causal=1), TypeError, "is_causal: expected a bool", True),
    ("scale nan", (_r(2, 4, 5, 8),) * 3, dict(scale=float("nan")), ValueError,
     "scale: expected None or a nonzero finite", False),
    ("scale zero", (_r(2, 4, 5, 8),) * 3, dict(scale=0.0), ValueError,
     "scale: expected None or a nonzero finite float, got 0.0", False),
    ("dtype mismatch", (_r(2, 4, 5, 8), _r(2, 4, 6, 8, dtype=F64), _r(2, 4, 6, 8)), {}, TypeError,
     "key: dtype torch.float64 differs from query's torch.float32", True),
    ("integer inputs", (torch.ones(2, 4, 5, 8, dtype=torch.int64),) * 3, {}, TypeError,
     "query: dtype int64 is not supported", True),
    ("query not a tensor", ([[1.0]], _r(6, 8), _r(6, 8)), {}, TypeError, "query: expected a torch.Tensor", True),
    ("nested with dense", (_nt(), _r(2, 2, 5, 8), _r(2, 2, 5, 8)), {}, ValueError, "mix nested and dense", True),
    ("nested ragged dim 1", (_nt(1), _nt(1), _nt(1)), {}, ValueError,
     "expected SDPA's nested layout (B, H, j, D), a (B, j, H, D) nested tensor transposed(1, 2)", False),
    ("nested key batch", (_nt(), _nt(batch=3), _nt(batch=3)), {}, ValueError,
     "key: batch size 3 differs from query's 2", True),
    ("zero heads", (_r(2, 0, 5, 8),) * 3, {}, ValueError,
     "query, key, value: 0, 0 and 0 heads; each needs at least 1 (torch returns an empty result for 0", False),
]


@pytest.mark.parametrize("args,kwargs,exc,message,torch_rejects", [pytest.param(*e[1:], id=e[0]) for e in ERRORS])
def test_invalid_inputs(args, kwargs, exc, message, torch_rejects):
    """Each error is varlen's ValueError/TypeError naming the argument, and also a RuntimeError, as torch's
    are. Where torch rejects the input too, that is checked; the others are documented differences."""
    with pytest.raises(exc, match=re.escape(message)) as info:
        scaled_dot_product_attention(*args, **kwargs)
    assert isinstance(info.value, RuntimeError)
    if torch_rejects:
        with pytest.raises((RuntimeError, TypeError, ValueError)):
            torch_sdpa(*args, **kwargs)

