"""Generated attention test cases, shared by the tests of every attention backend.

``case_params()`` gives ``pytest.param(backend, case, dtype)`` for every backend in
``ATTENTION_BACKENDS`` and every case of ``generate_cases()`` (small under CI, larger with a GPU), with
readable ids. To run another backend on all cases: add its name to ``ATTENTION_BACKENDS`` and its
dtypes to ``DTYPES``; record a known gap with a predicate in ``KNOWN_GAPS`` (those params become
``xfail(strict=True)``), never by dropping cases.

Tests of one dtype per backend take ``backend_params(cases)`` and run in ``main_dtype(backend)``.
``case.make(dtype, device)`` builds the inputs; ``run_attention`` and ``run_reference`` return
``(out, lse, grads)`` for the backend and for the float64 reference on the same inputs.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import zlib

import pytest
import torch

import varlen
from conftest import ON_GPU
from utils import checkable_dtypes, random_jagged
from varlen.attn import backends
from varlen.attn.dropout import attention_dropout_mask
from varlen.attn.reference import attention_reference

ATTENTION_BACKENDS = ("torch", "triton")

# Per backend: (dtypes run on every case, dtypes run on every SPARSE_EVERY-th case): every dtype the
# backend declares (its CAPABILITIES) that this machine can check (bf16 not under the interpreter), the
# ones it is mostly used with on every case.
EVERY_CASE = {"torch": (torch.float64, torch.float32),
              "triton": (torch.float16, torch.bfloat16) if ON_GPU else (torch.float16, torch.float32)}
DTYPES = {name: (EVERY_CASE[name], tuple(d for d in checkable_dtypes(backends.module(name).CAPABILITIES)
                                         if d not in EVERY_CASE[name]))
          for name in ATTENTION_BACKENDS}
assert all(set(every) <= set(checkable_dtypes(backends.module(n).CAPABILITIES)) for n, every in EVERY_CASE.items())
SPARSE_EVERY = 4

# backend -> predicate(case, dtype) returning the reason of a known gap, or None.
KNOWN_GAPS: dict = {}

# Bias shapes, by name: dims of (B, H, Sq, Sk) that are full ("B", "H", "Q", "K") or 1 ("1"). "QK" is
# a 2-dim (Sq, Sk) bias; "bool" a bool (B, 1, Sq, Sk) mask. Jagged biases are 3 wider than max_q/max_k.
BIAS_SHAPES = ("BHQK", "1HQK", "B11K", "11Q1", "QK", "bool")
JAGGED_BIAS_SLACK = 3


@dataclasses.dataclass(frozen=True)
class AttnCase:
    """One attention problem. Dense cases have equal lengths within q and within k."""

    jagged: bool
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...] | None  # None: self-attention, k and v share q's offsets (or Sk = Sq)
    heads: int
    kv_heads: int
    head_dim: int
    head_dim_v: int
    causal: bool = False
    align: str = "top_left"
    window: tuple[int | None, int | None] | None = None
    scale: float | None = None
    bias: str | None = None  # a BIAS_SHAPES name
    alibi: str | None = None  # "H" for (H,) slopes, "BH" for (B, H)
    softcap: float = 0.0
    dropout_p: float = 0.0
    deterministic: bool = False
    grad_lse: bool = False  # the loss also uses the lse
    strided: bool = False  # q, k, v are non-contiguous views (only stride(-1) == 1)
    prefix: int | None = None  # prefix_len: a per-sequence tensor derived from this (see make)
    documents: bool = False  # dense self-attention over packed rows of random documents
    query_offset: int | None = None  # query_offset: a per-sequence tensor derived from this (see make)

    @property
    def batch(self) -> int:
        return len(self.q_lens)

    @property
    def kv_lens(self) -> tuple[int, ...]:
        return self.q_lens if self.k_lens is None else self.k_lens

    @property
    def id(self) -> str:
        lens = ".".join(map(str, self.q_lens)) + ("" if self.k_lens is None else
                                                  "-k" + ".".join(map(str, self.k_lens)))
        parts = ["jagged" if self.jagged else "dense", f"q{lens}", f"h{self.heads}kv{self.kv_heads}",
                 f"d{self.head_dim}" + (f"v{self.head_dim_v}" if self.head_dim_v != self.head_dim else "")]
        if self.causal:
            parts.append("causal")
        if self.window is not None:
            parts.append("w" + ".".join("inf" if s is None else str(s) for s in self.window))
        if self.align == "bottom_right":
            parts.append("br")
        if self.scale is not None:
            parts.append(f"scale{self.scale}")
        if self.bias:
            parts.append(f"bias{self.bias}")
        if self.alibi:
            parts.append(f"alibi{self.alibi}")
        if self.softcap:
            parts.append(f"cap{self.softcap}")
        if self.dropout_p:
            parts.append(f"drop{self.dropout_p}")
        if self.prefix is not None:
            parts.append(f"prefix{self.prefix}")
        if self.query_offset is not None:
            parts.append(f"qoff{self.query_offset}")
        for flag in ("documents", "deterministic", "grad_lse", "strided"):
            if getattr(self, flag):
                parts.append(flag.replace("_", ""))
        return "-".join(parts)

    def options(self) -> dict:
        """The keyword arguments shared by ``varlen.attention`` and the reference."""
        return dict(causal=self.causal, window=self.window, align=self.align, scale=self.scale,
                    softcap=self.softcap)

    def make(self, dtype: torch.dtype, device) -> AttnInputs:
        """Fresh random inputs (seeded by the case id), leaves requiring grad; jagged biases poisoned
        with NaN past each sequence's lengths."""
        torch.manual_seed(zlib.crc32(self.id.encode()))
        H, Hkv, D, Dv = self.heads, self.kv_heads, self.head_dim, self.head_dim_v
        if self.jagged:
            q = _jagged(self.q_lens, (H, D), dtype, device, self.strided)
            k = (_jagged(self.k_lens, (Hkv, D), dtype, device, self.strided) if self.k_lens is not None
                 else q.with_values(_values(q.total, (Hkv, D), dtype, device, self.strided)))
            v = k.with_values(_values(k.total, (Hkv, Dv), dtype, device, self.strided))
            leaves = [q.values, k.values, v.values]
            lse_shape = (H, q.total)
        else:
            B, Sq, Sk = self.batch, self.q_lens[0], self.kv_lens[0]
            q = _dense((B, Sq, H, D), dtype, device, self.strided)
            k = _dense((B, Sk, Hkv, D), dtype, device, self.strided)
            v = _dense((B, Sk, Hkv, Dv), dtype, device, self.strided)
            leaves = [q, k, v]
            lse_shape = (B, H, Sq)
        for t in leaves:
            t.requires_grad_(True)
        bias, poisoned = self._bias(dtype, device)
        if bias is not None and bias.dtype != torch.bool:
            leaves.append(bias.requires_grad_(True))
        slopes = None
        if self.alibi is not None:
            shape = (H,) if self.alibi == "H" else (self.batch, H)
            # float32 values, exact in every dtype the API converts them through
            slopes = (torch.rand(shape, dtype=torch.float32) * 0.5).to(device, dtype)
        query_offset = None
        if self.query_offset is not None:  # varied per sequence: the queries somewhere among the keys
            query_offset = torch.tensor([(self.query_offset * (b + 1)) % (max(self.kv_lens) + 2)
                                         for b in range(self.batch)], dtype=torch.int32, device=device)
        generator = keep = None
        if self.dropout_p:
            generator = torch.Generator(device=device).manual_seed(zlib.crc32(self.id.encode()) + 1)
            keep = attention_dropout_mask(q, k, self.dropout_p, generator=generator)
            if query_offset is not None:  # the mask's rows are the queries' key positions
                rows = max(self.q_lens) + int(query_offset.max())
                shape = torch.empty(self.batch, rows, H, 1, device=device)  # only its sizes matter
                full = attention_dropout_mask(shape, k, self.dropout_p, generator=generator)
                index = (query_offset.view(-1, 1) + torch.arange(max(self.q_lens), device=device)).long()
                keep = full.gather(2, index.view(self.batch, 1, -1, 1).expand(-1, H, -1, full.shape[3]))
        out_rows = leaves[0].shape[:-1] + (Dv,)
        dout = torch.randn(out_rows, dtype=dtype, device=device)
        dlse = torch.randn(lse_shape, dtype=torch.float32, device=device) if self.grad_lse else None
        prefix_len = None
        if self.prefix is not None:  # varied per sequence, some past the sequence's end, one empty
            prefix_len = torch.tensor([(self.prefix * (b + 1)) % (max(self.kv_lens) + 3) for b in range(self.batch)],
                                      dtype=torch.int32, device=device)
        document_ids = None
        if self.documents:  # runs of 1 to 9 tokens with ids 0..2 (an id recurs: only runs separate documents)
            S = self.q_lens[0]
            runs = [torch.repeat_interleave(torch.randint(0, 3, (S,)), torch.randint(1, 10, (S,)))[:S]
                    for _ in range(self.batch)]
            document_ids = torch.stack(runs).to(device)
        return AttnInputs(q=q, k=k, v=v, bias=bias, alibi_slopes=slopes, generator=generator, keep=keep,
                          leaves=leaves, dout=dout, dlse=dlse, poisoned=poisoned, prefix_len=prefix_len,
                          document_ids=document_ids, query_offset=query_offset)

    def _bias(self, dtype, device):
        if self.bias is None:
            return None, None
        B, H = self.batch, self.heads
        slack = JAGGED_BIAS_SLACK if self.jagged else 0
        Sq, Sk = max(self.q_lens) + slack, max(self.kv_lens) + slack
        full = dict(B=B, H=H, Q=Sq, K=Sk)
        if self.bias == "bool":
            shape4 = (B, 1, Sq, Sk)
        elif self.bias == "QK":
            shape4 = (1, 1, Sq, Sk)
        else:
            shape4 = tuple(full.get(c, 1) for c in self.bias)
        shape = shape4[2:] if self.bias == "QK" else shape4
        if self.bias == "bool":
            keep = torch.rand(shape, device=device) < 0.8
            keep[..., 2::5, :] = False  # whole rows hidden: queries that see no key
            return keep, None
        bias = torch.randn(shape4, dtype=dtype, device=device)
        poisoned = None
        if self.jagged:
            # Entries past a sequence's lengths must be ignored: past each own sequence's lengths when
            # the bias has a batch dim, past the longest otherwise.
            per_seq = shape4[0] == B
            lq = torch.tensor(self.q_lens if per_seq else [Sq - slack], device=device).view(-1, 1, 1, 1)
            lk = torch.tensor(self.kv_lens if per_seq else [Sk - slack], device=device).view(-1, 1, 1, 1)
            i = torch.arange(shape4[2], device=device).view(1, 1, -1, 1)
            j = torch.arange(shape4[3], device=device).view(1, 1, 1, -1)
            poisoned = torch.zeros(shape4, dtype=torch.bool, device=device)
            if shape4[2] > 1:
                poisoned |= i >= lq
            if shape4[3] > 1:
                poisoned |= j >= lk
            bias = bias.masked_fill(poisoned, float("nan"))
            poisoned = poisoned.reshape(shape)
        return bias.reshape(shape).detach(), poisoned


