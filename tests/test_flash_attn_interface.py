"""``varlen.flash_attn_interface`` against flash-attn 2.x's API and conventions.

Signatures are compared with flash-attn's, hard-coded below from its source. The masking conventions
(bottom-right causal, windows) are checked against the examples and formulas of flash-attn's docstrings,
read out of the attention probabilities; numerics against ``varlen.attention_reference`` in float64; the
varlen functions against the dense one run per sequence; packed functions against unpacked ones.
"""

from __future__ import annotations

import inspect
import re
import zlib

import pytest
import torch

import varlen
from utils import assert_close
from varlen.attn.dropout import dropout_keep_scale
from varlen.attn.reference import attention_reference
from varlen.flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
)

F64 = torch.float64


# ------------------------------------------------------------------------------------- signatures
class FlashAttn2:
    """The public functions of ``flash_attn/flash_attn_interface.py`` in flash-attn 2.x (the 2.7 / 2.8 releases;
    read at commit 005300258a22e5fc6be621063c3d5704e82b89d9 of Dao-AILab/flash-attention): names, order,
    defaults. Update this, with the version, if flash-attn changes them."""

    @staticmethod
    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                        alibi_slopes=None, deterministic=False, return_attn_probs=False): ...

    @staticmethod
    def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                  softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False): ...

    @staticmethod
    def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                 softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False): ...

    @staticmethod
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               deterministic=False, return_attn_probs=False, block_table=None): ...

    @staticmethod
    def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None,
                                         causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                         deterministic=False, return_attn_probs=False): ...

    @staticmethod
    def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                        dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                                        softcap=0.0, alibi_slopes=None, deterministic=False,
                                        return_attn_probs=False): ...


FUNCTIONS = [flash_attn_func, flash_attn_qkvpacked_func, flash_attn_kvpacked_func, flash_attn_varlen_func,
             flash_attn_varlen_qkvpacked_func, flash_attn_varlen_kvpacked_func]


def _params(fn) -> list:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
def test_signature_matches_flash_attn_2(fn):
    assert _params(fn) == _params(getattr(FlashAttn2, fn.__name__))


def test_module_exports_exactly_the_flash_attn_functions():
    import varlen.flash_attn_interface as module

    public = {n for n, obj in vars(module).items() if inspect.isfunction(obj) and not n.startswith("_")
              and obj.__module__ == module.__name__}
    assert public == {f.__name__ for f in FUNCTIONS}


# --------------------------------------------------------------------------- masking conventions
def _visible(Lq: int, Lk: int, fn_kwargs: dict, varlen_call: bool) -> torch.Tensor:
    """Which keys each query sees, read off the probabilities: q = 0 makes every score equal, so with
    v = identity the output row i is uniform over the keys query i sees."""
    q = torch.zeros(1, Lq, 1, 4, dtype=F64)
    k = torch.randn(1, Lk, 1, 4, dtype=F64)
    v = torch.eye(Lk, dtype=F64).view(1, Lk, 1, Lk)
    if varlen_call:  # a first sequence of other lengths ahead of the one looked at
        q = torch.cat([torch.randn(3, 1, 4, dtype=F64), q[0]])
        k, v = torch.cat([torch.randn(5, 1, 4, dtype=F64), k[0]]), torch.cat([torch.randn(5, 1, Lk, dtype=F64), v[0]])
        cu_q = torch.tensor([0, 3, 3 + Lq], dtype=torch.int32)
        cu_k = torch.tensor([0, 5, 5 + Lk], dtype=torch.int32)
        out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(3, Lq), max(5, Lk), **fn_kwargs)[3:]
    else:
        out = flash_attn_func(q, k, v, **fn_kwargs)[0]
    return out[:, 0] > 0


def _rows(*rows: str) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in r] for r in rows])


