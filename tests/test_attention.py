"""varlen.attention against the float64 reference: outputs, lse and every gradient, for each backend.

The cases come from ``attention_cases.py`` (add a backend there: ``ATTENTION_BACKENDS``).
"""

import dataclasses
import doctest

import pytest
import torch
import torch.nn.functional as F

import varlen
from attention_cases import AttnCase, backend_params, case_params, main_dtype, run_attention, run_reference
from conftest import ON_GPU
from utils import KERNEL_DEVICE, REL_TOL, assert_close, record_calls, rel_err
from varlen._amp import float32_matmul_precision
from varlen._checks import accumulate_dtype
from varlen._triton import tl, triton
from varlen.attn import cpu_fused, reference, torch_backend
from varlen.attn.gluon import backward as gluon_backward
from varlen.attn.gluon import backward_dq as gluon_backward_dq
from varlen.attn.gluon import backward_wide as gluon_backward_wide
from varlen.attn.gluon import common as gluon_common
from varlen.attn.gluon import forward as gluon_forward
from varlen.attn.options import AttentionOptions, DropoutSeed, Problem
from varlen.attn.reference import attention_reference
from varlen.attn.triton import backward as triton_backward
from varlen.attn.triton import configs, program
from varlen.attn.triton import forward as triton_forward
from varlen.attn.triton import scores as triton_scores
from varlen.attn.triton.launch import features, head_block
from varlen.attn.triton.masks import SeqMask, key_blocks_after, query_stages
from varlen.attn.triton.parts import part_width, split_bf16
from varlen.attn.triton.program import longest_first

# The lse is float32 by contract (float64 for float64 inputs).
LSE_FLOOR = 1e-6
GRAD_NAMES = ("dq", "dk", "dv", "dbias")


def _values(x):
    return x.values if isinstance(x, varlen.JaggedTensor) else x


def _check_against_reference(case, inputs, out, lse, grads, dtype):
    ref_out, ref_lse, ref_grads = run_reference(case, inputs)
    if case.jagged:
        assert isinstance(out, varlen.JaggedTensor) and out.offsets is inputs.q.offsets
    assert out.dtype == dtype and _values(out).shape == _values(ref_out).shape
    assert lse.dtype == accumulate_dtype(dtype) and lse.shape == ref_lse.shape
    assert not torch.isnan(lse).any()
    assert torch.equal(lse == float("-inf"), ref_lse == float("-inf")), "rows that see no key differ"
    assert_close(_values(out), _values(ref_out), dtype, name="out")
    assert_close(lse, ref_lse, tol=max(REL_TOL[dtype], LSE_FLOOR), name="lse")
    # A gradient can vanish exactly (a query that sees a single key has dS = 0), leaving only rounding
    # noise: each gradient's error is measured against at least the problem's typical gradient size.
    rms = max((float(r.norm()) / r.numel() ** 0.5 for r in ref_grads[:3] if r.numel()), default=0.0)
    for name, leaf, grad, ref in zip(GRAD_NAMES[:len(grads)], inputs.leaves, grads, ref_grads, strict=True):
        assert grad.dtype == leaf.dtype and grad.shape == leaf.shape, name
        assert_close(grad, ref, dtype, name=name, floor=rms * ref.numel() ** 0.5)
    if inputs.poisoned is not None:
        assert torch.equal(grads[3][inputs.poisoned], torch.zeros_like(grads[3][inputs.poisoned]))


@pytest.mark.parametrize("backend,case,dtype", case_params())
def test_matches_reference(backend, case, dtype, device):
    inputs = case.make(dtype, device)
    out, lse, grads = run_attention(case, inputs, backend)
    _check_against_reference(case, inputs, out, lse, grads, dtype)


# Every buffer the Triton launchers allocate without zeros (the dQ accumulator among them: zeroed by the backward's
# preprocess, not by torch.zeros) must be written before it is read: allocations poisoned with NaN (floats) or -7
# (ints; conftest.poison_empty) must not change a result. Head dims 40 (an accumulator padded to 64 columns) and 64
# (the Gluon kernels on Hopper, with per-sequence descriptors at S 70 and host-made ones at S 128), jagged lengths 0,
# 1 and 17, GQA, dropout, and the deterministic mode's separate dQ kernel.
POISON_CASES = [
    AttnCase(True, (17, 0, 1, 40), None, 4, 2, 40, 40, causal=True),
    AttnCase(False, (70, 70), None, 2, 2, 64, 64),
    AttnCase(False, (128, 128), None, 4, 2, 64, 64, causal=True),
    AttnCase(True, (3, 17, 1, 0), (17, 0, 5, 9), 4, 2, 64, 64, causal=True, align="bottom_right", dropout_p=0.3),
    AttnCase(False, (33, 33), None, 2, 1, 40, 24, deterministic=True, grad_lse=True),
]


@pytest.mark.parametrize("case", POISON_CASES, ids=lambda c: c.id)
def test_triton_reads_no_unwritten_memory(case, device, poison_empty):
    dtype = main_dtype("triton")
    inputs = case.make(dtype, device)
    out, lse, grads = run_attention(case, inputs, "triton")
    _check_against_reference(case, inputs, out, lse, grads, dtype)


# Cases whose chunking matters: a row-broadcast bias sums over chunks, dropout masks are built per chunk.
CHUNK_CASES = [
    AttnCase(True, (3, 17, 1, 0), (17, 0, 5, 9), 4, 2, 16, 16, causal=True, bias="11Q1", dropout_p=0.3,
             grad_lse=True),
    AttnCase(False, (19, 19), (6, 6), 8, 2, 16, 8, align="bottom_right", window=(2, 1), bias="BHQK",
             alibi="BH", softcap=3.0),
]


@pytest.mark.parametrize("rows_per_chunk", [1, 5])
@pytest.mark.parametrize("case", CHUNK_CASES, ids=lambda c: c.id)
def test_torch_backend_chunks(case, rows_per_chunk, device, monkeypatch):
    """Several query chunks (the test shapes fit one by default) give the reference's results."""
    budget = rows_per_chunk * case.batch * case.heads * max(case.kv_lens)
    monkeypatch.setattr(torch_backend, "SCORE_BLOCK_ELEMENTS", budget)
    inputs = case.make(torch.float64, device)
    out, lse, grads = run_attention(case, inputs, "torch")
    _check_against_reference(case, inputs, out, lse, grads, torch.float64)


# Rows with no visible key: an empty k sequence, bottom-right with Lq > Lk, a bool bias, a window.
EMPTY_ROW_CASES = [
    AttnCase(True, (3, 17, 1, 0), (17, 0, 5, 9), 4, 2, 16, 16, grad_lse=True),
    AttnCase(False, (19, 19), (6, 6), 4, 1, 16, 16, causal=True, align="bottom_right", grad_lse=True),
    AttnCase(False, (17,), None, 2, 2, 16, 16, bias="bool"),
    # (more queries than keys: a hidden row past the last key still sees none; the fused CPU path's check)
    AttnCase(False, (9,), (4,), 2, 2, 16, 16, causal=True, bias="bool"),
    AttnCase(True, (0, 1, 17, 9), (4, 0, 3, 9), 2, 2, 16, 16, window=(1, 1), align="bottom_right",
             dropout_p=0.5),
]


@pytest.mark.parametrize("backend,case", backend_params(EMPTY_ROW_CASES))
def test_rows_without_keys(backend, case, device):
    """A query that sees no key: output exactly 0, lse -inf, exactly zero gradient, no NaN anywhere."""
    inputs = case.make(main_dtype(backend), device)
    out, lse, grads = run_attention(case, inputs, backend)
    _, ref_lse, _ = run_reference(case, inputs)
    # (rows, H) or (B, Sq, H): True where the query sees no key
    empty = (ref_lse == float("-inf")).t() if case.jagged else (ref_lse == float("-inf")).permute(0, 2, 1)
    assert empty.any() and not empty.all()
    assert torch.equal(lse == float("-inf"), ref_lse == float("-inf"))
    assert torch.equal(_values(out)[empty], torch.zeros_like(_values(out)[empty]))
    assert torch.equal(grads[0][empty], torch.zeros_like(grads[0][empty]))
    for grad in grads:
        assert torch.isfinite(grad).all()
    assert torch.isfinite(_values(out)).all()


LAYOUT_CASES = [AttnCase(False, (7, 7), None, 4, 2, 16, 16, causal=True),
                AttnCase(True, (5, 0, 9), None, 4, 2, 16, 16, causal=True)]


@pytest.mark.parametrize("backend,case", backend_params(LAYOUT_CASES))
def test_return_lse_layouts(backend, case, device):
    inputs = case.make(main_dtype(backend), device)
    out = varlen.attention(inputs.q, inputs.k, inputs.v, causal=True, backend=backend)
    out2, lse = varlen.attention(inputs.q, inputs.k, inputs.v, causal=True, return_lse=True, backend=backend)
    assert type(out) is type(inputs.q)
    assert torch.equal(_values(out), _values(out2))
    if case.jagged:
        assert out.offsets is inputs.q.offsets and out.max_len == inputs.q.max_len
        assert _values(out).shape == (14, 4, 16) and lse.shape == (4, 14)
    else:
        assert out.shape == (2, 7, 4, 16) and lse.shape == (2, 4, 7)
    assert lse.dtype == accumulate_dtype(main_dtype(backend))


@pytest.mark.parametrize("backend,case", backend_params(LAYOUT_CASES + [AttnCase(False, (7, 7), None, 4, 2, 16, 16)]))
def test_head_dims_of_any_stride(backend, case, device):
    """q, k and v whose head dim is not contiguous (every other column of a wider tensor; a transposed one) give what
    contiguous copies give: the fused CPU kernel, which the dense calls here reach on the CPU, read such views wrong
    and past their end."""
    dtype = main_dtype(backend)
    inputs = case.make(dtype, device)
    contiguous = [_values(x).detach() for x in (inputs.q, inputs.k, inputs.v)]
    every_other = [torch.stack([t, torch.full_like(t, float("nan"))], dim=-1).flatten(-2)[..., ::2]
                   for t in contiguous]
    transposed = [t.transpose(-1, -2).contiguous().transpose(-1, -2) for t in contiguous]
    expected = varlen.attention(inputs.q, inputs.k, inputs.v, causal=case.causal, backend=backend)
    for views in (every_other, transposed):
        assert all(t.stride(-1) != 1 for t in views)
        q, k, v = ((x.with_values(t) if case.jagged else t) for x, t in zip((inputs.q, inputs.k, inputs.v), views,
                                                                             strict=True))
        out = varlen.attention(q, k, v, causal=case.causal, backend=backend)
        assert torch.equal(_values(out), _values(expected))