@dataclasses.dataclass
class AttnInputs:
    q: object  # dense tensor or JaggedTensor
    k: object
    v: object
    bias: torch.Tensor | None
    alibi_slopes: torch.Tensor | None
    generator: torch.Generator | None
    keep: torch.Tensor | None  # the dropout keep mask of the call
    leaves: list  # tensors to differentiate: q, k, v (values when jagged), and a float bias
    dout: torch.Tensor  # gradient of the output (values layout when jagged)
    dlse: torch.Tensor | None
    poisoned: torch.Tensor | None  # bias entries set to NaN
    prefix_len: torch.Tensor | None
    document_ids: torch.Tensor | None
    query_offset: torch.Tensor | None


def _dense(shape, dtype, device, strided):
    if not strided:
        return torch.randn(shape, dtype=dtype, device=device)
    B, S, H, D = shape  # a (B, H, S, D) tensor seen as (B, S, H, D)
    return torch.randn(B, H, S, D, dtype=dtype, device=device).transpose(1, 2).detach()


def _values(rows, inner, dtype, device, strided):
    if not strided:
        return torch.randn(rows, *inner, dtype=dtype, device=device)
    wide = torch.randn(rows, inner[0], inner[1] + 8, dtype=dtype, device=device)
    return wide[..., :inner[1]].detach()