@pytest.mark.parametrize("varlen_call", [False, True], ids=["dense", "varlen"])
def test_causal_is_bottom_right_as_documented(varlen_call):
    """The two examples of flash-attn's docstring (seqlen_q = 2, seqlen_k = 5 and the reverse)."""
    assert torch.equal(_visible(2, 5, dict(causal=True), varlen_call), _rows("11110", "11111"))
    assert torch.equal(_visible(5, 2, dict(causal=True), varlen_call), _rows("00", "00", "00", "10", "11"))


def _window_by_formula(Lq, Lk, left, right, causal):
    """flash-attn's docstring: query i sees keys [i + Lk - Lq - left, i + Lk - Lq + right] inclusive, -1
    unbounded; causal caps the right side at 0."""
    rows = []
    for i in range(Lq):
        c = i + Lk - Lq
        lo = 0 if left < 0 else c - left
        hi = Lk - 1 if right < 0 else c + right
        if causal:
            hi = min(hi, c)
        rows.append("".join("1" if lo <= j <= hi else "0" for j in range(Lk)))
    return _rows(*rows)


@pytest.mark.parametrize("varlen_call", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("Lq,Lk,window,causal", [
    (6, 6, (2, 1), False), (4, 9, (1, 0), False), (9, 4, (0, 2), False), (5, 8, (-1, 1), False),
    (8, 5, (2, -1), False), (7, 7, (3, -1), True), (4, 9, (2, 5), True), (6, 6, (0, 0), False),
])
def test_window_convention(Lq, Lk, window, causal, varlen_call):
    got = _visible(Lq, Lk, dict(window_size=window, causal=causal), varlen_call)
    assert torch.equal(got, _window_by_formula(Lq, Lk, *window, causal))


@pytest.mark.parametrize("varlen_call", [False, True], ids=["dense", "varlen"])
@pytest.mark.parametrize("window,dtype", [((2, 1), torch.int64), ((-1, 0), torch.int32), ((3, -1), torch.int16)])
def test_window_size_may_be_an_integer_tensor(window, dtype, varlen_call, device):
    """As users pass torch.tensor([left, right]); on any device (it is read on the host)."""
    got = _visible(6, 8, dict(window_size=torch.tensor(window, dtype=dtype, device=device)), varlen_call)
    assert torch.equal(got, _window_by_formula(6, 8, *window, False))


# ----------------------------------------------------------------------------- numerics (dense)
DENSE_CASES = [  # (id, B, Sq, Sk, H, Hkv, D, Dv, options)
    ("plain", 2, 17, 17, 2, 2, 16, 16, {}),
    ("causal-Sq<Sk-gqa", 2, 5, 23, 4, 2, 16, 8, dict(causal=True)),
    ("causal-Sq>Sk-mqa", 1, 19, 6, 4, 1, 16, 16, dict(causal=True)),
    ("window-scale", 2, 9, 12, 2, 2, 8, 8, dict(window_size=(3, 2), softmax_scale=0.3)),
    ("causal-window-left", 1, 1, 17, 2, 2, 8, 8, dict(window_size=(4, -1), causal=True)),
    ("alibi-H-softcap", 2, 7, 9, 4, 2, 8, 8, dict(alibi_slopes="H", softcap=2.0)),
    ("alibi-BH-causal", 2, 9, 7, 2, 2, 8, 8, dict(alibi_slopes="BH", causal=True, deterministic=True)),
]


def _slopes(kind, B, H):
    if kind is None:
        return None
    return torch.rand((H,) if kind == "H" else (B, H), dtype=torch.float32) * 0.5


def _reference(q, k, v, options: dict, keep=None, dropout_p=0.0):
    """varlen's reference with flash-attn's conventions spelled out: everything bottom-right aligned."""
    left, right = options.get("window_size", (-1, -1))
    slopes = options.get("alibi_slopes")
    return attention_reference(q, k, v, causal=options.get("causal", False), align="bottom_right",
                               window=(None if left < 0 else left, None if right < 0 else right),
                               scale=options.get("softmax_scale"), softcap=options.get("softcap", 0.0),
                               alibi_slopes=None if slopes is None else slopes.to(F64),
                               dropout_mask=keep, dropout_p=dropout_p)


def _leaves(*shapes, device):
    return [torch.randn(s, dtype=F64, device=device, requires_grad=True) for s in shapes]


def _assert_grads_match(out, ref, leaves, device, names="qkv"):
    dout = torch.randn(ref.shape, dtype=F64, device=device)
    grads = torch.autograd.grad((out * dout).sum(), leaves)
    ref_grads = torch.autograd.grad((ref * dout).sum(), leaves)
    for name, g, r in zip(names, grads, ref_grads, strict=True):
        assert_close(g, r, name=f"d{name}", floor=1e-12)


@pytest.mark.parametrize("case", DENSE_CASES, ids=lambda c: c[0])
def test_flash_attn_func_matches_reference(case, device):
    name, B, Sq, Sk, H, Hkv, D, Dv, options = case
    torch.manual_seed(zlib.crc32(name.encode()))
    q, k, v = _leaves((B, Sq, H, D), (B, Sk, Hkv, D), (B, Sk, Hkv, Dv), device=device)
    options = dict(options)
    if "alibi_slopes" in options:
        options["alibi_slopes"] = _slopes(options["alibi_slopes"], B, H).to(device)
    out, lse, s_dmask = flash_attn_func(q, k, v, return_attn_probs=True, **options)
    ref, ref_lse = _reference(q, k, v, options)
    assert out.shape == (B, Sq, H, Dv) and lse.shape == (B, H, Sq) and lse.dtype == F64  # float32 for others
    assert s_dmask.shape == (0,) and s_dmask.dtype == q.dtype  # flash-attn 2.7 / 2.8 without dropout
    assert_close(out, ref, name="out")
    assert_close(lse, ref_lse, torch.float32, name="lse")
    _assert_grads_match(out, ref, [q, k, v], device)


def test_return_structure(device):
    q = torch.randn(1, 4, 2, 8, device=device)
    out = flash_attn_func(q, q, q)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    result = flash_attn_func(q, q, q, return_attn_probs=True)
    assert isinstance(result, tuple) and len(result) == 3 and result[1].dtype == torch.float32
    assert result[2].shape == (0,) and result[2].dtype == q.dtype and result[2].device == q.device


def test_queries_that_see_no_key(device):
    """Output 0 (as flash-attn) and lse -inf (flash-attn gives +inf there: a documented difference)."""
    q, k, v = (torch.randn(1, n, 2, 8, dtype=F64, device=device) for n in (5, 2, 2))
    out, lse, _ = flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out[:, :3], torch.zeros_like(out[:, :3])) and torch.isneginf(lse[..., :3]).all()
    assert torch.isfinite(lse[..., 3:]).all()