@pytest.mark.parametrize("backend,case", backend_params([AttnCase(True, (3, 17, 1, 0), (17, 0, 5, 9), 4, 2, 16, 16)]))
def test_torch_nested_inputs(backend, case, device):
    """``torch.nested`` jagged tensors are taken as views and give what the JaggedTensors give."""
    inputs = case.make(main_dtype(backend), device)
    q, k, v = (x.detach() for x in (inputs.q, inputs.k, inputs.v))
    out = varlen.attention(q, k, v, causal=True, backend=backend)
    nested = varlen.attention(q.to_nested(), k.to_nested(), v.to_nested(), causal=True, backend=backend)
    assert isinstance(nested, varlen.JaggedTensor)
    assert torch.equal(nested.values, out.values)


@pytest.mark.parametrize("backend,case", backend_params([
    AttnCase(True, (3, 17, 1, 0), (17, 0, 5, 9), 4, 2, 16, 16, causal=True, bias="B11K")]))
def test_gradient_through_lse_alone(backend, case, device):
    """A loss of the lse only (the output unused: its gradient arrives as None)."""
    dtype = main_dtype(backend)
    inputs = case.make(dtype, device)
    _, lse = varlen.attention(inputs.q, inputs.k, inputs.v, causal=True, bias=inputs.bias, return_lse=True,
                              backend=backend)
    grads = torch.autograd.grad(torch.where(torch.isfinite(lse), lse, 0).sum(), inputs.leaves)
    up = [t.detach().double().requires_grad_(True) for t in inputs.leaves]
    q, k, v = (x.with_values(u) for x, u in zip((inputs.q, inputs.k, inputs.v), up[:3], strict=True))
    _, ref_lse = attention_reference(q, k, v, causal=True, bias=up[3])
    ref_grads = torch.autograd.grad(torch.where(torch.isfinite(ref_lse), ref_lse, 0).sum(), up,
                                    allow_unused=True, materialize_grads=True)
    for name, grad, ref in zip(GRAD_NAMES, grads, ref_grads, strict=True):
        assert_close(grad, ref, dtype, name=name)
    assert torch.equal(grads[2], torch.zeros_like(grads[2]))  # v doesn't affect the lse