def _jagged(lengths, inner, dtype, device, strided):
    x = random_jagged(lengths, inner, dtype=dtype, device=device)
    return x.with_values(_values(x.total, inner, dtype, device, True)) if strided else x


def _values_of(x):
    return x.values if isinstance(x, varlen.JaggedTensor) else x


def _loss(out, lse, inputs: AttnInputs, finite: torch.Tensor):
    loss = (_values_of(out).to(torch.float64) * inputs.dout.to(torch.float64)).sum()
    if inputs.dlse is not None:
        loss = loss + (torch.where(finite, lse, 0).to(torch.float64) * inputs.dlse.to(torch.float64)).sum()
    return loss


def run_attention(case: AttnCase, inputs: AttnInputs, backend: str):
    """``(out, lse, grads)`` of ``varlen.attention`` (grads of ``inputs.leaves``)."""
    out, lse = varlen.attention(inputs.q, inputs.k, inputs.v, **case.options(), bias=inputs.bias,
                                alibi_slopes=inputs.alibi_slopes, dropout_p=case.dropout_p,
                                generator=inputs.generator, deterministic=case.deterministic,
                                prefix_len=inputs.prefix_len, document_ids=inputs.document_ids,
                                query_offset=inputs.query_offset, return_lse=True, backend=backend)
    grads = torch.autograd.grad(_loss(out, lse, inputs, torch.isfinite(lse)), inputs.leaves)
    return out, lse, grads