def test_nonpositive_softcap_disables_it(device):
    q, k, v = (torch.randn(2, 6, 2, 8, device=device) for _ in range(3))
    assert torch.equal(flash_attn_func(q, k, v, softcap=-1.0), flash_attn_func(q, k, v, softcap=0.0))


@pytest.mark.parametrize("varlen_call", [False, True], ids=["dense", "varlen"])
def test_dropout_matches_reference_on_the_calls_mask(varlen_call, device):
    p = 0.2
    q, k, v = _leaves((2, 7, 4, 8), (2, 9, 2, 8), (2, 9, 2, 8), device=device)
    keep = varlen.attention_dropout_mask(q, k, p)  # the mask of the next call (it draws nothing)
    if varlen_call:
        cu_q = torch.tensor([0, 7, 14], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 9, 18], dtype=torch.int32, device=device)
        flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
        out = flash_attn_varlen_func(*flat, cu_q, cu_k, 7, 9, dropout_p=p, causal=True).view(2, 7, 4, 8)
    else:
        out = flash_attn_func(q, k, v, dropout_p=p, causal=True)
    ref, _ = _reference(q, k, v, dict(causal=True), keep=keep, dropout_p=p)
    assert_close(out, ref, name="out")
    _assert_grads_match(out, ref, [q, k, v], device)