@pytest.mark.parametrize("backend,case", backend_params([
    AttnCase(False, (17,), (23,), 4, 2, 32, 32, causal=True, align="bottom_right", bias="1HQK",
             deterministic=True),
    AttnCase(True, (3, 17, 1, 0), (17, 0, 5, 9), 8, 2, 32, 32, window=(3, 2), bias="BHQK", dropout_p=0.2,
             deterministic=True, grad_lse=True),
]))
def test_deterministic_is_bitwise_reproducible(backend, case, device):
    runs = []
    for _ in range(2):
        inputs = case.make(main_dtype(backend), device)  # same values, same generator seed
        runs.append(run_attention(case, inputs, backend))
    (out_a, lse_a, grads_a), (out_b, lse_b, grads_b) = runs
    assert torch.equal(_values(out_a), _values(out_b)) and torch.equal(lse_a, lse_b)
    for name, a, b in zip(GRAD_NAMES[:len(grads_a)], grads_a, grads_b, strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("backend,case", backend_params([AttnCase(False, (5, 5), None, 2, 2, 16, 16, bias="QK")]))
def test_bias_gradient_has_the_bias_dtype(backend, case, device):
    """A bias of another dtype than q, k, v gets a gradient of its own dtype and broadcast shape."""
    dtype = main_dtype(backend)
    bias_dtype = torch.float32 if dtype != torch.float32 else torch.float64
    inputs = case.make(dtype, device)
    bias = inputs.bias.to(bias_dtype).requires_grad_(True)
    out = varlen.attention(inputs.q, inputs.k, inputs.v, bias=bias, backend=backend)
    (dbias,) = torch.autograd.grad((out * inputs.dout).sum(), bias)
    assert dbias.dtype == bias_dtype and dbias.shape == (5, 5)
    ref = attention_reference(inputs.q.double(), inputs.k.double(), inputs.v.double(), bias=bias.double())[0]
    (ref_dbias,) = torch.autograd.grad((ref * inputs.dout.double()).sum(), bias)
    assert_close(dbias, ref_dbias, dtype, name="dbias")


# ------------------------------------------------------------------------------------- gradcheck
GRADCHECK_CASES = [
    # The fused CPU kernel's cases (see cpu_fused.unsupported_reasons): jagged cross-attention with an
    # empty sequence and one without keys, jagged causal self-attention, dense causal with a key mask.
    AttnCase(True, (3, 0, 4, 1), (2, 4, 5, 0), 4, 2, 4, 4),
    AttnCase(True, (4, 2, 5), None, 2, 2, 4, 4, causal=True),
    AttnCase(False, (4, 4), (6, 6), 2, 1, 4, 4, causal=True, bias="B11K"),
    # The chunked path's.
    AttnCase(False, (4, 4), (5, 5), 2, 1, 4, 3, causal=True, align="bottom_right", bias="1HQK"),
    AttnCase(True, (4, 6), None, 2, 2, 4, 4, causal=True, prefix=3),
    AttnCase(True, (3, 5), (7, 6), 2, 1, 4, 4, causal=True, window=(2, None), dropout_p=0.3, query_offset=2),
    AttnCase(False, (7,), None, 2, 1, 4, 4, causal=True, documents=True, bias="1HQK"),
    AttnCase(True, (3, 0, 4), (2, 4, 5), 2, 2, 4, 4, window=(1, 1), softcap=2.0, bias="BHQK"),
    AttnCase(False, (3,), (5,), 4, 2, 4, 4, window=(None, 1), alibi="BH", bias="11Q1"),
    AttnCase(True, (4, 2), None, 2, 1, 4, 4, causal=True, bias="B11K", dropout_p=0.3),
]


@pytest.mark.parametrize("case", GRADCHECK_CASES, ids=lambda c: c.id)
def test_torch_backend_gradcheck(case, device):
    """Finite differences in float64 for q, k, v and bias, through the output and the lse."""
    inputs = case.make(torch.float64, device)
    leaves = [t.detach().nan_to_num(0.0).requires_grad_(True) for t in inputs.leaves]

    def attention(*tensors):
        if case.jagged:
            q, k, v = (x.with_values(t) for x, t in zip((inputs.q, inputs.k, inputs.v), tensors[:3], strict=True))
        else:
            q, k, v = tensors[:3]
        # a fresh generator with one seed per evaluation: the dropout mask is the same every time
        generator = torch.Generator(device=device).manual_seed(7) if case.dropout_p else None
        out, lse = varlen.attention(q, k, v, **case.options(), bias=tensors[3] if case.bias else None,
                                    alibi_slopes=inputs.alibi_slopes, dropout_p=case.dropout_p, generator=generator,
                                    prefix_len=inputs.prefix_len, document_ids=inputs.document_ids,
                                    query_offset=inputs.query_offset, return_lse=True, backend="torch")
        return _values(out), lse.nan_to_num(neginf=0.0)

    assert torch.autograd.gradcheck(attention, leaves, atol=1e-8, rtol=1e-6)


# Jagged calls of the chunked path with the per-sequence things that must follow a sequence into its bucket.
BUCKET_CASES = [
    AttnCase(True, (1, 17, 0, 5, 30, 2), (3, 17, 4, 0, 30, 9), 4, 2, 8, 8, align="bottom_right", alibi="BH",
             softcap=3.0, dropout_p=0.3, grad_lse=True),
    AttnCase(True, (6, 1, 17, 3), None, 2, 1, 8, 8, causal=True, window=(4, None), prefix=2, dropout_p=0.2),
    AttnCase(True, (3, 5, 9), (7, 6, 12), 2, 2, 8, 8, causal=True, query_offset=2, dropout_p=0.3),
    # Biases with gradients: each sequence's planes, or one plane summed over the buckets.
    AttnCase(True, (4, 0, 9, 2), (5, 3, 9, 1), 2, 1, 8, 8, bias="BHQK", dropout_p=0.2, grad_lse=True),
    AttnCase(True, (4, 1, 9, 2), None, 2, 2, 8, 8, causal=True, bias="1HQK", softcap=2.0),
    AttnCase(True, (6, 2, 11), (3, 8, 4), 2, 2, 8, 8, bias="B11K", alibi="H"),
]


@pytest.mark.parametrize("case", BUCKET_CASES, ids=lambda c: c.id)
def test_cpu_chunked_path_by_length_buckets(case, monkeypatch):
    """On the CPU the chunked path runs a jagged call by length buckets, each padded only to its own longest
    lengths; each sequence keeps its dropout mask, ALiBi slopes, prefix, query offset and bias planes (a bias's
    gradient gathered back, or summed over the buckets where it is broadcast over the batch). With every sequence
    in a bucket of its own: the float64 reference's outputs and gradients."""
    monkeypatch.setattr(torch_backend, "BUCKET_COST", 0.0)
    parts = record_calls(monkeypatch, torch_backend, "_parts")
    inputs = case.make(torch.float64, "cpu")
    out, lse, grads = run_attention(case, inputs, "torch")
    assert [len(p) for p in parts] == [sum(n > 0 for n in case.q_lens)] * 2  # (forward, backward)
    ref_out, ref_lse, ref_grads = run_reference(case, inputs)
    assert_close(_values(out), _values(ref_out), torch.float64, name="out")
    assert_close(lse, ref_lse, torch.float64, name="lse")
    for name, got, want in zip(("dq", "dk", "dv", "dbias")[:len(grads)], grads, ref_grads, strict=True):
        assert_close(got, want, torch.float64, name=name)


# The fused CPU kernel's jagged cases with rows its buckets don't write: a sequence without keys (its output rows stay
# 0), one without queries (its dk and dv rows stay 0), an empty one; and one whose buckets write every row.
CPU_FUSED_POISON_CASES = [
    AttnCase(True, (3, 0, 4, 1, 17), (2, 4, 5, 0, 9), 4, 2, 16, 16),
    AttnCase(True, (17, 0, 1, 40), None, 4, 2, 40, 40, causal=True),
    AttnCase(True, (5, 9, 2), None, 2, 1, 8, 8),
]


@pytest.mark.parametrize("case", CPU_FUSED_POISON_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_fused_path_reads_no_unwritten_memory(case, dtype, monkeypatch, poison_empty):
    """The fused CPU path's results start uninitialized where its buckets write every row, else zeroed: with every
    allocation poisoned with NaN (conftest.poison_empty), outputs, lse and gradients still match the float64
    reference, so each row is written (or zeroed) before it is read. The calls take the fused path."""
    forwards = record_calls(monkeypatch, cpu_fused, "forward")
    inputs = case.make(dtype, torch.device("cpu"))
    out, lse, grads = run_attention(case, inputs, "torch")
    assert len(forwards) == 1
    _check_against_reference(case, inputs, out, lse, grads, dtype)


def test_cpu_fused_plan_writes_every_row_only_where_sequences_tile_the_rows():
    """Results start uninitialized only where the taken sequences lie end to end over every row: a sequence left out
    (no keys, or no queries), a row before the first sequence or after the last, or offsets changed in place after
    their check so that rows of two sequences and rows of none add up to the row count, all keep zeroed results."""
    t = torch.tensor
    every = cpu_fused._writes_every_row
    taken = t([True, True, True])
    assert every(t([0, 2, 5]), t([2, 3, 3]), taken, 8)
    assert every(t([0, 2, 2]), t([2, 0, 6]), t([True, False, True]), 8)  # an empty sequence, not taken
    assert not every(t([0, 2, 5]), t([2, 3, 3]), t([True, False, True]), 8)  # a sequence with rows left out
    assert not every(t([1, 2, 5]), t([1, 3, 3]), taken, 8)  # a row before the first sequence
    assert not every(t([0, 2, 5]), t([2, 3, 2]), taken, 8)  # a row after the last
    assert not every(t([0, 4, 2]), t([4, 0, 4]), t([True, False, True]), 8)  # rows 2-3 twice, 6-7 never


def test_cpu_buckets_are_cut_once_per_offsets(monkeypatch):
    """The chunked path cuts its buckets once per offsets tensors (a model's layers, and each call's backward, reuse
    them) and keeps no call's options with them: two calls on the same offsets with other ALiBi slopes and query
    offsets each give the float64 reference's outputs and gradients; other offsets are cut anew."""
    monkeypatch.setattr(torch_backend, "BUCKET_COST", 0.0)  # (a bucket per sequence)
    cuts = record_calls(monkeypatch, torch_backend, "_cut_buckets")
    torch.manual_seed(0)
    q = varlen.jagged([torch.randn(n, 4, 8, dtype=torch.float64) for n in (3, 9, 1, 6)])
    k, v = (q.with_values(torch.randn_like(q.values)) for _ in range(2))
    for slopes, offset in ((torch.rand(4, 4, dtype=torch.float64), 0), (torch.rand(4, dtype=torch.float64), 5)):
        leaves = [x.values.detach().requires_grad_() for x in (q, k, v)]
        qj, kj, vj = (x.with_values(t) for x, t in zip((q, k, v), leaves, strict=True))
        options = dict(causal=True, alibi_slopes=slopes, softcap=2.0, query_offset=torch.full((4,), offset))
        out = varlen.attention(qj, kj, vj, backend="torch", **options)
        grads = torch.autograd.grad(out.values.square().sum(), leaves)
        ref, _ = attention_reference(qj, kj, vj, **options)
        ref_grads = torch.autograd.grad(ref.values.square().sum(), leaves)
        assert_close(out.values, ref.values, torch.float64, name="out")
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True):
            assert_close(got, want, torch.float64, name=name)
    assert len(cuts) == 1 and len(cuts[0]) == 4
    other = varlen.jagged([torch.randn(n, 4, 8, dtype=torch.float64) for n in (2, 5)])
    varlen.attention(other, other, other, softcap=2.0, backend="torch")
    assert len(cuts) == 2


FLOAT32_GPU_CASES = [
    AttnCase(False, (300, 300), None, 4, 2, 64, 64, causal=True),
    AttnCase(True, (1000, 17, 0, 1, 513), None, 4, 4, 128, 128),
    AttnCase(True, (200, 31), (150, 400), 6, 2, 40, 40, causal=True, align="bottom_right", bias="1HQK"),
    AttnCase(False, (257,), None, 2, 1, 96, 96, window=(64, 8), dropout_p=0.2),
    # The bf16 parts (configs.splits_bf16) of strided inputs, Dv != D, the separate dQ kernel
    # (deterministic), and the score modifiers with an lse gradient.
    AttnCase(True, (65, 0, 300), (129, 7, 300), 4, 2, 64, 128, causal=True, align="bottom_right",
             deterministic=True, strided=True),
    AttnCase(False, (200,), None, 4, 4, 128, 128, strided=True, softcap=30.0, alibi="H", grad_lse=True),
    # Head dims that are no multiple of 8: their parts padded to one (parts.part_width).
    AttnCase(True, (77, 0, 130), None, 4, 2, 36, 36, causal=True),
    AttnCase(False, (150,), None, 2, 2, 100, 100),
    # Long sequences: dK and dV summed over 2048 queries (flash-attn's rule at float32 accuracy).
    AttnCase(False, (2048,), None, 2, 1, 64, 64, causal=True),
    AttnCase(True, (1500, 2048, 3), None, 2, 2, 128, 128),
    # Beyond the parts (head dims above 128): Triton's three-pass TF32 dots.
    AttnCase(False, (130,), None, 2, 1, 256, 256, causal=True),
]


@pytest.mark.gpu_only
@pytest.mark.parametrize("precision,tol", [("ieee", None), ("tf32", 3e-3)])
@pytest.mark.parametrize("case", FLOAT32_GPU_CASES, ids=lambda c: c.id)
def test_triton_float32_follows_torch_precision(case, precision, tol, device, monkeypatch):
    """float32 on the GPU: float32 accuracy by default, TF32's when torch allows TF32. Where the products come
    from bf16 parts (TMA, i.e. Hopper, and head dims up to 128: the forward and the backward's kv kernel; the
    deterministic mode's dQ kernel keeps Triton's three-pass TF32 dots), flash-attn's rule: each output's error at
    most twice that of the same math in PyTorch's float32, plus 2**-24 (running sums left in the tensor cores'
    accumulators, which truncate, broke it by 15-30x on long sequences). Elsewhere Triton's three-pass TF32 dots,
    held to their earlier bound, 2e-5 (at D256 they break the rule: the strict xfail below)."""
    splits = [record_calls(monkeypatch, module, "split_bf16") for module in (triton_forward, triton_backward)]
    names, got, ref, in_torch = _float32_run(case, precision, device, with_torch=tol is None)
    # (every case's rows are 16-byte aligned, as TMA needs)
    split = precision == "ieee" and max(case.head_dim, case.head_dim_v) <= 128 and configs.has_tma(device)
    assert [len(calls) for calls in splits] == [int(split)] * 2, "the bf16 parts ran where they should not, or not"
    if split:
        beyond = _beyond_the_rule(names, got, ref, in_torch)
        assert not beyond, "; ".join(beyond)
    else:
        for name, out, expected in zip(names, got, ref, strict=True):
            assert_close(out, expected, tol=tol or 2e-5, name=name)


class _BeyondTheRule(AssertionError):
    """Outputs of a float32 call whose error breaks flash-attn's rule (what the strict xfail below expects)."""


@pytest.mark.gpu_only
@pytest.mark.skipif(not (ON_GPU and torch.cuda.get_device_capability()[0] >= 9), reason="measured on Hopper")
@pytest.mark.xfail(strict=True, raises=_BeyondTheRule, reason=(
    "above head dim 128 (the bf16 parts overflow shared memory) Triton's three-pass TF32 dots take float32 at full "
    "accuracy: they drop the low parts' product and round the parts to TF32; dQ's error at D256 read 2.2x PyTorch's "
    "float32 (1.21e-6 vs 5.4e-7, H100)"))
def test_triton_float32_d256_within_twice_torch(device):
    """Flash-attn's rule for float32 at full accuracy at D256 (FLOAT32_GPU_CASES' last case)."""
    with_parts_or_not = _float32_run(FLOAT32_GPU_CASES[-1], "ieee", device, with_torch=True)
    beyond = _beyond_the_rule(*with_parts_or_not)
    if beyond:
        raise _BeyondTheRule("; ".join(beyond))


def _float32_run(case, precision, device, with_torch):
    """Output names, then the outputs (:func:`_flat`) of the Triton backend at torch's ``precision``, of the float64
    reference, and (``with_torch``) of the reference in PyTorch's float32 at that precision."""
    with float32_matmul_precision(precision):
        inputs = case.make(torch.float32, device)
        got = _flat(run_attention(case, inputs, "triton"))
        in_torch = _flat(run_reference(case, inputs, torch.float32)) if with_torch else None
    ref = _flat(run_reference(case, inputs))
    return ("out", "lse", *GRAD_NAMES[:len(ref) - 2]), got, ref, in_torch


def _beyond_the_rule(names, got, ref, in_torch) -> list[str]:
    """The outputs whose relative error exceeds twice PyTorch float32's plus 2**-24 (flash-attn's rule)."""
    beyond = []
    for name, out, expected, torch_out in zip(names, got, ref, in_torch, strict=True):
        err, allowed = rel_err(out, expected), 2 * rel_err(torch_out, expected) + 2.0**-24
        if err > allowed:
            beyond.append(f"{name}: relative error {err:.3g} > {allowed:.3g} (2x PyTorch's float32)")
    return beyond


def _flat(run) -> list:
    """``(out, lse, grads)`` as one list: out's values, lse, each gradient."""
    out, lse, grads = run
    return [_values(out), lse, *grads]


@pytest.mark.parametrize("layout", ["dense_strided", "jagged"])
@pytest.mark.parametrize("head_dims", [(96, 96), (36, 20), (64, 20)], ids=["D96", "D36_Dv20", "D64_Dv20"])
def test_bf16_split_is_exact(layout, head_dims, device):
    """The float32 split (configs.splits_bf16), one launch for Q, K, V and dO: three bf16 parts each,
    each the nearest bf16 to what the ones before it leave of x, so the parts hold x's 24 bits in three 8-bit
    pieces and add up to x exactly; the first two in one row part_width(D) columns apart (head dims padded to a
    multiple of 8: every part on a 16-byte boundary), the third apart; or K's and V's first two in given float32
    buffers (the backward's dK and dV) where they fit. Q and K differ in rows and heads. Triton's interpreter
    truncates float32 to bf16 whatever rounding is asked for (which is also why the split never runs there): its
    parts still add up to x, but only the GPU's are the nearest."""
    D, Dv = head_dims
    g = torch.Generator().manual_seed(0)
    # 40 decades (not to the ends of float32's range: a third part below 2**-126 would lose bits as a subnormal)

    def operand(rows, heads, cols):
        x = torch.randn(2, rows, heads, cols, generator=g) * torch.logspace(-20, 20, rows * heads * cols).view(
            rows, heads, cols)
        x[0, 0, 0, :4] = torch.tensor([0.0, -0.0, 1.0, -3.0])
        if layout == "jagged":  # (T, H, D) values
            return x[0].to(KERNEL_DEVICE)
        return torch.cat([torch.zeros_like(x), x], dim=-1).to(KERNEL_DEVICE)[..., cols:]

    q, dout, k, v = operand(5, 3, D), operand(5, 3, Dv), operand(39, 1, D), operand(39, 1, Dv)
    parts = split_bf16(q, k, v, dout)
    for x, (first, last) in zip((q, k, v, dout), parts, strict=True):
        cols = x.shape[-1]
        width = part_width(cols)
        assert width % 8 == 0 and cols <= width < cols + 8
        assert first.dtype == last.dtype == torch.bfloat16 and first.shape == (*x.shape[:-1], 2 * width)
        assert last.shape == x.shape
        assert first.data_ptr() % 16 == 0 and last.data_ptr() % 16 == 0 and first.stride(-2) * 2 % 16 == 0
        x0, x1 = first.unflatten(-1, (2, width))[..., :cols].unbind(-2)
        x2 = last
        assert torch.equal(x0.double() + x1.double() + x2.double(), x.double())
        if device.type == "cuda":
            assert torch.equal(x0, x.to(torch.bfloat16))
            assert torch.equal(x1, (x - x0.float()).to(torch.bfloat16))
            assert (x2.double().abs() <= x1.double().abs() * 2.0**-8).all()
    dk, dv = torch.empty(k.shape, device=KERNEL_DEVICE), torch.empty(v.shape, device=KERNEL_DEVICE)
    in_buffers = split_bf16(q, k, v, dout, dk, dv)
    for (first, last), (expected_first, expected_last), buffer in zip(in_buffers[1:3], parts[1:3], (dk, dv),
                                                                      strict=True):
        cols = buffer.shape[-1]
        width = part_width(cols)
        assert (first.data_ptr() == buffer.data_ptr()) == (width == cols)
        assert torch.equal(first.unflatten(-1, (2, width))[..., :cols],
                           expected_first.unflatten(-1, (2, width))[..., :cols])
        assert torch.equal(last, expected_last)


@triton.jit
def _tanh_kernel(x_ptr, y_ptr, N: tl.constexpr, EXACT: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(y_ptr + i, triton_scores.tanh(tl.load(x_ptr + i), EXACT))


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "fast"])
def test_softcap_tanh(exact, device):
    """The kernels' tanh (softcaps; no tanh in Triton's interpreter) against float64, across the exact form's two
    branches (|x| below and above 0.625), tiny, huge and infinite inputs: the exact form (float32 at full
    accuracy) within 2 float32 epsilons (2 * 2**-23) of relative error everywhere; the fast one (16-bit inputs,
    TF32) within 3 for |x| >= 0.625 and 2**-22 of absolute error near 0."""
    x = torch.cat([torch.linspace(-20, 20, 4096), torch.linspace(-1, 1, 4088), torch.logspace(-30, 1, 8192),
                   torch.tensor([0.0, -0.0, 1e-38, -1e-8, 0.6249999, 0.625, float("inf"), -float("inf")])])
    y = torch.empty_like(x, device=KERNEL_DEVICE)
    _tanh_kernel[(1,)](x.to(KERNEL_DEVICE), y, N=x.numel(), EXACT=exact)
    ref = torch.tanh(x.double())
    err = (y.cpu().double() - ref).abs()
    relative = (err / (torch.finfo(torch.float32).eps * ref.abs())).nan_to_num(0.0)  # in epsilons
    assert torch.equal(y.cpu()[-2:], torch.tensor([1.0, -1.0]))
    if exact:
        assert relative.max() <= 2.0
    else:
        assert relative[x.abs() >= 0.625].max() <= 3.0 and err.max() <= 2.0**-22


