"""The attention dropout mask: Philox, its agreement with Triton, its statistics, and how calls use it."""

import math

import pytest
import torch
import triton
import triton.language as tl
from torch.utils.checkpoint import checkpoint

import varlen
from attention_cases import AttnCase, backend_params, main_dtype, run_attention
from utils import assert_close, record_args, record_calls
from varlen.attn import api, function, torch_backend
from varlen.attn.dropout import (
    PHILOX_ROUNDS,
    attention_dropout_mask,
    dropout_keep_mask,
    dropout_keep_scale,
    dropout_threshold,
    keep_mask_block,
    philox4x32,
)
from varlen.attn.options import AttentionOptions, DropoutSeed, Problem
from varlen.attn.reference import attention_reference
from varlen.attn.triton.scores import HeadDropout, keep_tile

# Random123's known-answer vectors for Philox4x32-7 (the mask's) and -10 (kat_vectors): rounds, counter, key, output.
PHILOX_KAT = [
    (7, (0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    (7, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
    (7, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
    (10, (0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (10, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (10, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("rounds,counter,key,expected", PHILOX_KAT,
                         ids=[f"{name}-{r}" for r in (7, 10) for name in ("zeros", "ones", "pi")])
def test_philox_known_answers(rounds, counter, key, expected):
    out = philox4x32(tuple(torch.tensor(c) for c in counter), tuple(torch.tensor(k) for k in key), rounds=rounds)
    assert tuple(int(w) for w in out) == expected


def test_mask_rounds_are_seven():
    assert PHILOX_ROUNDS == 7


@triton.jit
def _randint4x_kernel(out_ptr, offsets_ptr, seed, N: tl.constexpr):
    idx = tl.arange(0, N)
    r0, r1, r2, r3 = tl.randint4x(seed, tl.load(offsets_ptr + idx))
    tl.store(out_ptr + idx * 4, r0)
    tl.store(out_ptr + idx * 4 + 1, r1)
    tl.store(out_ptr + idx * 4 + 2, r2)
    tl.store(out_ptr + idx * 4 + 3, r3)


def _u32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int64) & 0xFFFFFFFF


def test_philox_matches_triton_randint4x(device):
    """``tl.randint4x(seed, offset)`` is Philox4x32-10 keyed (seed_lo, seed_hi) on counter (offset, 0, 0, 0)."""
    seed = 0xDEADBEEF12345678
    offsets = torch.randint(0, 2**31 - 1, (64,), dtype=torch.int32, device=device)
    out = torch.empty(64 * 4, dtype=torch.int32, device=device)
    _randint4x_kernel[(1,)](out, offsets, seed, N=64)
    zero = torch.zeros_like(offsets, dtype=torch.int64)
    expected = philox4x32((_u32(offsets), zero, zero, zero),
                          (torch.tensor(seed & 0xFFFFFFFF), torch.tensor(seed >> 32)), rounds=10)
    assert torch.equal(_u32(out).view(64, 4), torch.stack(expected, dim=-1).to(out.device))


@triton.jit
def _keep_mask_kernel(out_ptr, seed, offset_lo, threshold, H, max_q, max_k, BLOCK_Q: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """The mask as the module docstring defines it, one element at a time (``seed`` already holds ``seed ^
    (offset_hi << 32)``)."""
    bh = tl.program_id(0)
    i = tl.arange(0, BLOCK_Q)[:, None]
    j = tl.arange(0, BLOCK_K)[None, :]
    zero = tl.zeros([BLOCK_Q, BLOCK_K], dtype=tl.int32)
    r0, r1, r2, r3 = tl.philox(seed, (i >> 1) + zero, (j >> 3) + zero, bh + zero, offset_lo + zero, n_rounds=7)
    word = j & 3
    r = tl.where(word == 0, r0, tl.where(word == 1, r1, tl.where(word == 2, r2, r3)))
    r8 = (r >> (8 * (2 * (i & 1) + ((j >> 2) & 1))).to(tl.uint32)) & 0xFF
    keep = r8 >= threshold
    mask = (i < max_q) & (j < max_k)
    tl.store(out_ptr + bh * max_q * max_k + i * max_k + j, keep.to(tl.int8), mask=mask)


@pytest.mark.parametrize("seed,offset", [(0, 0), (123456789, 4), (2**63 - 25, 2**32 + 12),
                                         (0xFEDCBA9876543210, 0xFFFFFFFFFFFFFFF0)],
                         ids=["zero", "small", "offset-high-word", "full-64-bit"])
def test_keep_mask_matches_triton_philox(seed, offset, device):
    """The mask bit for bit against ``tl.philox`` in a kernel (the recipe for the Triton backend)."""
    B, H, max_q, max_k, p = 2, 3, 5, 29, 0.37
    expected = dropout_keep_mask(B, H, max_q, max_k, p, seed=seed, offset=offset, device=device)
    out = torch.full((B * H, max_q, max_k), -1, dtype=torch.int8, device=device)
    offset_lo = offset & 0xFFFFFFFF
    offset_lo = offset_lo - 2**32 if offset_lo >= 2**31 else offset_lo  # the same 32 bits, as an int32
    _keep_mask_kernel[(B * H,)](out, seed ^ ((offset >> 32) << 32), offset_lo, dropout_threshold(p), H, max_q,
                                max_k, BLOCK_Q=8, BLOCK_K=32)
    assert torch.equal(out.view(B, H, max_q, max_k).bool(), expected)


@triton.jit
def _keep_tile_kernel(out_ptr, seed, offset_lo, threshold, row0, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      ODD_ROWS: tl.constexpr):
    """``scores.keep_tile`` of stream 0, rows from ``row0``, keys from ``BLOCK_N * program_id(0)``."""
    d = HeadDropout(seed, offset_lo, threshold, 1.0, 0, row0)
    n0 = BLOCK_N * tl.program_id(0)
    keep = keep_tile(d, 0, n0, BLOCK_M, BLOCK_N, ODD_ROWS)
    i = tl.arange(0, BLOCK_M)[:, None]
    j = n0 + tl.arange(0, BLOCK_N)[None, :]
    tl.store(out_ptr + i * BLOCK_N * tl.num_programs(0) + j, keep.to(tl.int8))


@pytest.mark.parametrize("row0, odd_rows", [(0, False), (6, False), (2**31 - 10, False),
                                            (0, True), (1, True), (7, True), (2**31 - 9, True)])
def test_keep_tile_matches_the_mask(row0, odd_rows, device):
    """The Triton kernels' tile of keep bits against the PyTorch mask: rows that start even (one Philox call per
    pair of rows), and rows that start at any row (``ODD_ROWS``, under a query offset: odd, or past 2**31, where an
    int32 row is negative)."""
    seed, offset, p, BLOCK_M, BLOCK_N = 0xFEDCBA9876543210, 2**32 + 12, 0.37, 16, 16
    out = torch.full((BLOCK_M, 2 * BLOCK_N), -1, dtype=torch.int8, device=device)
    _keep_tile_kernel[(2,)](out, seed ^ ((offset >> 32) << 32), offset & 0xFFFFFFFF, dropout_threshold(p), row0,
                            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, ODD_ROWS=odd_rows)
    expected = keep_mask_block(seed, offset, 1, 1, (0, BLOCK_M), 2 * BLOCK_N, p, device,
                               row_offset=torch.tensor([row0], device=device))
    assert torch.equal(out.bool(), expected[0, 0])


def test_dropout_threshold():
    assert dropout_threshold(0.0) == 0
    assert dropout_threshold(2**-10) == 0  # below half a level: keeps everything
    assert dropout_threshold(0.5) == 128
    assert dropout_threshold(0.1) == 26  # 25.6 rounded
    assert dropout_threshold(1 - 2**-20) == 255


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9])
def test_keep_rate(p, device):
    """The keep rate is 1 - threshold / 256, within 5 binomial standard deviations."""
    mask = dropout_keep_mask(4, 8, 64, 61, p, seed=1234, offset=8, device=device)
    n = mask.numel()
    keep = 1 - dropout_threshold(p) / 256
    sigma = math.sqrt(keep * (1 - keep) / n)
    assert abs(mask.sum().item() / n - keep) <= 5 * sigma + 1e-12  # an exact count, not a float32 mean


@pytest.mark.parametrize("p", [0.1, 0.5, 0.99999, 1 - 2**-18])
def test_keep_scale_inverts_the_exact_keep_probability(p):
    assert dropout_keep_scale(p) * (256 - dropout_threshold(p)) == 256


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.gpu_only)])
def test_expected_output_is_unbiased_near_one(backend, device):
    """At p = 0.99999 the 8-bit test keeps 2**-8 of the weights, not 1e-5: scaling the kept ones by
    1 / (1 - p) would make the expected output 391x the undropped one. Uniform attention over values of 1:
    the mean output is (kept / weights) * scale, 1 in expectation (about 131k kept: 0.3% noise)."""
    B, S, H = 4, 1024, 8
    q = torch.zeros(B, S, H, 16, device=device)
    k = torch.randn(B, S, H, 16, device=device)
    v = torch.ones(B, S, H, 16, device=device)
    out = varlen.attention(q, k, v, dropout_p=0.99999, backend=backend)
    assert abs(out[..., 0].double().mean().item() - 1) < 0.02  # 7 standard deviations


def _correlation(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def test_masks_are_independent(device):
    """Masks of different heads, batches, neighbouring keys and rows, and successive offsets or seeds
    are uncorrelated: |corr| below 5 / sqrt(n)."""
    p = 0.5
    mask = dropout_keep_mask(3, 4, 96, 96, p, seed=42, offset=0, device=device)
    pairs = {
        "heads": (mask[:, 0], mask[:, 1]),
        "heads far apart": (mask[:, 0], mask[:, 3]),
        "batches": (mask[0], mask[1]),
        "neighbouring keys (one Philox call, another word)": (mask[..., 0::2], mask[..., 1::2]),
        "keys 4 apart (the same word's other byte, or the next call)": (mask[..., 0:92], mask[..., 4:96]),
        "neighbouring key groups": (mask[..., 0:88], mask[..., 8:96]),
        "rows of one call (another byte)": (mask[:, :, 0::2], mask[:, :, 1::2]),
        "rows of neighbouring calls": (mask[:, :, 1:-1:2], mask[:, :, 2::2]),
        "successive offsets": (mask, dropout_keep_mask(3, 4, 96, 96, p, seed=42, offset=4, device=device)),
        "offsets 2**32 apart": (mask, dropout_keep_mask(3, 4, 96, 96, p, seed=42, offset=2**32, device=device)),
        "seeds differing in the high word": (mask, dropout_keep_mask(3, 4, 96, 96, p, seed=42 + 2**32, offset=0,
                                                                     device=device)),
    }
    for name, (a, b) in pairs.items():
        assert abs(_correlation(a, b)) < 5 / math.sqrt(a.numel()), name


def test_keep_mask_of_rows_is_a_slice(device):
    """A sequence's mask doesn't depend on max_q / max_k (kernels with other block sizes agree)."""
    big = dropout_keep_mask(2, 3, 40, 50, 0.3, seed=9, offset=12, device=device)
    small = dropout_keep_mask(2, 3, 17, 13, 0.3, seed=9, offset=12, device=device)
    assert torch.equal(big[:, :, :17, :13], small)


def test_keep_mask_of_odd_and_shifted_rows(device):
    """Blocks of rows starting at an odd row, or shifted per sequence (``query_offset``), which cut the Philox
    calls' row pairs, are slices of the whole mask."""
    B, H, p = 3, 2, 0.3
    whole = dropout_keep_mask(B, H, 24, 21, p, seed=5, offset=8, device=device)
    assert torch.equal(keep_mask_block(5, 8, B, H, (3, 10), 21, p, device), whole[:, :, 3:10])
    shift = torch.tensor([3, 0, 6], device=device)
    block = keep_mask_block(5, 8, B, H, (1, 8), 21, p, device, row_offset=shift)
    for b in range(B):
        assert torch.equal(block[b], whole[b, :, 1 + shift[b]:8 + shift[b]])


# ------------------------------------------------------------------------- masks of attention calls
DROPOUT_CASES = [
    AttnCase(False, (9, 9), (13, 13), 4, 2, 16, 16, causal=True, align="bottom_right", dropout_p=0.4),
    AttnCase(True, (3, 17, 1, 0), (17, 0, 5, 9), 4, 1, 16, 8, bias="B11K", dropout_p=0.5, grad_lse=True),
]


def _values(x):
    return x.values if isinstance(x, varlen.JaggedTensor) else x


@pytest.mark.parametrize("backend,case", backend_params(DROPOUT_CASES))
def test_same_generator_state_same_result(backend, case, device):
    """Two calls from one generator state give identical outputs and gradients; the next call differs."""
    inputs = case.make(main_dtype(backend), device)
    state = inputs.generator.get_state()
    out_a, lse_a, grads_a = run_attention(case, inputs, backend)
    after = inputs.generator.get_state()
    out_c, _, _ = run_attention(case, inputs, backend)  # the generator has moved on
    inputs.generator.set_state(state)
    out_b, lse_b, grads_b = run_attention(case, inputs, backend)
    assert torch.equal(_values(out_a), _values(out_b)) and torch.equal(lse_a, lse_b)
    for a, b in zip(grads_a, grads_b, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(after, state)
    assert not torch.equal(_values(out_a), _values(out_c))


@pytest.mark.parametrize("backend,case", backend_params([AttnCase(False, (11, 11), (14, 14), 4, 2, 16, 16,
                                                                    dropout_p=0.5)]))
def test_mask_of_the_call_is_the_one_applied(backend, case, device):
    """The output equals the reference with ``attention_dropout_mask``'s mask, and not with another one
    (so the comparison can fail), using torch's default generator."""
    dtype = main_dtype(backend)
    inputs = case.make(dtype, device)
    q, k, v = (t.detach() for t in inputs.leaves)
    keep = attention_dropout_mask(q, k, 0.5)  # the default generator of q's device, not advanced
    out = varlen.attention(q, k, v, dropout_p=0.5, backend=backend)
    ref, _ = attention_reference(q.double(), k.double(), v.double(), dropout_mask=keep, dropout_p=0.5)
    assert_close(out, ref, dtype)
    other = keep.clone()
    other[:, :, :, 0] = ~other[:, :, :, 0]
    wrong, _ = attention_reference(q.double(), k.double(), v.double(), dropout_mask=other, dropout_p=0.5)
    with pytest.raises(AssertionError):
        assert_close(out, wrong, dtype)


# The kernels that load a key drawn on the device, beyond DROPOUT_CASES': per-sequence mask rows (query_offset,
# POSITIONS), and the deterministic mode's separate dQ kernel and recompute kernel for a broadcast bias's gradient.
KEY_IN_MEMORY_CASES = DROPOUT_CASES + [
    AttnCase(True, (3, 5, 9), (7, 6, 12), 2, 2, 8, 8, causal=True, query_offset=2, dropout_p=0.3),
    AttnCase(False, (13, 13), None, 2, 1, 16, 16, bias="1HQK", deterministic=True, dropout_p=0.25),
]


@pytest.mark.parametrize("backend,case", backend_params(KEY_IN_MEMORY_CASES))
def test_a_key_drawn_on_the_device_is_that_keys_mask(backend, case, device, monkeypatch):
    """Inside a captured CUDA graph (simulated: the capture test says yes) the key is drawn from the generator on the
    call's device and stays there; the kernels load it. The output and gradients are those of the same key held on
    the host, bit for bit, forward and backward; the next draw is another key."""
    inputs = case.make(main_dtype(backend), device)
    monkeypatch.setattr(function, "capturing", lambda device: True)
    drawn = record_calls(monkeypatch, api, "dropout_seed")
    out, lse, grads = run_attention(case, inputs, backend)
    (key,) = drawn
    assert key.shape == (1,) and key.dtype == torch.int64 and key.device.type == device.type
    monkeypatch.setattr(function, "capturing", lambda device: False)
    monkeypatch.setattr(api, "dropout_seed", lambda *args: torch.tensor([int(key), 0]))  # the key, on the host
    out_host, lse_host, grads_host = run_attention(case, inputs, backend)
    assert torch.equal(_values(out), _values(out_host)) and torch.equal(lse, lse_host)
    for a, b in zip(grads, grads_host, strict=True):
        assert torch.equal(a, b)
    monkeypatch.setattr(function, "capturing", lambda device: True)
    monkeypatch.setattr(api, "dropout_seed", function.dropout_seed)
    assert not torch.equal(_values(run_attention(case, inputs, backend)[0]), _values(out))


def test_attention_dropout_mask_leaves_generator_alone(device):
    q = varlen.jagged([torch.randn(n, 4, 8) for n in (3, 0, 7)], device=device)
    k = varlen.jagged([torch.randn(n, 2, 8) for n in (5, 2, 1)], device=device)
    generator = torch.Generator(device=device).manual_seed(3)
    state = generator.get_state()
    keep = attention_dropout_mask(q, k, 0.2, generator=generator)
    assert torch.equal(generator.get_state(), state)
    assert keep.shape == (3, 4, 7, 5) and keep.dtype == torch.bool and keep.device.type == device.type
    assert torch.equal(attention_dropout_mask(q, k, 0.2, generator=generator), keep)
    assert attention_dropout_mask(q, k, 0.0, generator=generator).all()


def test_dropout_mask_validation():
    q = torch.randn(1, 3, 2, 8)
    with pytest.raises(ValueError, match="dropout_p"):
        attention_dropout_mask(q, q, 1.0)
    with pytest.raises(ValueError, match="dropout_p"):
        attention_dropout_mask(q, q, True)
    with pytest.raises(TypeError, match="generator"):
        attention_dropout_mask(q, q, 0.1, generator=3)
    with pytest.raises(ValueError, match="q: expected 4 dims"):
        attention_dropout_mask(q[0], q, 0.1)
    with pytest.raises(TypeError, match="k: expected a varlen.JaggedTensor"):
        attention_dropout_mask(q, [q], 0.1)
    jagged_2d = varlen.jagged([torch.randn(3, 8)])
    with pytest.raises(ValueError, match="k: expected a jagged tensor of logical shape"):
        attention_dropout_mask(q, jagged_2d, 0.1)
    with pytest.raises(ValueError, match="seed: got -1"):
        dropout_keep_mask(1, 1, 2, 2, 0.1, seed=-1, offset=0)
    with pytest.raises(ValueError, match="offset: got 18446744073709551616; must be below 2\\*\\*64"):
        dropout_keep_mask(1, 1, 2, 2, 0.1, seed=0, offset=2**64)
    with pytest.raises(TypeError, match="max_k: expected an int"):
        dropout_keep_mask(1, 1, 2, 2.0, 0.1, seed=0, offset=0)
    with pytest.raises(ValueError, match="dropout_p"):
        dropout_keep_mask(1, 1, 2, 2, -0.1, seed=0, offset=0)


# ------------------------------------------------------------------ the CPU backward takes the forward's masks
def _kept_mask_call(monkeypatch, rows_per_chunk: int = 4):
    """A jagged causal call with dropout on the CPU (several length buckets, several query chunks each) and what
    it drew: ``run(retain)`` gives ``[out, grads, draws in the forward, draws in the backward]``, every run from the
    same generator state (``retain``: then a second backward through the same graph, its grads and draws too); also
    the masks drawn (the last run's) and the backend's forward calls' arguments."""
    monkeypatch.setattr(torch_backend, "SCORE_BLOCK_ELEMENTS", rows_per_chunk * 6 * 4 * 40)
    monkeypatch.setattr(torch_backend, "BUCKET_COST", 1.0)  # (a bucket per length, here)
    draws = record_calls(monkeypatch, torch_backend, "keep_mask_block")
    parts = record_calls(monkeypatch, torch_backend, "_parts")
    forward_calls = record_args(monkeypatch, torch_backend, "forward")
    torch.manual_seed(0)
    q = varlen.jagged([torch.randn(n, 4, 16) for n in (3, 17, 1, 0, 40, 9)]).requires_grad_()
    k = varlen.jagged([torch.randn(n, 2, 16) for n in (17, 0, 5, 9, 33, 2)]).requires_grad_()
    v = varlen.jagged([torch.randn(n, 2, 8) for n in (17, 0, 5, 9, 33, 2)]).requires_grad_()
    leaves = (q.values, k.values, v.values)
    dout = torch.randn(q.values.shape[0], 4, 8)

    def run(retain: bool = False):
        draws.clear()
        out = varlen.attention(q, k, v, causal=True, dropout_p=0.3, generator=torch.Generator().manual_seed(5),
                               backend="torch")
        forward_draws = len(draws)
        grads = torch.autograd.grad(out.values, leaves, dout, retain_graph=retain)
        assert len(parts[-1]) > 2  # (several buckets: their chunks start at the same rows)
        result = [out.values, grads, forward_draws, len(draws) - forward_draws]
        if retain:
            before = len(draws)
            result += [torch.autograd.grad(out.values, leaves, dout), len(draws) - before]
        return result

    return run, draws, forward_calls


def test_cpu_backward_takes_the_forwards_masks(monkeypatch):
    """On the CPU the forward keeps each chunk's keep bits for its backward, which draws none and gives the gradients
    of a backward that draws them all again, bit for bit; the memo is empty once the backward is done."""
    run, _, forward_calls = _kept_mask_call(monkeypatch)
    out, grads, forward_draws, backward_draws = run()
    assert forward_draws > 2 and backward_draws == 0  # (several buckets and chunks)
    assert forward_calls[-1][-1].kept == {}  # (the call's DropoutSeed)
    monkeypatch.setattr(torch_backend, "KEPT_MASK_BYTES", -1)  # (none kept, not even an empty one)
    out_drawn, grads_drawn, forward_again, backward_again = run()
    assert forward_again == backward_again == forward_draws
    assert torch.equal(out, out_drawn)
    for a, b in zip(grads, grads_drawn, strict=True):
        assert torch.equal(a, b)


def test_cpu_kept_masks_stay_within_their_budget(monkeypatch):
    """A chunk's mask is kept where the call's kept bytes stay within ``KEPT_MASK_BYTES`` with it: with room for the
    first two chunks' but a byte, the backward draws the second again, and those later ones that don't fit; a second
    backward through the same graph (the memo spent) draws them all; gradients are the same bits each time."""
    run, draws, _ = _kept_mask_call(monkeypatch)
    _, grads, forward_draws, _ = run()
    budget = draws[0].untyped_storage().nbytes() + draws[1].untyped_storage().nbytes() - 1
    monkeypatch.setattr(torch_backend, "KEPT_MASK_BYTES", budget)
    _, grads_partly, _, backward_draws, grads_again, second_draws = run(retain=True)
    total, kept = 0, 0
    for mask in draws[:forward_draws]:
        if total + mask.untyped_storage().nbytes() <= budget:
            total, kept = total + mask.untyped_storage().nbytes(), kept + 1
    assert 2 <= kept < forward_draws  # (the second chunk's mask among those drawn again)
    assert backward_draws == forward_draws - kept and second_draws == forward_draws
    for a, b, c in zip(grads, grads_partly, grads_again, strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_no_masks_are_kept_without_a_backward(monkeypatch):
    """A call under no_grad, or with no input requiring a gradient, gets no memo (nothing to keep its masks for)."""
    calls = record_args(monkeypatch, torch_backend, "forward")
    q = varlen.jagged([torch.randn(n, 2, 8) for n in (3, 5)])
    with torch.no_grad():
        varlen.attention(q.requires_grad_(), q, q, dropout_p=0.3, backend="torch")
    varlen.attention(q.detach(), q.detach(), q.detach(), dropout_p=0.3, backend="torch")
    assert len(calls) == 2 and all(call[-1].kept is None for call in calls)


def test_a_kept_mask_of_another_shape_is_drawn_again():
    """A memo entry under a chunk's key but of another shape (buckets cut otherwise than in the forward) is not used:
    the backward draws the chunk's own mask."""
    problem = Problem(2, 4, 2, 8, 8, 6, 5, True, None, None)
    opts = AttentionOptions(scale=0.5, dropout_p=0.3)
    like = torch.empty(2, 2, 2, 4, 5)  # (B, Hkv, G, rows, Sk)
    seed = DropoutSeed(7, 0, kept={(0, 0, 4): torch.ones(1, 4, 4, 5, dtype=torch.bool)})
    keep = torch_backend._chunk_keep(seed, problem, (0, 4), opts, like, 0, forward=False)
    drawn = keep_mask_block(7, 0, 2, 4, (0, 4), 5, 0.3).reshape(like.shape)
    assert torch.equal(keep, drawn.to(like.dtype) * dropout_keep_scale(0.3)) and seed.kept == {}


def test_cpu_backward_takes_the_forwards_probabilities(monkeypatch):
    """On the CPU a dropout forward keeps each chunk's probabilities for its backward, which then computes no scores
    and gives the gradients of a backward that computes them all again, bit for bit. Past ``KEPT_PROBS_BYTES`` the
    backward recomputes the chunks whose probabilities didn't fit; under a softcap (whose derivative needs the capped
    scores) it recomputes them all."""
    run, _, forward_calls = _kept_mask_call(monkeypatch)
    scores = record_calls(monkeypatch, torch_backend, "_scores")
    monkeypatch.setattr(torch_backend, "KEPT_PROBS_BYTES", -1)  # (none kept)
    out, grads, _, _ = run()
    chunks = len(scores) // 2  # (the forward's first, then the backward's)
    sizes = [s.numel() * s.element_size() for s, _ in scores[:chunks]]
    for budget in (2**40, sizes[0] + sizes[1] - 1):
        monkeypatch.setattr(torch_backend, "KEPT_PROBS_BYTES", budget)
        scores.clear()
        out_again, grads_again, _, _ = run()
        total = kept = 0
        for size in sizes:
            if total + size <= budget:
                total, kept = total + size, kept + 1
        assert kept == chunks if budget == 2**40 else 1 <= kept < chunks
        assert len(scores) == chunks + (chunks - kept) and forward_calls[-1][-1].kept == {}
        assert torch.equal(out, out_again)
        for a, b in zip(grads, grads_again, strict=True):
            assert torch.equal(a, b)
    x = varlen.jagged([torch.randn(n, 2, 8) for n in (5, 12)]).requires_grad_()
    scores.clear()
    out = varlen.attention(x, x, x, dropout_p=0.3, softcap=5.0, backend="torch")
    in_forward = len(scores)
    out.values.sum().backward()
    assert in_forward > 0 and len(scores) == 2 * in_forward


def test_no_memo_under_saved_tensor_hooks(monkeypatch):
    """Under activation checkpointing or ``save_on_cpu`` (saved-tensor hooks) a CPU dropout forward keeps no masks or
    probabilities for its backward, which would escape what the hooks do with its saved tensors; the gradients are
    those of a plain call."""
    calls = record_args(monkeypatch, torch_backend, "forward")
    q = varlen.jagged([torch.randn(n, 2, 8) for n in (3, 17, 9)]).requires_grad_()

    def attend():
        return varlen.attention(q, q, q, causal=True, dropout_p=0.3, backend="torch").values

    def grads(wrap):
        torch.manual_seed(1)  # (checkpointing restores the default generator, which draws the seed)
        calls.clear()
        grad = torch.autograd.grad(wrap().sum(), q.values)[0]
        return grad, [call[-1].kept for call in calls]

    plain, plain_memos = grads(attend)
    checkpointed, checkpointed_memos = grads(lambda: checkpoint(attend, use_reentrant=False))

    def offloaded():
        with torch.autograd.graph.save_on_cpu():
            return attend()

    offloaded_grad, offloaded_memos = grads(offloaded)
    assert plain_memos == [{}]  # (a memo, spent by the backward)
    assert len(checkpointed_memos) == 2 and all(memo is None for memo in checkpointed_memos + offloaded_memos)
    assert torch.equal(plain, checkpointed) and torch.equal(plain, offloaded_grad)