# ------------------------------------------------------------------------- return_attn_probs (S_dmask)
def _probabilities_by_formula(q_seqs, k_seqs, max_q, max_k, options) -> torch.Tensor:
    """``(B, H, max_q, max_k)`` float64: per sequence and head, the softmax of the scaled, softcapped,
    ALiBi-shifted scores over the keys flash-attn's docstring lets each query see; zeros elsewhere."""
    H, Hkv, D = q_seqs[0].shape[1], k_seqs[0].shape[1], q_seqs[0].shape[2]
    scale = options.get("softmax_scale") or D ** -0.5
    softcap, slopes = options.get("softcap", 0.0), options.get("alibi_slopes")
    left, right = options.get("window_size", (-1, -1))
    probs = torch.zeros(len(q_seqs), H, max_q, max_k, dtype=F64)
    for b, (qb, kb) in enumerate(zip(q_seqs, k_seqs, strict=True)):
        Lq, Lk = qb.shape[0], kb.shape[0]
        if Lq == 0 or Lk == 0:
            continue
        seen = _window_by_formula(Lq, Lk, left, right, options.get("causal", False))
        distance = (torch.arange(Lq).view(-1, 1) + Lk - Lq - torch.arange(Lk).view(1, -1)).abs()
        for h in range(H):
            s = scale * qb[:, h].double().cpu() @ kb[:, h // (H // Hkv)].double().cpu().T
            if softcap > 0:
                s = softcap * torch.tanh(s / softcap)
            if slopes is not None:
                s = s - float(slopes[b, h] if slopes.dim() == 2 else slopes[h]) * distance
            p = torch.softmax(s.masked_fill(~seen, float("-inf")), dim=-1)
            probs[b, h, :Lq, :Lk] = torch.where(seen.any(dim=1, keepdim=True), p, 0.0)
    return probs


PROBS_CASES = [  # (id, q lengths, k lengths (varlen) or None (dense, all of the first's), H, Hkv, options)
    ("dense-causal-gqa", (5, 5), (9, 9), 4, 2, dict(causal=True), False),
    ("dense-window-alibi-softcap", (7,), (6,), 2, 2, dict(window_size=(2, 1), alibi_slopes="BH", softcap=2.0,
                                                          softmax_scale=0.4), False),
    ("varlen-cross-causal", (3, 0, 6, 4), (5, 2, 0, 9), 2, 1, dict(causal=True), True),
    ("varlen-window-alibi", (6, 1, 8), (6, 4, 3), 4, 2, dict(window_size=(1, 2), alibi_slopes="H"), True),
]


@pytest.mark.parametrize("case", PROBS_CASES, ids=lambda c: c[0])
def test_attn_probs_are_the_probabilities_with_the_calls_drop_mask(case, device):
    """S_dmask.abs() is the softmax of the masked scores and its sign bit the call's drop mask, which
    varlen.attention_dropout_mask gives before the call."""
    name, q_lens, k_lens, H, Hkv, options, varlen_call = case
    torch.manual_seed(zlib.crc32(name.encode()))
    p, B, D = 0.3, len(q_lens), 8
    options = dict(options)
    if "alibi_slopes" in options:
        options["alibi_slopes"] = _slopes(options["alibi_slopes"], B, H).to(device)
    q = torch.randn(sum(q_lens), H, D, dtype=F64, device=device)
    k, v = (torch.randn(sum(k_lens), Hkv, D, dtype=F64, device=device) for _ in range(2))
    if varlen_call:
        cu_q, cu_k = _cu(q_lens, device), _cu(k_lens, device)
        max_q, max_k = max(q_lens) + 1, max(k_lens)  # an upper bound works and sets the shape
        keep = varlen.attention_dropout_mask(varlen.JaggedTensor(q, cu_q, max_q, validate=False),
                                             varlen.JaggedTensor(k, cu_k, max_k, validate=False), p)
        out, _, s_dmask = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=p,
                                                 return_attn_probs=True, **options)
        q_seqs, k_seqs = q.split(list(q_lens)), k.split(list(k_lens))
    else:
        max_q, max_k = q_lens[0], k_lens[0]
        q, k, v = q.view(B, max_q, H, D), k.view(B, max_k, Hkv, D), v.view(B, max_k, Hkv, D)
        keep = varlen.attention_dropout_mask(q, k, p)
        out, _, s_dmask = flash_attn_func(q, k, v, dropout_p=p, return_attn_probs=True, **options)
        q_seqs, k_seqs = list(q), list(k)
        # S_dmask describes the call: its kept probabilities, scaled, times v give the output.
        # Kept weights are scaled by 1 / (1 - p) with p rounded to 2**-8 (dropout_keep_scale).
        kept = torch.where(torch.signbit(s_dmask), 0.0, s_dmask) * dropout_keep_scale(p)
        assert_close(out, torch.einsum("bhij,bjhd->bihd", kept, v.repeat_interleave(H // Hkv, dim=2)), name="out")
    assert s_dmask.shape == (B, H, max_q, max_k) and s_dmask.dtype == q.dtype and not s_dmask.requires_grad
    assert torch.equal(torch.signbit(s_dmask), ~keep) and keep.any() and not keep.all()
    ref = _probabilities_by_formula(q_seqs, k_seqs, max_q, max_k, options)
    assert_close(s_dmask.abs(), ref, name="S_dmask.abs()")
    nonzero = ref > 0  # flash-attn's test convention: negative = dropped
    assert torch.equal((s_dmask >= 0)[nonzero.to(device)], keep[nonzero.to(device)])


def test_attn_probs_in_low_precision_and_packed(device):
    qkv = torch.randn(2, 6, 3, 2, 8, device=device)
    keep = varlen.attention_dropout_mask(qkv[:, :, 0], qkv[:, :, 1], 0.2)
    _, _, s_dmask = flash_attn_qkvpacked_func(qkv, dropout_p=0.2, causal=True, return_attn_probs=True)
    ref = _probabilities_by_formula(list(qkv[:, :, 0]), list(qkv[:, :, 1]), 6, 6, dict(causal=True))
    assert s_dmask.dtype == torch.float32 and torch.equal(torch.signbit(s_dmask), ~keep)
    assert_close(s_dmask.abs(), ref, name="S_dmask.abs()")


def test_attn_probs_are_computed_only_when_asked_for(device, monkeypatch):
    """Without dropout (or without return_attn_probs) nothing O(Sq * Sk) is built: S_dmask is empty."""
    import varlen.flash_attn_interface as module

    monkeypatch.setattr(module, "_probabilities", lambda *a, **k: pytest.fail("probabilities computed"))
    q = torch.randn(1, 5, 2, 8, device=device)
    assert flash_attn_func(q, q, q, dropout_p=0.1).shape == q.shape
    assert flash_attn_func(q, q, q, dropout_p=0.0, return_attn_probs=True)[2].shape == (0,)


# ------------------------------------------------------------------------------------------ varlen
VARLEN_CASES = [  # (id, q lengths, k lengths or None (= q's offsets), H, Hkv, options)
    ("self", (0, 1, 17, 9), None, 2, 2, {}),
    ("self-causal-gqa", (0, 1, 17, 9), None, 4, 2, dict(causal=True)),
    ("cross-causal", (3, 17, 1, 0), (17, 0, 5, 9), 2, 1, dict(causal=True)),
    ("cross-window-alibi", (3, 17, 1, 6), (17, 2, 5, 9), 2, 2, dict(window_size=(2, 1), alibi_slopes="BH")),
    ("batch1-softcap", (33,), (20,), 2, 2, dict(softcap=3.0, causal=True)),
]


def _cu(lengths, device):
    return torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)


@pytest.mark.parametrize("case", VARLEN_CASES, ids=lambda c: c[0])
def test_varlen_matches_dense_per_sequence(case, device):
    name, q_lens, k_lens, H, Hkv, options = case
    torch.manual_seed(zlib.crc32(name.encode()))
    self_attention = k_lens is None
    k_lens = q_lens if self_attention else k_lens
    B = len(q_lens)
    q, k, v = _leaves((sum(q_lens), H, 8), (sum(k_lens), Hkv, 8), (sum(k_lens), Hkv, 6), device=device)
    options = dict(options)
    if "alibi_slopes" in options:
        options["alibi_slopes"] = _slopes(options["alibi_slopes"], B, H).to(device)
    cu_q = _cu(q_lens, device)
    cu_k = cu_q if self_attention else _cu(k_lens, device)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), return_attn_probs=True,
                                         **options)
    assert out.shape == (sum(q_lens), H, 6) and lse.shape == (H, sum(q_lens))

    outs, lses, qs, ks = [], [], 0, 0
    for b, (lq, lk) in enumerate(zip(q_lens, k_lens, strict=True)):
        per_seq = dict(options)
        if "alibi_slopes" in options:
            per_seq["alibi_slopes"] = options["alibi_slopes"][b:b + 1]
        if lk == 0:  # no keys: zero output, lse -inf (a dense call can't differentiate this: see test_sdpa)
            outs.append(q.new_zeros(lq, H, 6).detach())
            lses.append(torch.full((H, lq), float("-inf"), device=device))
        else:
            o, l, _ = flash_attn_func(q[None, qs:qs + lq], k[None, ks:ks + lk], v[None, ks:ks + lk],
                                      return_attn_probs=True, **per_seq)
            outs.append(o[0])
            lses.append(l[0])
        qs, ks = qs + lq, ks + lk
    ref, ref_lse = torch.cat(outs), torch.cat(lses, dim=1)
    assert_close(out, ref, name="out")
    assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse))
    assert_close(lse, ref_lse, torch.float32, name="lse")
    _assert_grads_match(out, ref, [q, k, v], device)