# --------------------------------------------------------------------------- the reference itself
def _visible_by_loops(Lq, Lk, causal, window, align):
    """The visibility rule of the API docstring, written out element by element."""
    shift = Lk - Lq if align == "bottom_right" else 0
    left, right = window if window is not None else (None, None)
    rows = []
    for i in range(Lq):
        row = []
        for j in range(Lk):
            ok = (not causal or j <= i + shift)
            ok = ok and (left is None or i + shift - left <= j)
            ok = ok and (right is None or j <= i + shift + right)
            row.append(ok)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.bool).view(Lq, Lk)


@pytest.mark.parametrize("causal,window,align", [
    (False, None, "top_left"), (True, None, "top_left"), (True, None, "bottom_right"),
    (False, (2, 3), "top_left"), (True, (4, None), "bottom_right"), (False, (None, 0), "bottom_right"),
])
def test_reference_matches_sdpa(causal, window, align, device):
    """The reference against PyTorch's SDPA, with the mask, bias and alibi built independently."""
    B, Lq, Lk, H, Hkv, D, Dv = 2, 6, 9, 4, 2, 8, 5
    q = torch.randn(B, Lq, H, D, dtype=torch.float64, device=device)
    k = torch.randn(B, Lk, Hkv, D, dtype=torch.float64, device=device)
    v = torch.randn(B, Lk, Hkv, Dv, dtype=torch.float64, device=device)
    bias = torch.randn(1, H, Lq, Lk, dtype=torch.float64, device=device)
    slopes = torch.rand(H, dtype=torch.float64, device=device)
    visible = _visible_by_loops(Lq, Lk, causal, window, align).to(device)
    shift = Lk - Lq if align == "bottom_right" else 0
    distance = torch.tensor([[abs(i + shift - j) for j in range(Lk)] for i in range(Lq)], device=device)
    mask = (bias - slopes.view(H, 1, 1) * distance).masked_fill(~visible, float("-inf"))
    out, lse = attention_reference(q, k, v, causal=causal, window=window, align=align, scale=0.4, bias=bias,
                                   alibi_slopes=slopes)
    expected = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              attn_mask=mask, scale=0.4, enable_gqa=True).transpose(1, 2)
    seen = visible.any(dim=1)  # SDPA gives NaN for rows that see nothing
    assert_close(out[:, seen], expected[:, seen], torch.float64, name="out")
    assert torch.equal(out[:, ~seen], torch.zeros_like(out[:, ~seen]))
    scores = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(H // Hkv, dim=2)) * 0.4 + mask
    assert_close(lse, torch.logsumexp(scores, dim=-1), torch.float64, name="lse")


def test_reference_docstring_example():
    failures, _ = doctest.testmod(reference, extraglobs={"torch": torch})
    assert failures == 0


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("jagged", [False, True], ids=["dense", "jagged"])
@pytest.mark.parametrize("where", ["q", "k"])
def test_nan_inputs_give_the_references_nan(backend, jagged, where, device):
    """A NaN in a query or a key gives NaN outputs where the reference does (and the lse -inf there), on every path:
    the fused CPU kernel, which plain CPU calls reach, gave such queries the output 0 and the lse 0."""
    case = AttnCase(jagged, (6, 6) if not jagged else (5, 0, 7), None, 4, 2, 16, 16, causal=True)
    dtype = main_dtype(backend)
    inputs = case.make(dtype, device)
    leaves = [t.detach().clone() for t in inputs.leaves[:3]]
    rows = leaves["qk".index(where)]
    rows.view(-1, *rows.shape[-2:])[3, 1, 2] = float("nan")  # (row 3: a query that sees keys 0-3)
    q, k, v = ((x.with_values(t) if jagged else t) for x, t in zip((inputs.q, inputs.k, inputs.v), leaves,
                                                                     strict=True))
    out, lse = varlen.attention(q, k, v, causal=True, return_lse=True, backend=backend)
    ref_out, ref_lse = attention_reference(*(x.with_values(t.double()) if jagged else t.double()
                                             for x, t in zip((q, k, v), leaves, strict=True)), causal=True)
    assert torch.equal(torch.isnan(_values(out)), torch.isnan(_values(ref_out)))
    assert torch.isnan(_values(out)).any()
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse)) and torch.equal(lse == float("-inf"),
                                                                                ref_lse == float("-inf"))


@pytest.mark.parametrize("dtypes", [(torch.float16, torch.float32), (torch.float32, torch.float64)])
def test_reference_takes_a_bias_of_another_dtype(dtypes, device):
    """varlen.attention takes a float bias of another dtype than q's; the reference computes in the inputs' dtype with
    it too (its scores took the bias's dtype, and the product with v raised), and the bias's gradient comes back in
    the bias's dtype."""
    dtype, bias_dtype = dtypes
    q, k, v = (torch.randn(2, 5, 4, 8, device=device, dtype=dtype) for _ in range(3))
    bias = torch.randn(1, 4, 5, 1, device=device, dtype=bias_dtype, requires_grad=True)
    out, lse = attention_reference(q, k, v, bias=bias, causal=True)
    same, _ = attention_reference(q, k, v, bias=bias.detach().to(dtype), causal=True)
    assert out.dtype == dtype and torch.equal(out, same)
    (grad,) = torch.autograd.grad(out.float().sum() + lse.float().sum(), bias)
    assert grad.dtype == bias_dtype and torch.isfinite(grad).all()


def test_reference_takes_an_empty_dense_batch(device):
    """B = 0 gives empty results of varlen.attention's shapes (torch.stack of no sequence raised)."""
    q, k, v = (torch.randn(0, 5, 4, 8, device=device), torch.randn(0, 6, 2, 8, device=device),
               torch.randn(0, 6, 2, 3, device=device))
    out, lse = attention_reference(q, k, v, causal=True)
    expected_out, expected_lse = varlen.attention(q, k, v, causal=True, return_lse=True)
    assert out.shape == expected_out.shape == (0, 5, 4, 3) and lse.shape == expected_lse.shape == (0, 4, 5)