def run_reference(case: AttnCase, inputs: AttnInputs, dtype: torch.dtype = torch.float64):
    """``(out, lse, grads)`` of ``attention_reference`` in ``dtype`` (float64 unless asked: the reference; in the
    inputs' dtype, PyTorch's own error for flash-attn's rule) on the same inputs and dropout mask."""
    up = [t.detach().to(dtype).requires_grad_(True) for t in inputs.leaves]
    if case.jagged:
        q, k, v = (x.with_values(u) for x, u in zip((inputs.q, inputs.k, inputs.v), up[:3], strict=True))
    else:
        q, k, v = up[:3]
    bias = up[3] if len(up) > 3 else inputs.bias
    slopes = None if inputs.alibi_slopes is None else inputs.alibi_slopes.to(dtype)
    out, lse = attention_reference(q, k, v, **case.options(), bias=bias, alibi_slopes=slopes,
                                   dropout_mask=inputs.keep, dropout_p=case.dropout_p, prefix_len=inputs.prefix_len,
                                   document_ids=inputs.document_ids, query_offset=inputs.query_offset)
    grads = torch.autograd.grad(_loss(out, lse, inputs, torch.isfinite(lse)), up)
    return out, lse, grads


# ------------------------------------------------------------------------------------------ cases
MASKS = (  # (causal, align, window)
    (False, "top_left", None),
    (True, "top_left", None),
    (True, "bottom_right", None),
    (False, "top_left", (4, None)),  # left side only
    (False, "top_left", (None, 3)),  # right side only
    (False, "top_left", (3, 5)),
    (False, "top_left", (0, 0)),  # zero width: the diagonal alone
    (False, "bottom_right", (2, 1)),
    (True, "top_left", (5, None)),
    (True, "bottom_right", (3, 4)),  # the right side is cut by causal
    (True, "bottom_right", (0, None)),
)

SHAPES = (  # (jagged, q_lens, k_lens)
    (False, (17,), None),  # batch 1, square
    (True, (0, 1, 17, 9), None),  # self-attention: k shares q's offsets; lengths 0 and 1
    (False, (5, 5), (23, 23)),  # Lq < Lk
    (True, (3, 17, 1, 0), (17, 0, 5, 9)),  # cross-attention: Lq != Lk, an empty k, an empty q
    (False, (19, 19), (6, 6)),  # Lq > Lk: bottom-right leaves early rows with no key
    (True, (33,), (20,)),  # batch 1
)