def test_max_seqlen_may_be_an_upper_bound_or_a_tensor(device):
    """transformers passes max lengths as 0-dim tensors at times; flash-attn reads them as ints."""
    q = torch.randn(12, 2, 8, device=device)
    cu = _cu((5, 7), device)
    exact = flash_attn_varlen_func(q, q, q, cu, cu, 7, 7, causal=True)
    assert torch.equal(flash_attn_varlen_func(q, q, q, cu, cu, torch.tensor(7), torch.tensor(7), causal=True), exact)
    assert_close(flash_attn_varlen_func(q, q, q, cu, cu, 12, 12, causal=True), exact, name="out")


def test_int64_offsets_work(device):
    q = torch.randn(12, 2, 8, device=device)
    out = flash_attn_varlen_func(q, q, q, _cu((5, 7), device).long(), _cu((5, 7), device).long(), 7, 7)
    assert torch.equal(out, flash_attn_varlen_func(q, q, q, _cu((5, 7), device), _cu((5, 7), device), 7, 7))


# ------------------------------------------------------------------------------------------ packed
@pytest.mark.parametrize("varlen_call", [False, True], ids=["dense", "varlen"])
def test_packed_match_unpacked(varlen_call, device):
    B, S, H, D = 2, 9, 2, 8
    shape = (B * S, 3, H, D) if varlen_call else (B, S, 3, H, D)
    qkv = torch.randn(shape, dtype=F64, device=device, requires_grad=True)
    cu = _cu((S, S), device)
    kw = dict(causal=True, window_size=(3, -1))

    def unpacked(q, k, v):
        if varlen_call:
            return flash_attn_varlen_func(q, k, v, cu, cu, S, S, **kw)
        return flash_attn_func(q, k, v, **kw)

    parts = [qkv.select(-3, i) for i in range(3)]
    ref = unpacked(*parts)
    if varlen_call:
        packed = flash_attn_varlen_qkvpacked_func(qkv, cu, S, **kw)
        kv_packed = flash_attn_varlen_kvpacked_func(parts[0], qkv[:, 1:], cu, cu, S, S, **kw)
    else:
        packed = flash_attn_qkvpacked_func(qkv, **kw)
        kv_packed = flash_attn_kvpacked_func(parts[0], qkv[:, :, 1:], **kw)
    dout = torch.randn(ref.shape, dtype=F64, device=device)
    (ref_grad,) = torch.autograd.grad((ref * dout).sum(), qkv)
    for out in (packed, kv_packed):
        assert torch.equal(out, ref)
        (grad,) = torch.autograd.grad((out * dout).sum(), qkv)
        assert_close(grad, ref_grad, name="dqkv")