def test_float64_alibi_slopes_are_not_rounded(device):
    """Slopes that float32 can't hold (random float64) reach the float64 scores unrounded."""
    q, k, v = (torch.randn(2, 40, 3, 8, dtype=torch.float64, device=device) for _ in range(3))
    slopes = torch.rand(3, dtype=torch.float64, device=device) * 4
    assert not torch.equal(slopes.float().double(), slopes)
    out = varlen.attention(q, k, v, causal=True, alibi_slopes=slopes, backend="torch")
    ref, _ = attention_reference(q, k, v, causal=True, alibi_slopes=slopes)
    assert_close(out, ref, torch.float64)


@pytest.mark.parametrize("backend,dtype", [
    ("torch", torch.float16), ("torch", torch.bfloat16), ("triton", torch.float16),
    pytest.param("triton", torch.bfloat16, marks=pytest.mark.gpu_only)])
@pytest.mark.parametrize("jagged", [False, True], ids=["dense", "jagged"])
def test_half_lse_accuracy(backend, dtype, jagged, device):
    """The lse of half-precision inputs, short rows included, is within 2x the error of float32 math on
    the same inputs (flash-attn's rule; the float32 lse can't be more accurate than its scores), the largest
    error over many rows, plus the float32 lse's own resolution (1 ulp of its largest value)."""
    lengths = [1, 2, 17, 40] * 16
    parts = [torch.randn(n, 4, 64, device=device).mul(3).to(dtype) for n in lengths]
    if jagged:
        q = varlen.jagged(parts)
        qd = [p.double() for p in parts]
    else:
        q = torch.stack([p[:1] for p in parts])  # 64 one-row sequences
        qd = [p[:1].double() for p in parts]
    _, lse = varlen.attention(q, q, q, return_lse=True, backend=backend)
    ref = torch.cat([torch.logsumexp(torch.einsum("ihd,jhd->hij", p, p) * 0.125, -1) for p in qd], dim=-1)
    f32 = torch.cat([torch.logsumexp(torch.einsum("ihd,jhd->hij", p.float(), p.float()) * 0.125, -1) for p in qd],
                    dim=-1)
    lse = lse if jagged else lse.permute(1, 0, 2).reshape(4, -1)
    ulp = torch.finfo(torch.float32).eps * ref.abs().max().item()
    err, allowed = (lse.double() - ref).abs().max().item(), 2 * (f32.double() - ref).abs().max().item() + ulp
    assert err <= allowed, f"lse error {err:.3g} > {allowed:.3g}"


def test_jagged_programs_take_the_longest_sequences_first():
    # Work Lq x Lk: 15, 0, 0, 21, 9 (cross) and Lq^2: 9, 0, 289, 1, 81 (self); ties keep their order.
    cu_q = torch.tensor([0, 3, 3, 20, 21, 30], dtype=torch.int32, device=KERNEL_DEVICE)
    cu_k = torch.tensor([0, 5, 9, 9, 30, 31], dtype=torch.int32, device=KERNEL_DEVICE)
    shape = dict(batch=5, heads=2, kv_heads=1, head_dim=16, head_dim_v=16, max_q=17, max_k=21)
    cross = Problem(**shape, dense=False, cu_q=cu_q, cu_k=cu_k)
    assert longest_first(cross, None).tolist() == [3, 0, 4, 1, 2]
    self_attention = Problem(**shape, dense=False, cu_q=cu_q, cu_k=cu_q)
    assert longest_first(self_attention, None).tolist() == [2, 4, 0, 3, 1]
    placeholder = torch.empty(1)
    assert longest_first(Problem(**shape, dense=True), placeholder) is placeholder


# The masks of the key-block order tests: causal ones (first blocks heaviest) and ones whose blocks are alike.
KEY_BLOCK_MASKS = {"causal": dict(causal=True), "causal_bottom_right": dict(causal=True, bottom_right=True),
                   "none": {}, "causal_window": dict(causal=True, window_left=64)}


@pytest.mark.parametrize("mask,dense,blocks,expected", [
    ("causal", True, 131, True), ("causal", True, 132, False), ("causal_bottom_right", True, 8, True),
    ("none", True, 8, False), ("causal_window", True, 8, False), ("causal", False, 8, False),
])
def test_key_block_kernels_start_heavy_blocks_first_only_where_programs_are_few(monkeypatch, mask, dense, blocks,
                                                                               expected):
    # A dense causal call's first key blocks see the most queries: with few programs (below a kernel's bound per
    # SM: 8 x 132 = 1056 here, 8 per key block) they all start first. Not for windows (blocks alike),
    # non-causal or jagged calls.
    monkeypatch.setattr(program, "sm_count", lambda device: 132)
    opts = KEY_BLOCK_MASKS[mask]
    offsets = None if dense else torch.tensor([0, 5, 9])
    problem = Problem(2, 4, 4, 64, 64, blocks * 128, blocks * 128, dense, offsets, offsets)
    feats = features(problem, AttentionOptions(scale=0.125, **opts), None, None, None)
    assert program.blocks_last(problem, feats, blocks, None, 8) == expected
    grid, order = program.key_block_grid(problem, feats, blocks, None, 8)
    assert (order, grid) == ((program.BLOCKS_LAST, (4, 2, blocks)) if expected else
                             (program.BLOCKS_FIRST, (blocks, 4, 2)))


@pytest.mark.parametrize("head_dim,tile,wide_tile", [
    (64, 64, 64), (128, 128, 128), (40, 64, 64), (56, 64, 64), (72, 128, 128), (80, 128, 128), (96, 128, 128),
    (120, 128, 128), (32, None, None), (24, None, None), (36, None, None), (100, None, None), (136, None, 192),
    (184, None, 192), (192, None, 192), (200, None, 256), (256, None, 256), (132, None, None), (196, None, None),
    (264, None, None),
])
def test_gluon_kernels_compute_a_head_dim_in_the_tile_that_holds_it(head_dim, tile, wide_tile):
    # Multiples of 8 from 40 to 128, in the smallest tile (64 or 128) that holds them: the columns past the head read
    # as zeros (gluon/common.py; at 32 the Triton kernels measured faster); the forward and the backward's dK and dV
    # kernel (gluon/backward_wide.py) also from 136 to 256, in tiles of 192 (128 + 64 columns) to 192 and of 256 past
    # it. (Defined whatever the Triton; the kernels run on an sm_90 GPU.)
    assert gluon_common.tile_head_dim(head_dim) == tile
    assert gluon_common.wide_tile_head_dim(head_dim) == wide_tile
    if tile is not None:  # (the dQ accumulator, of the Triton backward's width, has the tile's columns a head)
        assert head_block(head_dim) == tile
    problem = Problem(1, 2, 2, head_dim, head_dim, 16, 16, True)
    opts = AttentionOptions(scale=0.1)
    assert gluon_common.plain_call(problem, opts, torch.bfloat16, None, None) == (tile is not None)
    assert gluon_forward.supports(problem, opts, torch.bfloat16, None, None, None) == (wide_tile is not None)
    # (no dropout in tiles past 128: their 64-key tiles are not the dropout tile's 128)
    dropout = gluon_forward.supports(problem, opts, torch.bfloat16, None, None, DropoutSeed(1, 0))
    assert dropout == (wide_tile in (64, 128))
    # The backward's kernels: tiles of 64 and 128 (dQ added by atomics, or in deterministic mode without a mask or
    # under a causal-like one, no left window, in a fixed order), or dK and dV stored in tiles of 192 and 256, and in
    # tiles of 128 for deterministic causal calls (dQ by the Gluon dQ kernel, or with dropout by the Triton one:
    # deterministic; where both kernels take a call, the first runs), both with dropout.
    deterministic = AttentionOptions(scale=0.1, deterministic=True)
    causal = AttentionOptions(scale=0.1, deterministic=True, causal=True)
    left = AttentionOptions(scale=0.1, deterministic=True, causal=True, window_left=64)
    right = AttentionOptions(scale=0.1, deterministic=True, window_right=30)
    for options, in_tiles in ((opts, tile is not None), (deterministic, tile is not None), (causal, tile is not None),
                              (right, tile is not None), (left, False),
                              (dataclasses.replace(left, deterministic=False), tile is not None)):
        assert gluon_backward.supports(problem, options, torch.bfloat16, None, None, None) == in_tiles
    for options, seed in ((opts, None), (deterministic, None), (opts, DropoutSeed(1, 0)), (causal, None),
                          (causal, DropoutSeed(1, 0))):
        stored = wide_tile in (192, 256) or (options.causal and wide_tile == 128)
        assert gluon_backward_wide.supports(problem, options, torch.bfloat16, None, None, seed) == stored
        assert gluon_backward_dq.supports(problem, options, torch.bfloat16, None, None, seed) == (
            stored and seed is None)
    assert not gluon_backward_wide.supports(problem, opts, torch.float32, None, None, None)
    # A zero scale: not where the products start from -lse / scale (the lean form at 128, the tiles past 128).
    zero = AttentionOptions(scale=0.0)
    assert gluon_backward.supports(problem, zero, torch.bfloat16, None, None, None) == (tile == 64)
    assert not gluon_backward_wide.supports(problem, zero, torch.bfloat16, None, None, None)