HEADS = ((2, 2), (4, 2), (8, 1))  # (H, Hkv): GQA ratios 1, 2, 8
HEAD_DIMS = ((16, 16), (40, 40), (64, 32), (80, 80), (128, 128), (256, 256), (16, 40))  # (D, Dv)


def _large_shapes(rng: random.Random) -> list:
    """Longer sequences for the GPU run."""
    def lens(batch, longest):
        return tuple([0, 1, 17, longest] + [rng.randint(0, longest) for _ in range(batch - 4)])
    return [
        (False, (256, 256), None),
        (False, (128,), (384,)),
        (True, lens(8, 700), None),
        (True, lens(6, 300), lens(6, 500)),
        (True, (1024,), None),
        (False, (333, 333), (77, 77)),
    ]


def _mask_cases(shapes, per_mask: int) -> list[AttnCase]:
    """Every mask on ``per_mask`` of the shapes (rotating), with head counts and dims cycling."""
    cases = []
    heads, dims = itertools.cycle(HEADS), itertools.cycle(HEAD_DIMS)
    for m, (causal, align, window) in enumerate(MASKS):
        for s in range(per_mask):
            jagged, q_lens, k_lens = shapes[(m * per_mask + s) % len(shapes)]
            (H, Hkv), (D, Dv) = next(heads), next(dims)
            cases.append(AttnCase(jagged, q_lens, k_lens, H, Hkv, D, Dv, causal=causal, align=align,
                                  window=window, grad_lse=len(cases) % 2 == 1))
    return cases


def _feature_cases(shapes) -> list[AttnCase]:
    """Bias shapes, alibi, softcap, dropout, scale, strides, alone and combined with masks and GQA."""
    dense, jagged, cross = shapes[0], shapes[1], shapes[3]
    dense_cross = shapes[2]
    cases = []
    masks = itertools.cycle(((False, "top_left", None), (True, "bottom_right", None),
                             (False, "top_left", (3, 2))))
    # A bias constant along keys ("11Q1") only moves the lse: its gradient is 0 unless the loss uses it.
    for bias in BIAS_SHAPES:
        for shape in (dense, jagged if bias in ("11Q1", "QK") else cross):
            causal, align, window = next(masks)
            cases.append(AttnCase(*shape, 4, 2, 32, 32, causal=causal, align=align, window=window,
                                  bias=bias, grad_lse=bias in ("BHQK", "11Q1")))
    cases += [
        AttnCase(*dense_cross, 4, 4, 16, 16, causal=True, align="bottom_right", alibi="H"),
        AttnCase(*cross, 4, 2, 32, 32, align="bottom_right", window=(4, 2), alibi="BH", grad_lse=True),
        AttnCase(*jagged, 8, 1, 64, 64, causal=True, alibi="H"),
        AttnCase(*dense, 2, 2, 64, 64, softcap=1.5),
        AttnCase(*cross, 4, 2, 40, 40, causal=True, softcap=5.0, grad_lse=True),
        AttnCase(*dense, 2, 1, 32, 32, dropout_p=0.25),
        AttnCase(*jagged, 4, 2, 16, 24, causal=True, window=(6, None), dropout_p=0.5),
        AttnCase(*cross, 8, 2, 64, 64, align="bottom_right", dropout_p=0.1, grad_lse=True),
        AttnCase(*dense_cross, 4, 2, 32, 32, scale=0.3, strided=True),
        # negative scales (the fused CPU kernel masks causal scores before scaling them: the chunked path's)
        AttnCase(*dense, 4, 2, 32, 32, causal=True, scale=-0.4),
        AttnCase(*jagged, 4, 2, 32, 32, causal=True, scale=-0.2, grad_lse=True),
        AttnCase(*cross, 4, 2, 32, 16, causal=True, strided=True),
        AttnCase(*jagged, 2, 2, 32, 32, window=(2, 2), deterministic=True, bias="1HQK"),
        AttnCase(*dense, 4, 2, 32, 32, causal=True, deterministic=True, bias="11Q1", grad_lse=True),
        AttnCase(*cross, 2, 1, 16, 16, align="bottom_right", deterministic=True, bias="QK"),
        # prefix-LM (causal with a prefix), with windows, cross lengths, bottom-right; documents in packed rows
        AttnCase(*jagged, 4, 2, 32, 32, causal=True, prefix=5),
        AttnCase(*cross, 4, 2, 32, 32, causal=True, align="bottom_right", prefix=4, grad_lse=True),
        AttnCase(*dense, 2, 2, 16, 16, causal=True, window=(3, None), prefix=7),
        AttnCase(*dense, 4, 2, 32, 32, causal=True, documents=True),
        AttnCase(*dense, 4, 1, 64, 64, documents=True, bias="1HQK", dropout_p=0.2, grad_lse=True),
        AttnCase(*dense, 2, 2, 16, 16, causal=True, window=(4, None), alibi="H", softcap=3.0, documents=True,
                 prefix=6, deterministic=True),
        # query positions (a slice of longer sequences, as context parallelism runs them)
        AttnCase(*cross, 4, 2, 32, 32, causal=True, query_offset=7),
        AttnCase(*jagged, 4, 2, 32, 32, causal=True, window=(5, None), alibi="H", query_offset=3, grad_lse=True),
        AttnCase(*cross, 4, 2, 32, 32, causal=True, dropout_p=0.3, query_offset=5),
        AttnCase(*dense_cross, 4, 2, 16, 16, window=(2, 3), softcap=3.0, prefix=4, query_offset=9,
                 deterministic=True),
        # everything at once
        AttnCase(*cross, 8, 2, 64, 48, causal=True, align="bottom_right", window=(7, None), bias="B11K",
                 alibi="BH", softcap=4.0, dropout_p=0.2, deterministic=True, grad_lse=True),
        AttnCase(*dense_cross, 4, 1, 80, 80, window=(3, 6), bias="BHQK", alibi="H", softcap=2.0,
                 dropout_p=0.3, grad_lse=True, strided=True),
    ]
    return cases