# ------------------------------------------------------------------------------------------ errors
def _t(*shape, dtype=torch.float32):
    return torch.randn(shape, dtype=dtype)


CU = torch.tensor([0, 3, 8], dtype=torch.int32)
ERRORS = [  # (id, call, exception, message)
    ("block_table", lambda: flash_attn_varlen_func(_t(8, 2, 8), _t(8, 2, 8), _t(8, 2, 8), CU, CU, 5, 5,
                                                   block_table=torch.zeros(2, 1, dtype=torch.int32)),
     ValueError, "block_table: paged KV caches are not supported"),
    ("float cu_seqlens", lambda: flash_attn_varlen_func(_t(8, 2, 8), _t(8, 2, 8), _t(8, 2, 8), CU.float(), CU, 5, 5),
     TypeError, "cu_seqlens_q: dtype float32 is not supported"),
    ("2-d cu_seqlens", lambda: flash_attn_varlen_func(_t(8, 2, 8), _t(8, 2, 8), _t(8, 2, 8), CU, CU[None], 5, 5),
     ValueError, "cu_seqlens_k: expected shape (batch + 1,) with batch >= 1, got (1, 3)"),
    ("batch sizes", lambda: flash_attn_varlen_func(_t(8, 2, 8), _t(8, 2, 8), _t(8, 2, 8), CU, CU[:2], 5, 5),
     ValueError, "cu_seqlens_k: shape (2,) differs from cu_seqlens_q's (3,)"),
    ("cu_seqlens device", lambda: flash_attn_varlen_func(_t(8, 2, 8), _t(8, 2, 8), _t(8, 2, 8), CU.to("meta"), CU,
                                                         5, 5), ValueError, "cu_seqlens_q: on device meta"),
    ("max_seqlen float", lambda: flash_attn_varlen_func(_t(8, 2, 8), _t(8, 2, 8), _t(8, 2, 8), CU, CU, 5.0, 5),
     TypeError, "max_seqlen_q: expected an int, got float 5.0"),
    ("max_seqlen negative", lambda: flash_attn_varlen_func(_t(8, 2, 8), _t(8, 2, 8), _t(8, 2, 8), CU, CU, 5, -1),
     ValueError, "max_seqlen_k: got -1; must be >= 0"),
    ("varlen q dims", lambda: flash_attn_varlen_func(_t(1, 8, 2, 8), _t(8, 2, 8), _t(8, 2, 8), CU, CU, 5, 5),
     ValueError, "q: expected 3 dims (total, heads, dim), got shape (1, 8, 2, 8)"),
    ("v rows", lambda: flash_attn_varlen_func(_t(8, 2, 8), _t(8, 2, 8), _t(7, 2, 8), CU, CU, 5, 5),
     ValueError, "v: 7 rows differ from k's 8"),
    ("qkv shape", lambda: flash_attn_qkvpacked_func(_t(2, 5, 2, 2, 8)), ValueError,
     "qkv: expected shape (batch, seq, 3, heads, dim), got (2, 5, 2, 2, 8)"),
    ("varlen kv shape", lambda: flash_attn_varlen_kvpacked_func(_t(8, 2, 8), _t(8, 3, 2, 8), CU, CU, 5, 5),
     ValueError, "kv: expected shape (total, 2, heads, dim), got (8, 3, 2, 8)"),
    ("window_size", lambda: flash_attn_func(_t(1, 5, 2, 8), _t(1, 5, 2, 8), _t(1, 5, 2, 8), window_size=4),
     ValueError, "window_size: expected (left, right) ints, -1 for unbounded; got 4"),
    ("window_size float tensor", lambda: flash_attn_func(_t(1, 5, 2, 8), _t(1, 5, 2, 8), _t(1, 5, 2, 8),
                                                         window_size=torch.tensor([2.0, 0.0])),
     TypeError, "window_size: expected (left, right) ints or an integer tensor, got a tensor of dtype torch.float32"),
    ("window_size bool tensor", lambda: flash_attn_func(_t(1, 5, 2, 8), _t(1, 5, 2, 8), _t(1, 5, 2, 8),
                                                        window_size=torch.tensor([True, False])),
     TypeError, "got a tensor of dtype torch.bool"),
    ("window_size tensor shape", lambda: flash_attn_func(_t(1, 5, 2, 8), _t(1, 5, 2, 8), _t(1, 5, 2, 8),
                                                         window_size=torch.tensor([[2, 0]])),
     ValueError, "window_size: expected (left, right) ints or a tensor of shape (2,), got a tensor of shape (1, 2)"),
    ("window_size 0-dim tensor", lambda: flash_attn_func(_t(1, 5, 2, 8), _t(1, 5, 2, 8), _t(1, 5, 2, 8),
                                                         window_size=torch.tensor(3)),
     ValueError, "got a tensor of shape ()"),
    ("dense q dims", lambda: flash_attn_func(_t(5, 2, 8), _t(5, 2, 8), _t(5, 2, 8)), ValueError,
     "q: expected 4 dims (batch, seq, heads, dim)"),
    ("dropout_p", lambda: flash_attn_func(_t(1, 5, 2, 8), _t(1, 5, 2, 8), _t(1, 5, 2, 8), dropout_p=1.0),
     ValueError, "dropout_p: expected a float in [0, 1)"),
    ("return_attn_probs", lambda: flash_attn_func(_t(1, 5, 2, 8), _t(1, 5, 2, 8), _t(1, 5, 2, 8),
                                                  return_attn_probs=1),
     TypeError, "return_attn_probs: expected a bool"),
    ("softmax_scale zero", lambda: flash_attn_func(_t(1, 5, 2, 8), _t(1, 5, 2, 8), _t(1, 5, 2, 8), softmax_scale=0.0),
     ValueError, "softmax_scale: expected None or a nonzero finite float, got 0.0"),
    ("softmax_scale nan", lambda: flash_attn_varlen_func(_t(8, 2, 8), _t(8, 2, 8), _t(8, 2, 8), CU, CU, 5, 5,
                                                         softmax_scale=float("nan")),
     ValueError, "softmax_scale: expected None or a nonzero finite float, got nan"),
]


@pytest.mark.parametrize("call,exc,message", [pytest.param(*e[1:], id=e[0]) for e in ERRORS])
def test_invalid_inputs(call, exc, message):
    with pytest.raises(exc, match=re.escape(message)):
        call()


@pytest.mark.gpu_only
def test_varlen_makes_no_host_sync(device):
    q = torch.randn(40, 4, 64, device=device, dtype=torch.float16, requires_grad=True)
    cu = _cu((0, 1, 17, 22), device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        flash_attn_varlen_func(q, q, q, cu, cu, 22, 22, causal=True).sum().backward()
        flash_attn_varlen_qkvpacked_func(torch.stack([q.detach()] * 3, 1), cu, 22)
    finally:
        torch.cuda.set_sync_debug_mode("default")