@pytest.mark.parametrize("head_dim,head_dim_v,tiles", [
    (192, 128, (192, 128)), (256, 128, (256, 128)), (136, 96, (192, 128)), (200, 40, (256, 64)), (128, 64, (128, 64)),
    (64, 128, (64, 128)), (96, 80, (128, 128)), (192, 192, (192, 192)), (192, 256, None), (128, 192, None),
    (192, 184, None), (192, 32, None), (32, 64, None), (192, 100, None),
])
def test_gluon_kernels_compute_a_value_head_dim_in_a_tile_of_its_own(head_dim, head_dim_v, tiles):
    # Dv other than D (multi-head latent attention's 192 / 128 first): the forward and the backward's dK and dV
    # kernel (and its dQ kernel) in Q's and K's tile and a tile of 64 or 128 for V and O (gluon/common.py:
    # wide_tile_head_dims); past 128 no value tile but D's, where Dv = D. The backward's kernel in tiles of 64 and 128
    # takes D = Dv only, and the forward no dropout where either tile passes 128 (64-key tiles).
    assert gluon_common.wide_tile_head_dims(head_dim, head_dim_v) == tiles
    problem = Problem(1, 2, 2, head_dim, head_dim_v, 16, 16, True)
    opts = AttentionOptions(scale=0.1)
    assert gluon_forward.supports(problem, opts, torch.bfloat16, None, None, None) == (tiles is not None)
    dropout = gluon_forward.supports(problem, opts, torch.bfloat16, None, None, DropoutSeed(1, 0))
    assert dropout == (tiles is not None and max(tiles) <= 128)
    wide = tiles is not None and tiles[0] > 128
    for options in (opts, AttentionOptions(scale=0.1, deterministic=True, causal=True)):
        assert gluon_backward_wide.supports(problem, options, torch.bfloat16, None, None, None) == wide
        assert gluon_backward_dq.supports(problem, options, torch.bfloat16, None, None, None) == wide
    assert gluon_backward.supports(problem, opts, torch.bfloat16, None, None, None) == (
        head_dim == head_dim_v and gluon_common.tile_head_dim(head_dim) is not None)


@pytest.mark.parametrize("head_dim,head_dim_v,tiles,warpgroups,keys", [
    (40, 40, (64, 64), 3, 128), (96, 96, (128, 128), 2, 128), (64, 64, (64, 64), 3, 128),
    (136, 136, (192, 192), 2, 64), (192, 192, (192, 192), 2, 64), (200, 200, (256, 256), 2, 64),
    (256, 256, (256, 256), 2, 64), (192, 128, (192, 128), 2, 128), (64, 128, (64, 128), 2, 128),
    (128, 40, (128, 64), 2, 128)])
def test_gluon_forward_launch_passes_the_tile_and_the_head_dim(monkeypatch, head_dim, head_dim_v, tiles, warpgroups,
                                                               keys):
    # The kernel's D and DV are the tiles', HEAD_D and HEAD_DV the tensors' (its descriptors' columns); the rules take
    # the larger tile's (three query warpgroups at 64), and tiles past 128 (192 and 256) take 64 keys at a time, but
    # for Q and K in tiles of 192 beside V and O in 128 (their output staged in Q: O_IN_Q).
    # Without a GPU: the kernel replaced by a recorder, CPU tensors (nothing computed).
    taken = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: taken.append((kwargs["D"], kwargs["DV"], kwargs["HEAD_D"],
                                                         kwargs["HEAD_DV"], kwargs["WGS"], kwargs["BN"],
                                                         kwargs["O_IN_Q"]))

    monkeypatch.setattr(gluon_forward, "_attn_fwd_hopper", Recorder(), raising=False)
    monkeypatch.setattr(gluon_forward, "sm_count", lambda device: 132)
    monkeypatch.setattr(gluon_forward, "applies", lambda *args: True)
    problem = Problem(4, 32, 32, head_dim, head_dim_v, 4096, 4096, True)
    q, k = (torch.empty(4, 4096, 32, head_dim, dtype=torch.bfloat16) for _ in range(2))
    v = torch.empty(4, 4096, 32, head_dim_v, dtype=torch.bfloat16)
    opts = AttentionOptions(scale=0.125)
    config = configs.forward_config(problem, torch.bfloat16, q.device, bias=False, dropout=False, tma=True)
    out, _ = triton_forward.launch_forward(q, k, v, None, None, problem, opts, None, config, tma=True, gluon=True)
    assert taken == [(*tiles, head_dim, head_dim_v, warpgroups, keys, tiles in ((256, 256), (192, 128)))]
    assert out.shape == (4, 4096, 32, head_dim_v)


@pytest.mark.parametrize("head_dim,head_dim_v,tiles,dense,deterministic,dropout", [
    (192, 192, (192, 192), True, False, False), (256, 256, (256, 256), False, True, False),
    (136, 136, (192, 192), True, True, False), (192, 128, (192, 128), True, False, False),
    (200, 96, (256, 128), False, False, False), (192, 128, (192, 128), False, False, True),
    (256, 256, (256, 256), True, True, True)])
def test_gluon_wide_backward_launch_passes_the_tile_and_the_head_dim(monkeypatch, head_dim, head_dim_v, tiles, dense,
                                                                     deterministic, dropout):
    # Past 128 the Gluon kernel in tiles of 192 or 256 computes dK and dV (D and DV the tiles', HEAD_D and HEAD_DV the
    # tensors', 64 keys a program), and the Gluon dQ kernel dQ (64 keys a tile, 32 where both tiles are 256), or with
    # dropout the Triton dQ kernel in the config's dQ tiles, whatever dQ mode the config names; the Triton kv kernel
    # doesn't run. Without a GPU: the kernels replaced by recorders, CPU tensors (nothing computed).
    taken = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: taken.append(
                (self.name, kwargs.get("D"), kwargs.get("HEAD_D"), kwargs.get("DV"), kwargs.get("HEAD_DV"),
                 kwargs.get("BN"), kwargs.get("num_warps")))

    monkeypatch.setattr(gluon_backward_wide, "_bwd_kv_wide_hopper", Recorder("wide"), raising=False)
    monkeypatch.setattr(gluon_backward_dq, "_bwd_dq_wide_hopper", Recorder("dq"), raising=False)
    for name in ("_bwd_preprocess", "_bwd_kv_kernel", "_bwd_q_kernel"):
        monkeypatch.setattr(triton_backward, name, Recorder(name))
    monkeypatch.setattr(gluon_common, "hopper_layout", lambda *args: True)
    for module in (triton_backward, gluon_backward_wide, gluon_backward_dq):
        monkeypatch.setattr(module, "ensure_allocator", lambda: None)
    monkeypatch.setattr(gluon_backward_dq, "sm_count", lambda device: 132)
    # (200 queries and keys: no whole number of tiles, so the programs make their descriptors)
    B, S, H = 2, 200, 4
    cu = None if dense else torch.tensor([0, 77, 200], dtype=torch.int32)
    problem = Problem(B, H, H, head_dim, head_dim_v, S, S, dense, cu, cu)
    shape = (B, S, H) if dense else (S, H)
    q, k = (torch.empty(*shape, head_dim, dtype=torch.bfloat16) for _ in range(2))
    v, out, dout = (torch.empty(*shape, head_dim_v, dtype=torch.bfloat16) for _ in range(3))
    lse = torch.empty((B, H, S) if dense else (H, S), dtype=torch.float32)
    opts = AttentionOptions(scale=0.125, causal=True, deterministic=deterministic, dropout_p=0.1 if dropout else 0.0)
    config = configs.BackwardConfig(configs.K(64, 64, 8, 2), configs.K(128, 32, 8, 3), configs.DQ_TMA)
    seed = DropoutSeed(1, 0) if dropout else None
    triton_backward.launch_backward(dout, None, q, k, v, out, lse, None, None, problem, opts, seed, config,
                                    need_dbias=False, tma=True, gluon=True)
    dq_kernel = (("_bwd_q_kernel", None, None, None, None, None, 8) if dropout else
                 ("dq", tiles[0], head_dim, tiles[1], head_dim_v, 64 if sum(tiles) <= 384 else 32, 4))
    assert [t for t in taken if t[0] != "_bwd_preprocess"] == [
        ("wide", tiles[0], head_dim, tiles[1], head_dim_v, 64, 4), dq_kernel]


@pytest.mark.parametrize("head_dim,right,left,dropout,max_q,mean_q,expected", [
    (64, False, False, False, 2048, 2048, 3), (64, False, False, False, 16384, 16384, 3),
    (64, False, False, False, 2047, 2047, 2), (64, False, False, False, 2048, 100, 3),  # (jagged: max_q counts)
    (64, False, True, False, 4096, 4096, 3),  # (a left window alone: no right band)
    (64, True, False, False, 4096, 4096, 3), (64, True, False, False, 2048, 2048, 2),
    (64, True, False, False, 8192, 4000, 2), (64, True, True, False, 16384, 16384, 2),
    (64, False, False, True, 4096, 4096, 2), (64, True, False, True, 16384, 16384, 2),
    (128, False, False, False, 4096, 4096, 2), (128, True, False, False, 16384, 16384, 2),
])
def test_gluon_forward_takes_three_query_warpgroups_at_d64_where_they_measured_faster(head_dim, right, left, dropout,
                                                                                   max_q, mean_q, expected):
    # 192-query blocks where they measured faster (bench/NOTES.md): D64 without dropout; without a right band from
    # 2048 queries, under a causal mask (no left band) from a mean length of 4096. (gluon/forward.py defines the rule
    # whatever the Triton; the kernel runs on an sm_90 GPU.)
    assert gluon_forward.query_warpgroups(head_dim, right, left, dropout, max_q, mean_q) == expected


@pytest.mark.parametrize("causal,max_q,pairs,expected", [
    (True, 4096, 4 * 32, 3), (True, 4096, 2 * 32, 2), (False, 4096, 2 * 32, 2), (True, 8192, 2 * 32, 3),
    (False, 16384, 32, 3), (False, 2048, 8 * 32, 3), (False, 4000, 4 * 32, 3),
    (False, 2048, 2, 2), (True, 4096, 1, 2), (True, 4096, 0, 3),  # (fewer items than programs; none)
])
def test_gluon_forward_takes_two_query_warpgroups_where_three_leave_a_short_last_wave(causal, max_q, pairs, expected):
    # A dense call's items weigh the same: two where 192-query blocks leave 4% more of 132 programs idle in their last
    # wave (B2 H32 S4k: 704 items, 89% busy, against 1024, 97%; bench/NOTES.md). Jagged calls: max_q and the mean.
    assert gluon_forward.query_warpgroups(64, causal, False, False, max_q, max_q, pairs, 132) == expected
    assert gluon_forward.query_warpgroups(64, causal, False, False, max_q, max_q) == 3