def generate_cases(large: bool = ON_GPU) -> list[AttnCase]:
    """The cases: every mask on several shapes, then the features. ``large`` adds longer sequences."""
    cases = _mask_cases(SHAPES, per_mask=3) + _feature_cases(SHAPES)
    if large:
        rng = random.Random(20240601)
        shapes = list(SHAPES) + _large_shapes(rng)
        cases += _mask_cases(shapes[len(SHAPES):], per_mask=2) + _feature_cases(shapes[len(SHAPES):])
    unique = list(dict.fromkeys(cases))
    ids = [c.id for c in unique]
    if len(set(ids)) != len(ids):
        raise RuntimeError("attention_cases: two cases share an id")
    return unique


def dtypes_for(backend: str, index: int) -> tuple:
    """The dtypes case number ``index`` runs in on ``backend``."""
    every, sparse = DTYPES[backend]
    return every + (sparse if index % SPARSE_EVERY == 0 else ())


def main_dtype(backend: str) -> torch.dtype:
    """The dtype of the single-dtype tests (layouts, empty rows, determinism, dropout)."""
    return DTYPES[backend][0][0]


def _marks(backend: str, case: AttnCase, dtype: torch.dtype) -> list:
    reason = KNOWN_GAPS.get(backend, lambda case, dtype: None)(case, dtype)
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


def case_params(backends=ATTENTION_BACKENDS, cases=None) -> list:
    """``pytest.param(backend, case, dtype)`` for each backend, case and dtype, with known gaps xfailed."""
    cases = generate_cases() if cases is None else cases
    params = []
    for backend in backends:
        for index, case in enumerate(cases):
            for dtype in dtypes_for(backend, index):
                name = str(dtype).replace("torch.", "")
                params.append(pytest.param(backend, case, dtype, id=f"{backend}-{name}-{case.id}",
                                           marks=_marks(backend, case, dtype)))
    return params


def backend_params(cases, backends=ATTENTION_BACKENDS) -> list:
    """``pytest.param(backend, case)`` for tests run in ``main_dtype(backend)``, with known gaps xfailed."""
    return [pytest.param(backend, case, id=f"{backend}-{case.id}", marks=_marks(backend, case, main_dtype(backend)))
            for backend in backends for case in cases]