@pytest.mark.parametrize("batch,dense,expected", [(4, True, 3), (2, True, 2), (2, False, 3)])
def test_gluon_forward_launch_gives_the_rule_a_dense_calls_pairs_and_programs(monkeypatch, batch, dense, expected):
    # The launcher's arguments to query_warpgroups, without a GPU: the kernel replaced by a recorder, CPU tensors
    # (nothing computed). D64 causal S4096 H32 on 132 programs: B2 dense leaves the last wave of 192-query items short
    # (two), B4 doesn't, and jagged calls don't check.
    taken = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: taken.append(kwargs["WGS"])

    monkeypatch.setattr(gluon_forward, "_attn_fwd_hopper", Recorder(), raising=False)
    monkeypatch.setattr(gluon_forward, "sm_count", lambda device: 132)
    monkeypatch.setattr(gluon_forward, "applies", lambda *args: True)
    offsets = None if dense else torch.arange(0, (batch + 1) * 4096, 4096, dtype=torch.int32)
    problem = Problem(batch, 32, 32, 64, 64, 4096, 4096, dense, offsets, offsets)
    shape = (batch, 4096) if dense else (batch * 4096,)
    q, k, v = (torch.empty(*shape, 32, 64, dtype=torch.bfloat16) for _ in range(3))
    opts = AttentionOptions(scale=0.125, causal=True)
    config = configs.forward_config(problem, torch.bfloat16, q.device, bias=False, dropout=False, tma=True)
    triton_forward.launch_forward(q, k, v, None, None, problem, opts, None, config, tma=True, gluon=True)
    assert taken == [expected]


@pytest.mark.parametrize("head_dim,seq,kv_heads,batch,mask,dense,expected", [
    (64, 2048, 66, 1, "causal", True, True), (64, 2048, 65, 1, "causal", True, False),  # (8 pairs a head; 4 x 132)
    (64, 4096, 32, 4, "causal", True, True), (64, 1024, 32, 1, "causal", True, False),
    (64, 2000, 66, 1, "causal", True, True),  # (2000 keys: 16 blocks)
    (64, 4096, 32, 4, "causal_bottom_right", True, True),
    (64, 4097, 32, 4, "causal", True, False),  # (a mean length over 4096)
    (64, 4096, 32, 4, "none", True, False), (64, 4096, 32, 4, "causal_window", True, False),  # (blocks alike)
    (128, 4096, 32, 4, "causal", True, False),
    # Jagged, one sequence of 4000 keys and three empty ones: 16 + 4 pairs a head counted from the key rows (16 and
    # one per sequence), where the longest sequence's blocks would count 16 x 4.
    (64, 4000, 27, 4, "causal", False, True), (64, 4000, 26, 4, "causal", False, False),
])
def test_gluon_backward_pairs_key_blocks_under_causal_masks_at_d64(monkeypatch, head_dim, seq, kv_heads, batch, mask,
                                                                   dense, expected):
    # Blocks p and n - 1 - p together where a causal mask makes the first blocks the heaviest, on sequences of a mean
    # length up to 4096, from four pairs per SM (where the heaviest-first order doesn't apply; bench/NOTES.md);
    # D128's shared memory has no room for a second K and V. (Defined whatever the Triton; the kernel runs on an
    # sm_90 GPU.)
    monkeypatch.setattr(gluon_backward, "sm_count", lambda device: 132)
    monkeypatch.setattr(program, "sm_count", lambda device: 132)
    opts = KEY_BLOCK_MASKS[mask]
    offsets = None if dense else torch.tensor([0, seq, seq, seq, seq])
    problem = Problem(batch, kv_heads, kv_heads, head_dim, head_dim, seq, seq, dense, offsets, offsets)
    feats = features(problem, AttentionOptions(scale=0.125, **opts), None, None, None)
    total_k = batch * seq if dense else seq
    assert gluon_backward.pairs(problem, feats, total_k, None) == expected
    if dense and mask in ("causal", "causal_bottom_right"):  # (pairs where the heaviest-first order does not apply)
        blocks = -(-seq // 128)
        assert expected == (not program.blocks_last(problem, feats, blocks, None, gluon_backward.PROGRAMS_PER_SM)
                            and head_dim == 64 and seq <= 4096)


@pytest.mark.parametrize("bias_shape,bias_dtype,dropout,scale,expected", [
    ((1, 4, 64, 96), torch.bfloat16, False, 0.125, True),  # broadcast over sequences: float32 adds
    ((2, 4, 64, 96), torch.bfloat16, False, 0.125, True),  # full shape: each element stored once
    ((2, 1, 64, 96), torch.bfloat16, False, -0.5, True), ((1, 1, 64, 96), torch.bfloat16, False, 0.125, True),
    ((1, 4, 1, 96), torch.bfloat16, False, 0.125, False),  # broadcast over queries: no tile for TMA to load
    ((1, 4, 64, 1), torch.bfloat16, False, 0.125, False),  # ... or over keys
    ((1, 4, 64, 96), torch.float32, False, 0.125, False),  # another dtype than the inputs'
    ((1, 4, 64, 96), torch.bfloat16, True, 0.125, False),  # dropout beside a bias: the Triton kernel
    ((1, 4, 64, 96), torch.bfloat16, False, 0.0, False),  # the lean products start from bias / scale
])
@pytest.mark.parametrize("dense", [True, False])
def test_gluon_backward_takes_a_bias_over_whole_planes(bias_shape, bias_dtype, dropout, scale, expected, dense):
    # (Defined whatever the Triton; the kernel runs on an sm_90 GPU, tests/test_attention_gluon.py.) A jagged
    # batch's bias may be wider than its longest sequence.
    offsets = None if dense else torch.tensor([0, 64, 100], dtype=torch.int32)
    problem = Problem(2, 4, 4, 64, 64, 64 if dense else 56, 96 if dense else 88, dense, offsets, offsets)
    opts = AttentionOptions(scale=scale, dropout_p=0.1 if dropout else 0.0)
    bias = torch.zeros(bias_shape, dtype=bias_dtype)
    seed = object() if dropout else None
    assert gluon_backward.supports(problem, opts, torch.bfloat16, bias, None, seed) == expected
    # (Not in deterministic mode: its dQ writer shares the buffers the bias gradient's tiles are staged in.)
    for det in (dataclasses.replace(opts, deterministic=True), dataclasses.replace(opts, deterministic=True,
                                                                                    causal=True)):
        assert not gluon_backward.supports(problem, det, torch.bfloat16, bias, None, seed)


@pytest.mark.parametrize("broadcast,mask,head_dim,dense,expected", [
    ((True, False, False, False), "none", 128, True, True),  # (1, H, Sq, Sk): every sequence visits the same tiles
    ((True, False, False, False), "causal", 64, True, True),  # (the first sequence zeroes the tiles no query sees)
    ((True, False, False, False), "causal_window", 64, True, True),
    ((True, False, False, False), "causal", 128, True, False),  # (the lean kernel with a band and flags spills)
    ((True, False, False, False), "none", 64, False, False),  # a jagged batch's short sequences skip tiles
    ((True, True, False, False), "none", 64, True, False),  # (1, 1, Sq, Sk): heads add too
    ((False, True, False, False), "none", 64, True, False),  # (B, 1, Sq, Sk)
])
def test_gluon_backward_stores_the_first_sequences_bias_gradient(broadcast, mask, head_dim, dense, expected):
    # Where the first sequence's programs store every tile of a gradient broadcast over sequences (zeros where a mask
    # hides one), it needs no zeros first (gluon_backward.stores_first; the kernel runs on an sm_90 GPU,
    # tests/test_attention_gluon.py).
    offsets = None if dense else torch.tensor([0, 64, 100], dtype=torch.int32)
    problem = Problem(2, 4, 4, head_dim, head_dim, 64, 96, dense, offsets, offsets)
    feats = features(problem, AttentionOptions(scale=0.125, **KEY_BLOCK_MASKS[mask]), torch.zeros(1), None, None)
    assert gluon_backward.stores_first(problem, feats, broadcast) == expected


@pytest.mark.parametrize("make,expected", [
    (lambda: torch.zeros(2, 4, 64, 96, dtype=torch.bfloat16), True),
    (lambda: torch.zeros(4, 64, 96, dtype=torch.bfloat16)[None].expand(2, 4, 64, 96), True),  # stride 0: broadcast
    (lambda: torch.zeros(1, 4, 64, 104, dtype=torch.bfloat16)[..., :96], True),  # rows of 104: 16-byte aligned
    (lambda: torch.zeros(1, 4, 64, 101, dtype=torch.bfloat16)[..., :96], False),  # rows of 202 bytes
    (lambda: torch.zeros(1, 4, 64, 100, dtype=torch.bfloat16), False),  # its gradient's rows: 200 bytes
    (lambda: torch.zeros(1, 4, 96, 64, dtype=torch.bfloat16).transpose(-1, -2), False),  # keys not contiguous
    (lambda: torch.zeros(8 * 64 * 96 + 1, dtype=torch.bfloat16)[1:].view(1, 8, 64, 96), False),  # base misaligned
])
def test_gluon_backward_bias_alignment(make, expected):
    assert gluon_backward.bias_aligned(make()) == expected


def test_gluon_kernels_only_with_the_triton_they_are_written_for():
    # Triton 3.9's Gluon has no thread_barrier: a Hopper GPU with another Triton takes the Triton kernels.
    assert gluon_common.gluon_api_supported("3.6.0") and gluon_common.gluon_api_supported("3.6.1+git1234abcd")
    assert gluon_common.gluon_api_supported("3.6.0rc1")
    assert not any(gluon_common.gluon_api_supported(v) for v in ("3.5.1", "3.9.0", "3.10.0", "4.6.0", "36.0", "dev"))
    if not gluon_common.gluon_api_supported(triton.__version__):
        assert not gluon_common.HAVE_GLUON and not gluon_backward.HAVE_GLUON


@pytest.mark.parametrize("mask,dense,heads,kv_heads,batch,blocks,expected", [
    ("causal", True, 32, 8, 2, 32, 4),  # 132 // 32 = 4 kv heads a group, of 16
    ("causal_bottom_right", True, 32, 8, 2, 32, 4), ("causal", True, 32, 8, 1, 64, 2),
    ("causal", True, 12, 4, 8, 16, 8),
    ("causal", True, 32, 8, 2, 8, 16),  # few blocks: one group of all (blocks last's order)
    ("causal", True, 6, 3, 3, 32, 3),  # 9 kv heads: the largest divisor up to 4
    ("causal", True, 8, 1, 7, 32, 0),  # 7 kv heads: no divisor from 2 to 4
    ("causal", True, 32, 8, 1, 128, 0),  # 132 // 128 = 1
    ("causal", True, 2, 1, 140000, 64, 0),  # 70000 groups of 2: past a grid's 65535
    ("causal", True, 32, 32, 2, 32, 0),  # MHA: a program walks one head
    ("none", True, 32, 8, 2, 32, 0), ("causal_window", True, 32, 8, 2, 32, 0), ("causal", False, 32, 8, 2, 32, 0),
])
def test_gqa_key_block_programs_run_in_groups_of_kv_heads(monkeypatch, mask, dense, heads, kv_heads, batch, blocks,
                                                          expected):
    # Dense GQA calls under a causal mask: the programs of a group of kv heads, every key block of each, run
    # together (program.kv_head_groups), the group's kv heads the largest divisor of all (B x Hkv) up to
    # sm_count / blocks, at least 2; only for kernels that take that grid and unless sequences add into one memory.
    monkeypatch.setattr(program, "sm_count", lambda device: 132)
    offsets = None if dense else torch.tensor([0, 5] + [9] * (batch - 1))
    problem = Problem(batch, heads, kv_heads, 64, 64, blocks * 128, blocks * 128, dense, offsets, offsets)
    feats = features(problem, AttentionOptions(scale=0.125, **KEY_BLOCK_MASKS[mask]), None, None, None)
    assert program.kv_head_groups(problem, feats, blocks, None) == expected
    grid, order = program.key_block_grid(problem, feats, blocks, None, 8, kv_groups=True)
    if expected:
        assert (order, grid) == (program.KV_GROUPS, (expected, blocks, batch * kv_heads // expected))
    else:
        assert order != program.KV_GROUPS
    assert program.key_block_grid(problem, feats, blocks, None, 8)[1] != program.KV_GROUPS
    assert program.key_block_grid(problem, feats, blocks, None, 8, True, kv_groups=True)[1] != program.KV_GROUPS


@triton.jit
def _visits_kernel(visits, after, Lq, Lk, shift, R, F: tl.constexpr, N_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    # Per key block (a program): whether it visits each query tile (masks.query_stages, as the kernels walk them), and
    # masks.key_blocks_after for the tile.
    k = tl.program_id(0)
    m = SeqMask(shift, -1, R, 0, visits, visits)
    t_lo, u_lo, u_hi, t_hi = query_stages(k * BLOCK_N, Lq, Lk, m, F, BLOCK_M, BLOCK_N)
    n_tiles = (t_hi - t_lo + BLOCK_M - 1) // BLOCK_M
    for t in range(N_TILES):
        seen = (t * BLOCK_M >= t_lo) & (t * BLOCK_M < t_lo + n_tiles * BLOCK_M)
        tl.store(visits + k * N_TILES + t, seen.to(tl.int32))
        tl.store(after + k * N_TILES + t, key_blocks_after(k * BLOCK_N, t * BLOCK_M, Lq, Lk, shift, R, F.HAS_R,
                                                           BLOCK_M, BLOCK_N))


# (70, 300) with a right window of 30: key block 1's first visible row (98) lies in the last tile but past Lq.
@pytest.mark.parametrize("lengths", [(1, 1), (17, 5), (64, 64), (300, 1000), (1000, 300), (129, 128), (700, 701),
                                     (1000, 1000), (5, 300), (70, 300), (100, 257)])
@pytest.mark.parametrize("align,right", [("top_left", 0), ("bottom_right", 0), ("top_left", 30), ("bottom_right", 200),
                                         ("top_left", None)])
def test_key_blocks_after_counts_the_later_blocks_that_visit_a_tile(lengths, align, right):
    # The Gluon backward's deterministic dQ adds (no mask, right None, or a causal-like one; no left window) come into
    # each query tile last key block first, each block waiting until the count of its tile's reduces says every later
    # block that visits the tile has added: masks.key_blocks_after must count exactly those (too many hangs the kernel,
    # too few loses the order), for every tile a block visits as query_stages walks them.
    Lq, Lk = lengths
    opts = AttentionOptions(scale=0.125, causal=right == 0, window_right=right or -1,
                            bottom_right=align == "bottom_right")
    problem = Problem(1, 1, 1, 64, 64, Lq, Lk, True)
    feats = features(problem, opts, None, None, None)
    shift = Lk - Lq if opts.bottom_right else 0
    blocks, tiles = -(-Lk // 128), -(-Lq // 64)
    visits = torch.zeros(blocks, tiles, dtype=torch.int32, device=KERNEL_DEVICE)
    after = torch.zeros(blocks, tiles, dtype=torch.int32, device=KERNEL_DEVICE)
    _visits_kernel[(blocks,)](visits, after, Lq, Lk, shift, opts.visible_right(), F=feats, N_TILES=tiles,
                              BLOCK_M=64, BLOCK_N=128)
    visits, after = visits.cpu(), after.cpu()
    assert visits.any()
    for k in range(blocks):
        for t in range(tiles):
            if visits[k, t]:
                assert after[k, t].item() == visits[k + 1:, t].sum().item(), (k, t)


@pytest.mark.parametrize("batch,adds,causal,expected", [
    (3, True, False, program.HEADS_LAST), (1, True, False, program.BLOCKS_FIRST),
    (3, False, False, program.BLOCKS_FIRST), (65536, True, False, program.BLOCKS_FIRST),
    (3, True, True, program.BLOCKS_LAST),
])
def test_key_block_kernels_take_heads_last_where_sequences_add_into_one_bias_gradient(monkeypatch, batch, adds, causal,
                                                                                     expected):
    # Programs of one key block and head in different sequences that add into one memory (a bias gradient
    # broadcast over the batch) run together in the (blocks, B, heads) grid; blocks last wins where both apply
    # (dense causal, few programs), and a batch past a grid's second axis keeps the blocks-first grid.
    monkeypatch.setattr(program, "sm_count", lambda device: 132)
    problem = Problem(batch, 4, 4, 64, 64, 256, 256, True)
    feats = features(problem, AttentionOptions(scale=0.125, causal=causal), None, None, None)
    grid = {program.HEADS_LAST: (2, batch, 4), program.BLOCKS_FIRST: (2, 4, batch),
            program.BLOCKS_LAST: (4, batch, 2)}[expected]
    assert program.key_block_grid(problem, feats, 2, None, 8, adds_across_batch=adds) == (grid, expected)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("case", [
    AttnCase(False, (37, 37, 37), None, 4, 2, 16, 16, bias="1HQK"),
    AttnCase(True, (3, 40, 0, 17), (20, 33, 5, 1), 4, 2, 16, 16, causal=True, bias="1HQK"),
], ids=lambda c: c.id)
def test_bias_gradient_broadcast_over_the_batch(case, deterministic, device, monkeypatch):
    # Outside deterministic mode the kv kernel adds it atomically in the heads-last grid (program.heads_last);
    # in deterministic mode the recompute kernel sums it in a fixed order. Both against the reference.
    case = dataclasses.replace(case, deterministic=deterministic)
    takes = record_calls(monkeypatch, program, "heads_last")
    dtype = main_dtype("triton")
    inputs = case.make(dtype, device)
    out, lse, grads = run_attention(case, inputs, "triton")
    _check_against_reference(case, inputs, out, lse, grads, dtype)
    assert takes == [not deterministic], takes


GRID_ORDER_CASES = [
    AttnCase(False, (130, 130), None, 4, 2, 16, 16, causal=True),
    AttnCase(False, (40, 40, 40), (130, 130, 130), 2, 2, 16, 8, causal=True, align="bottom_right"),
]


@pytest.mark.parametrize("programs_per_sm", [0, 10**6])
@pytest.mark.parametrize("case", GRID_ORDER_CASES, ids=lambda c: c.id)
def test_key_block_kernel_in_either_grid_order(case, programs_per_sm, device, monkeypatch):
    # The Triton kv kernel (head dim 16: not the Gluon kernel's) in both grids of program.key_block_grid, whatever
    # the machine, against the reference.
    monkeypatch.setattr(triton_backward, "KV_PROGRAMS_PER_SM", programs_per_sm)
    orders = record_calls(monkeypatch, program, "blocks_last")
    dtype = main_dtype("triton")
    inputs = case.make(dtype, device)
    out, lse, grads = run_attention(case, inputs, "triton")
    _check_against_reference(case, inputs, out, lse, grads, dtype)
    assert orders == [programs_per_sm > 0], orders


@pytest.mark.parametrize("case,made", [
    ("whole tiles", True), ("cross", True), ("batch 1 slice", True), ("queries not whole tiles", False),
    ("keys not whole blocks", False), ("sequences apart", False), ("jagged", False),
])
def test_gluon_backward_makes_descriptors_on_the_host_only_where_no_tile_crosses_a_sequence(case, made):
    # Descriptors over all B x S rows are exact only where every query tile (64) and key block (128) lies in one
    # sequence and the sequences follow one another in memory; elsewhere the programs make per-sequence ones.
    Lq, Lk = {"cross": (64, 256), "queries not whole tiles": (1000, 1024), "keys not whole blocks": (1024, 960)}.get(
        case, (512, 512))
    B, H, D = (1, 4, 64) if case == "batch 1 slice" else (2, 4, 64)

    def rows(L, width):
        if case == "sequences apart" or case == "batch 1 slice":
            return torch.zeros(B, L + 64, H, width)[:, :L]  # (rows of other sequences between them)
        return torch.zeros(B, L, H, width)

    q, dout, dq_acc = rows(Lq, D), rows(Lq, D), rows(Lq, D)
    k, v, dk, dv = (rows(Lk, D) for _ in range(4))
    offsets = torch.tensor([0, Lq, 2 * Lq]) if case == "jagged" else None
    problem = Problem(B, H, H, D, D, Lq, Lk, case != "jagged", offsets, offsets)
    boxes = gluon_backward.host_descriptor_boxes(problem, q, dout, dq_acc, k, v, dk, dv)
    assert (boxes is not None) == made
    if made:
        assert [list(box) for box in boxes] == [[64, D]] * 3 + [[128, D]] * 2 + [[64, D]] * 2
    if gluon_backward.HAVE_GLUON:  # (the descriptors themselves: Triton 3.6's Gluon host API)
        descs = gluon_backward.host_descriptors(problem, q, dout, dq_acc, k, v, dk, dv)
        assert (descs is not None) == made
        if made:
            assert [list(d.shape) for d in descs] == [[B * Lq, H * D]] * 3 + [[B * Lk, H * D]] * 4
            assert [d.strides[0] for d in descs] == [t.stride(1) for t in (q, dout, dq_acc, k, v, dk, dv)]
            assert [list(d.block_shape) for d in descs] == [list(box) for box in boxes]
