"""The Hopper Gluon kernels (``varlen.attn.gluon``) against the float64 reference, on an sm_90 GPU.

Gluon doesn't run under the interpreter, so these run on the GPU only. The tests route each computation
through the Gluon kernel and through the Triton kernel it replaces (the launchers' ``gluon=True`` / ``False``)
and check which ran. Every variant they accept: fp16 and bf16, head dims 64 and 128 (and 40, 80 and 96, computed
in those tiles: ``gluon_common.tile_head_dim``), dense and jagged (lengths 0, 1, 17 and 1000 among others; for the
forward also queries and keys of different lengths, so that some queries see no key), GQA, no mask, causal in both
alignments, windows; both also with dropout (against the reference given the mask ``attention_dropout_mask``
reads); the forward in tiles of 64 also with three query warpgroups, the backward in tiles of 64 also with two key
blocks per program.
The forward also in tiles of 192 and 256 (head dims 136-256), the backward's dK and dV kernel past 128 in tiles of 192
and 256 (``gluon/backward_wide.py``, beside the Gluon dQ kernel, ``gluon/backward_dq.py``, or with dropout the Triton
one; both also for deterministic causal calls with a left window in tiles of 128), the backward in tiles of 64 and 128
also in deterministic mode under causal-like masks (its ordered dQ adds), all also with value head dims other than the
query's
(multi-head latent attention's 192 / 128 among them), and the Triton kernels at head dims 192 and 256 in their own
tuned tiles.
Flash-attn's rule: each output's error is at most twice that of the same math in PyTorch at the input
precision (plus a float32 rounding floor).
"""

import functools
import itertools
import zlib

import pytest
import torch

import varlen
from conftest import ON_GPU
from utils import record_calls
from varlen.attn import api, function
from varlen.attn.dropout import attention_dropout_mask, dropout_keep_mask, dropout_threshold
from varlen.attn.gluon import backward as gluon_backward
from varlen.attn.gluon import backward_dq as gluon_backward_dq
from varlen.attn.gluon import backward_wide as gluon_backward_wide
from varlen.attn.gluon import common as gluon_common
from varlen.attn.gluon import forward as gluon_forward
from varlen.attn.options import AttentionOptions, Problem
from varlen.attn.reference import attention_reference
from varlen.attn.triton import backend as triton_backend
from varlen.attn.triton import backward as triton_backward
from varlen.attn.triton import program

pytestmark = pytest.mark.gpu_only

MASKS = {
    "none": {}, "causal": dict(causal=True), "causal_bottom_right": dict(causal=True, align="bottom_right"),
    "window": dict(window=(50, 30)), "causal_window": dict(causal=True, window=(100, 0)),
    "window_left": dict(window=(50, None)),  # (a left band only: no right band, so no ALIGN_END with three warpgroups)
}
# (A right band only: the deterministic backward's tests; MASKS run everywhere.)
DETERMINISTIC_MASKS = {**MASKS, "right_window": dict(window=(None, 30))}
LENGTHS = [0, 1, 17, 1000, 300, 129]
KEY_LENGTHS = [5, 0, 40, 700, 301, 128]  # ("cross": keys of other lengths than the queries)


def _hopper() -> bool:
    return ON_GPU and torch.cuda.get_device_capability()[0] == 9 and gluon_backward.HAVE_GLUON


def _route(monkeypatch, kernel_module, kernel_launch, launcher, gluon):
    """Make the Triton backend's ``launcher`` run with ``gluon``; returns the list that records the launches of
    ``kernel_module.kernel_launch`` (the Gluon kernel's), one entry per launch."""
    launches = record_calls(monkeypatch, kernel_module, kernel_launch)
    monkeypatch.setattr(triton_backend, launcher, functools.partial(getattr(triton_backend, launcher), gluon=gluon))
    return launches


@pytest.fixture(params=["gluon", "triton"])
def backward_kernel(request, monkeypatch):
    """Route the Triton backend's backward through one kernel: the Gluon one, or the Triton one (which the
    Gluon kernel replaces wherever it applies, so these shapes test it here); count the Gluon kernel's
    launches."""
    return request.param, _route(monkeypatch, gluon_backward, "launch_kv", "launch_backward", request.param == "gluon")


@pytest.fixture(params=["gluon", "triton"])
def forward_kernel(request, monkeypatch):
    """Route the Triton backend's forward through one kernel: the Gluon one, or the Triton one (which the
    Gluon kernel replaces wherever it applies, so these shapes test it here); count the Gluon
    kernel's launches."""
    return request.param, _route(monkeypatch, gluon_forward, "launch", "launch_forward", request.param == "gluon")


def _inputs(layout, dtype, heads, kv_heads, D, generator, DV=None):
    """q, k and v (v of head dim ``DV``, by default ``D``) in ``layout``."""
    DV = D if DV is None else DV

    def rand(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float32).to(dtype)

    if layout == "dense":
        return rand(2, 1000, heads, D), rand(2, 1000, kv_heads, D), rand(2, 1000, kv_heads, DV)
    if layout == "dense_tiles":  # whole tiles, fewer queries than keys: the backward's descriptors made on the host
        return rand(2, 512, heads, D), rand(2, 1024, kv_heads, D), rand(2, 1024, kv_heads, DV)
    if layout == "dense_batch":  # five sequences, a partial last tile (296 = 4 x 64 + 40) and key block; keys a
        # multiple of 8 (a bias's rows: gluon_backward.bias_aligned)
        return rand(5, 296, heads, D), rand(5, 296, kv_heads, D), rand(5, 296, kv_heads, DV)
    key_lengths = KEY_LENGTHS if layout == "cross" else LENGTHS
    return (varlen.jagged([rand(L, heads, D) for L in LENGTHS]),
            *(varlen.jagged([rand(L, kv_heads, dim) for L in key_lengths]) for dim in (D, DV)))


def _to(t, device, dtype):
    if isinstance(t, varlen.JaggedTensor):
        return varlen.JaggedTensor(t.values.to(device, dtype), t.offsets.to(device), t.max_len)
    return t.to(device, dtype)


def _values(t):
    return t.values if isinstance(t, varlen.JaggedTensor) else t


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("layout", ["dense", "jagged", "cross"])
@pytest.mark.parametrize("D", gluon_common.TILE_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_kernels_match_reference(forward_kernel, dtype, D, layout, heads, kv_heads, mask):
    g = torch.Generator().manual_seed(zlib.crc32(f"fwd {dtype} {D} {layout} {heads} {mask}".encode()))
    kernel, gluon_launches = forward_kernel
    _check_forward(*_inputs(layout, dtype, heads, kv_heads, D, g), MASKS[mask], dtype)
    assert bool(gluon_launches) == (kernel == "gluon"), f"the {kernel} kernel did not run"


# Dropout cases: (p, the generator's Philox offset). A fresh generator's offset is 0; the other one sets both of the
# offset's words, which the kernels take apart (the low word a counter, the high word folded into the key).
DROPOUTS = [(0.17, 0), (0.9, 2**32 + 2**31 + 4)]


def _draws(offset, g):
    """The CUDA generator a call draws its dropout seed from (seeded from ``g``), at Philox offset ``offset``."""
    draws = torch.Generator(device="cuda").manual_seed(int(torch.randint(2**62, (), generator=g)))
    draws.set_offset(offset)
    return draws


def _reference_dropout(q, k, dtype, dropout_p, draws) -> dict:
    """The reference's options for the mask a call with ``dropout_p`` will draw from ``draws``
    (``attention_dropout_mask`` leaves the generator alone)."""
    if not dropout_p:
        return {}
    mask = attention_dropout_mask(_to(q, "cuda", dtype), _to(k, "cuda", dtype), dropout_p, generator=draws)
    return dict(dropout_mask=mask, dropout_p=dropout_p)


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("dropout_p,offset", DROPOUTS)
@pytest.mark.parametrize("mask", ["none", "causal_bottom_right", "causal_window"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("layout", ["dense", "jagged", "cross"])
@pytest.mark.parametrize("D", gluon_common.TILE_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_kernels_with_dropout_match_reference(forward_kernel, dtype, D, layout, heads, kv_heads, mask,
                                                      dropout_p, offset):
    # The Gluon kernel draws the mask itself (gluon/dropout.py), bit for bit the one attention_dropout_mask gives.
    g = torch.Generator().manual_seed(zlib.crc32(f"fwd {dtype} {D} {layout} {heads} {mask} {dropout_p}".encode()))
    kernel, gluon_launches = forward_kernel
    _check_forward(*_inputs(layout, dtype, heads, kv_heads, D, g), MASKS[mask], dtype, dropout_p,
                   _draws(offset, g))
    assert bool(gluon_launches) == (kernel == "gluon"), f"the {kernel} kernel did not run"


def _launch_arguments(monkeypatch, module, kernel_name, *names) -> tuple[list, ...]:
    """The keyword arguments ``names`` of every launch of ``module.kernel_name`` from now on (it keeps running), one
    list per name."""
    kernel, taken = getattr(module, kernel_name), tuple([] for _ in names)

    class Recorded:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                for name, values in zip(names, taken, strict=True):
                    values.append(kwargs[name])
                return kernel[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(module, kernel_name, Recorded())
    return taken


def _forward_warpgroups(monkeypatch) -> tuple[list, list]:
    """The query warpgroups (``WGS``) and ``ALIGN_END`` of every launch of the Gluon forward kernel from now on."""
    return _launch_arguments(monkeypatch, gluon_forward, "_attn_fwd_hopper", "WGS", "ALIGN_END")


@pytest.fixture
def three_query_warpgroups(monkeypatch):
    """Route the Triton backend's forward through the Gluon kernel with three query warpgroups (192-query blocks)
    whatever the call: the automatic rule takes them only at D64 without dropout, on long sequences
    (``gluon_forward.query_warpgroups``), but the kernel computes every variant with them. Returns the warpgroups of
    each of the kernel's launches and their ``ALIGN_END``, two lists."""
    _route(monkeypatch, gluon_forward, "launch", "launch_forward", True)
    monkeypatch.setattr(gluon_forward, "query_warpgroups", lambda *args: 3)
    return _forward_warpgroups(monkeypatch)


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("layout", ["dense", "jagged", "cross"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_three_query_warpgroups_match_reference(three_query_warpgroups, dtype, layout, heads, kv_heads,
                                                        mask):
    # D64 (160 registers a warpgroup: D128 doesn't fit). The lengths leave blocks with one or two warpgroups' rows
    # past the end (1000 = 5 x 192 + 40; 17, 129, 300), whose warpgroups only pass the tiles on; under causal-like
    # masks before the start (the blocks end at the sequence's end, ALIGN_END), and warpgroups of a block skip
    # different numbers of its last tiles.
    g = torch.Generator().manual_seed(zlib.crc32(f"fwd3 {dtype} {layout} {heads} {mask}".encode()))
    _check_forward(*_inputs(layout, dtype, heads, kv_heads, 64, g), MASKS[mask], dtype)
    taken, aligned_end = three_query_warpgroups
    assert taken and set(taken) == {3}
    assert set(aligned_end) == {mask not in ("none", "window_left")}  # (the masks with a right band)


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("dropout_p,offset", DROPOUTS)
@pytest.mark.parametrize("mask", ["none", "causal_bottom_right"])
@pytest.mark.parametrize("layout", ["dense", "jagged", "cross"])
def test_forward_three_query_warpgroups_with_dropout_match_reference(three_query_warpgroups, layout, mask, dropout_p,
                                                                     offset):
    g = torch.Generator().manual_seed(zlib.crc32(f"fwd3 {layout} {mask} {dropout_p}".encode()))
    _check_forward(*_inputs(layout, torch.bfloat16, 8, 2, 64, g), MASKS[mask], torch.bfloat16, dropout_p,
                   _draws(offset, g))
    taken, aligned_end = three_query_warpgroups  # (no ALIGN_END: the draws take rows in pairs from an even row)
    assert taken and set(taken) == {3} and set(aligned_end) == {False}


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("layout,lengths,mask,warpgroups", [
    ("dense", [2100], "none", 3), ("dense", [2100], "causal", 2), ("dense", [4200], "causal", 3),
    ("jagged", [300, 2100, 5], "none", 3), ("jagged", [300, 2100, 5], "causal", 2),
    ("jagged", [4300, 4200], "causal_bottom_right", 3), ("jagged", [4300, 4200], "causal_window", 2),
])
def test_gluon_forward_takes_three_query_warpgroups_on_long_d64_inputs(monkeypatch, layout, lengths, mask, warpgroups):
    """The automatic choice reaches the kernel: three at D64 without a mask from 2048 queries, under a causal one from
    a mean length of 4096 (the blocks then end at the sequence's end), two under a causal window."""
    _route(monkeypatch, gluon_forward, "launch", "launch_forward", True)
    # Six programs: the dense shapes' 192-query items keep them within 4% as busy as 128-query ones (the rule's bound).
    monkeypatch.setattr(gluon_forward, "sm_count", lambda device: 6)
    taken, aligned_end = _forward_warpgroups(monkeypatch)
    g = torch.Generator().manual_seed(zlib.crc32(f"fwd3 auto {layout} {lengths} {mask}".encode()))
    if layout == "dense":
        q, k, v = (torch.randn(1, lengths[0], 2, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    else:
        q, k, v = (varlen.jagged([torch.randn(L, 2, 64, generator=g).to(torch.bfloat16) for L in lengths])
                   for _ in range(3))
    _check_forward(q, k, v, MASKS[mask], torch.bfloat16)
    assert taken == [warpgroups]
    assert aligned_end == [warpgroups == 3 and mask != "none"]


# Head dims below their tile's (gluon_common.tile_head_dim): 40 in tiles of 64; 72 (whose second 64-column TMA copy
# holds 8 of the head's columns), 80 and 96 in tiles of 128; read through 3-D descriptors whose boxes fill the columns
# past the head with zeros and clip the stores there.
PADDED_HEAD_DIMS = (40, 72, 80, 96)
# ... and past 128, the forward's tiles of 192 (parts of 128 and 64 columns) and 256 (keys in tiles of 64, the output
# stored from registers; gluon_common.wide_tile_head_dim): 192 and 256, and 136 and 200 with their heads padded in
# them (136's second part all zeros read past the head).
LARGE_FORWARD_HEAD_DIMS = (136, 192, 200, 256)


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("mask", ["none", "causal", "causal_bottom_right", "window"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("layout", ["dense", "jagged", "cross"])
@pytest.mark.parametrize("D", PADDED_HEAD_DIMS + LARGE_FORWARD_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_padded_head_dims_match_reference(monkeypatch, dtype, D, layout, heads, kv_heads, mask):
    launches = _route(monkeypatch, gluon_forward, "launch", "launch_forward", True)
    # (past 128 with the seeds these inputs had when they ran on the GPU as a test of their own)
    name = "fwd large" if D > 128 else "fwd pad"
    g = torch.Generator().manual_seed(zlib.crc32(f"{name} {dtype} {D} {layout} {heads} {mask}".encode()))
    _check_forward(*_inputs(layout, dtype, heads, kv_heads, D, g), MASKS[mask], dtype)
    assert launches, "the Gluon kernel did not run"


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("D,warpgroups,dropout_p", [(40, 3, 0.0), (40, 2, 0.17), (96, 2, 0.17), (80, 2, 0.9)])
@pytest.mark.parametrize("layout", ["dense", "jagged"])
def test_forward_padded_head_dims_other_forms_match_reference(monkeypatch, D, warpgroups, dropout_p, layout):
    # Three query warpgroups (a tile of 64) and dropout with the padded tiles.
    _route(monkeypatch, gluon_forward, "launch", "launch_forward", True)
    monkeypatch.setattr(gluon_forward, "query_warpgroups", lambda *args: warpgroups)
    taken, _ = _forward_warpgroups(monkeypatch)
    g = torch.Generator().manual_seed(zlib.crc32(f"fwd pad {D} {warpgroups} {dropout_p} {layout}".encode()))
    _check_forward(*_inputs(layout, torch.bfloat16, 8, 2, D, g), MASKS["causal_bottom_right"], torch.bfloat16,
                   dropout_p, _draws(0, g))
    assert taken == [warpgroups]


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("mask", ["none", "causal", "causal_window"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("layout", ["dense", "dense_tiles", "jagged"])
@pytest.mark.parametrize("D", PADDED_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_padded_head_dims_match_reference(monkeypatch, dtype, D, layout, heads, kv_heads, mask):
    # Descriptors made by the programs (dense, jagged) and on the host (dense_tiles).
    launches = _route(monkeypatch, gluon_backward, "launch_kv", "launch_backward", True)
    host_descriptors = record_calls(monkeypatch, gluon_backward, "host_descriptors")
    _check_backward(("gluon", launches), dtype, D, layout, heads, kv_heads, mask)
    assert [d is not None for d in host_descriptors] == [layout == "dense_tiles"]


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("D,paired,dropout_p,bias", [
    (40, True, 0.0, None), (40, False, 0.17, None), (96, None, 0.9, None), (40, None, 0.0, "1HQK"),
    (96, None, 0.0, "1HQK"), (96, None, 0.0, "BHQK"),
])
@pytest.mark.parametrize("layout", ["dense", "dense_tiles", "jagged"])
def test_backward_padded_head_dims_other_forms_match_reference(monkeypatch, D, paired, dropout_p, bias, layout):
    # Two key blocks per program (forced), dropout and biases (the first sequence's stores, dense 1HQK at 40).
    launches = _route(monkeypatch, gluon_backward, "launch_kv", "launch_backward", True)
    if paired is not None:
        monkeypatch.setattr(gluon_backward, "pairs", lambda *args: paired)
    _check_backward(("gluon", launches), torch.bfloat16, D, layout, 8, 2, "causal", dropout_p, bias=bias)


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("D", [24, 32, 36, 136, 256])
def test_gluon_kernels_take_only_the_head_dims_their_tiles_hold(monkeypatch, D):
    # No tile of 64 or 128 holds these, or (32) the Triton kernels are faster (gluon_common.tile_head_dim); the forward
    # takes 136 and 256 in its tiles of 192 and 256 (gluon_common.wide_tile_head_dim), and so does the backward's dK and
    # dV kernel.
    # With the Gluon kernels allowed, the Triton ones run where they don't.
    forward = _route(monkeypatch, gluon_forward, "launch", "launch_forward", True)
    backward = _route(monkeypatch, gluon_backward, "launch_kv", "launch_backward", True)
    wide = record_calls(monkeypatch, gluon_backward_wide, "launch_kv")
    q, k, v = (torch.randn(2, 200, 4, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    varlen.attention(q, k, v, causal=True).sum().backward()
    assert gluon_common.tile_head_dim(D) is None
    assert bool(forward) == (D > 128), f"the Gluon forward ran at D{D}, or did not"
    assert not backward, f"the Gluon backward in tiles of 64 or 128 ran at D{D}"
    assert bool(wide) == (D > 128), f"the Gluon backward past 128 ran at D{D}, or did not"


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("mask", ["none", "causal", "causal_bottom_right", "window", "causal_window"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("layout", ["dense", "dense_tiles", "jagged", "cross"])
@pytest.mark.parametrize("D", [136, 192, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wide_backward_matches_reference(monkeypatch, dtype, D, layout, heads, kv_heads, mask):
    # dK and dV in tiles of 192 and 256 (D136 with its head padded in a tile of 192), dQ by the Gluon dQ kernel;
    # descriptors made by the programs (dense, jagged, cross: keys of other lengths, some sequences without queries or
    # keys) and on the host (dense_tiles).
    launches = _route(monkeypatch, gluon_backward_wide, "launch_kv", "launch_backward", True)
    host_descriptors = record_calls(monkeypatch, gluon_backward_wide, "host_descriptors")
    dq_launches = record_calls(monkeypatch, gluon_backward_dq, "launch")
    _check_backward(("gluon", launches), dtype, D, layout, heads, kv_heads, mask)
    assert [d is not None for d in host_descriptors] == [layout == "dense_tiles"]
    assert len(dq_launches) == 1, "the Gluon dQ kernel did not run"


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("dropout_p,offset", DROPOUTS)
@pytest.mark.parametrize("mask", ["none", "causal", "causal_window"])
@pytest.mark.parametrize("layout", ["dense", "dense_tiles", "jagged"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wide_backward_with_dropout_matches_reference(monkeypatch, dtype, layout, mask, dropout_p, offset):
    # The score warpgroup draws the mask of each 64 x 64 tile (gluon/dropout.py's backward tile), bit for bit the one
    # attention_dropout_mask gives; the Triton dQ kernel draws its own (the Gluon dQ kernel takes no dropout).
    launches = _route(monkeypatch, gluon_backward_wide, "launch_kv", "launch_backward", True)
    dq_launches = record_calls(monkeypatch, gluon_backward_dq, "launch")
    _check_backward(("gluon", launches), dtype, 256, layout, 8, 2, mask, dropout_p, offset)
    assert not dq_launches, "the Gluon dQ kernel took dropout"


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("dropout_p,offset", DROPOUTS + [(0.5, 8)])
def test_wide_backward_draws_the_mask_exactly(monkeypatch, dropout_p, offset):
    # As test_kernels_draw_the_mask_exactly, in tiles of 256: dV shows each keep bit.
    launches = _route(monkeypatch, gluon_backward_wide, "launch_kv", "launch_backward", True)
    q, k, v, dout, draws, keep = _mask_revealing_inputs(256, dropout_p, offset, seed=256 + offset)
    (dv,) = torch.autograd.grad(varlen.attention(q, k, v, dropout_p=dropout_p, generator=draws), (v,), dout)
    assert launches, "the Gluon backward in tiles of 256 did not run"
    assert torch.equal(dv.float().permute(0, 2, 3, 1) > 0, keep)


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("layout", ["dense", "jagged"])
def test_wide_backward_is_deterministic(monkeypatch, layout):
    # dK and dV stored, not added, and dQ from the Gluon dQ kernel: deterministic mode takes the kernels, and two
    # calls agree bit for bit.
    launches = record_calls(monkeypatch, gluon_backward_wide, "launch_kv")
    g = torch.Generator().manual_seed(zlib.crc32(f"wide deterministic {layout}".encode()))
    q, k, v = (_to(t, "cuda", torch.bfloat16) for t in _inputs(layout, torch.bfloat16, 8, 2, 256, g))
    leaves = [_values(t).requires_grad_() for t in (q, k, v)]
    dout = torch.randn(_values(q).shape, generator=g).to("cuda", torch.bfloat16)
    grads = [torch.autograd.grad(_values(varlen.attention(q, k, v, causal=True, deterministic=True)), leaves, dout)
             for _ in range(2)]
    assert len(launches) == 2, "the Gluon backward past 128 did not take deterministic calls"
    for first, second in zip(*grads, strict=True):
        assert torch.equal(first, second)


# Value head dims other than the query's (gluon_common.wide_tile_head_dims and wide_tile_head_dims): multi-head
# latent attention's 192 / 128 (DeepSeek-V2 and V3), 256 / 128, 192 / 64 (128-key tiles, the output staged in a tile of
# its own), heads below their tiles (136 / 96 and 200 / 40, through 3-D descriptors), tiles of 128 and 64 either way
# round and two head dims in one tile of 128 (the forward only: the backward's tiles of 64 and 128 take D = Dv alone).
VALUE_HEAD_DIMS = [(192, 128), (256, 128), (192, 64), (136, 96), (200, 40), (128, 64), (64, 128), (96, 80)]


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("mask", ["none", "causal", "causal_bottom_right", "window"])
@pytest.mark.parametrize("layout", ["dense", "jagged", "cross"])
@pytest.mark.parametrize("D,DV", VALUE_HEAD_DIMS)
def test_forward_value_head_dims_match_reference(monkeypatch, D, DV, layout, mask):
    launches = _route(monkeypatch, gluon_forward, "launch", "launch_forward", True)
    g = torch.Generator().manual_seed(zlib.crc32(f"fwd dv {D} {DV} {layout} {mask}".encode()))
    _check_forward(*_inputs(layout, torch.bfloat16, 8, 2, D, g, DV), MASKS[mask], torch.bfloat16)
    assert launches, "the Gluon kernel did not run"


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("D,DV,dropout_p,mask", [(192, 128, 0.0, "none"), (192, 128, 0.0, "causal"),
                                                 (128, 64, 0.17, "causal_bottom_right"), (64, 128, 0.9, "none")])
@pytest.mark.parametrize("layout", ["dense", "jagged"])
def test_forward_value_head_dims_in_fp16_and_with_dropout_match_reference(monkeypatch, D, DV, dropout_p, mask, layout):
    # fp16 without GQA, and dropout where both tiles are at most 128 (128-key tiles: gluon_forward.block_keys).
    launches = _route(monkeypatch, gluon_forward, "launch", "launch_forward", True)
    g = torch.Generator().manual_seed(zlib.crc32(f"fwd dv fp16 {D} {DV} {dropout_p} {layout} {mask}".encode()))
    _check_forward(*_inputs(layout, torch.float16, 4, 4, D, g, DV), MASKS[mask], torch.float16, dropout_p,
                   _draws(0, g))
    assert launches, "the Gluon kernel did not run"


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("mask", ["none", "causal", "causal_window"])
@pytest.mark.parametrize("layout", ["dense", "dense_tiles", "jagged", "cross"])
@pytest.mark.parametrize("D,DV", [dims for dims in VALUE_HEAD_DIMS if dims[0] > 128])
def test_wide_backward_value_head_dims_match_reference(monkeypatch, D, DV, layout, mask):
    # dK in tiles of 192 or 256, dV in V's own tile (descriptors made by the programs and on the host), dQ by the Gluon
    # dQ kernel.
    launches = _route(monkeypatch, gluon_backward_wide, "launch_kv", "launch_backward", True)
    host_descriptors = record_calls(monkeypatch, gluon_backward_wide, "host_descriptors")
    dq_launches = record_calls(monkeypatch, gluon_backward_dq, "launch")
    _check_backward(("gluon", launches), torch.bfloat16, D, layout, 8, 2, mask, DV=DV)
    assert [d is not None for d in host_descriptors] == [layout == "dense_tiles"]
    assert len(dq_launches) == 1, "the Gluon dQ kernel did not run"


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("dtype,dropout_p,offset", [(torch.float16, 0.0, 0), (torch.bfloat16, *DROPOUTS[1])])
@pytest.mark.parametrize("layout", ["dense", "jagged"])
def test_wide_backward_value_head_dims_in_fp16_and_with_dropout_match_reference(monkeypatch, dtype, dropout_p, offset,
                                                                               layout):
    launches = _route(monkeypatch, gluon_backward_wide, "launch_kv", "launch_backward", True)
    _check_backward(("gluon", launches), dtype, 192, layout, 4, 4, "causal", dropout_p, offset, DV=128)


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("D,DV", [(192, 192), (192, 128), (256, 256)])
@pytest.mark.parametrize("programs", [1, 5])
@pytest.mark.parametrize("mask", ["none", "causal", "causal_bottom_right", "causal_window"])
@pytest.mark.parametrize("layout", ["dense", "jagged", "cross"])
def test_wide_backward_dq_persistent_programs(monkeypatch, layout, mask, programs, D, DV):
    """The Gluon dQ kernel's persistent schedule (the forward's) with few programs, each walking many work items (ring
    positions and Q's blocks carried across items, items past a sequence's end and items that see no key in
    between), in tiles of 192 with V's of 192 and 128, and of 256 (32-key tiles): as the float64 reference."""
    launches = _route(monkeypatch, gluon_backward_wide, "launch_kv", "launch_backward", True)
    monkeypatch.setattr(gluon_backward_dq, "sm_count", lambda device: programs)
    dq_launches = record_calls(monkeypatch, gluon_backward_dq, "launch")
    _check_backward(("gluon", launches), torch.bfloat16, D, layout, 8, 2, mask, DV=None if DV == D else DV)
    assert len(dq_launches) == 1, "the Gluon dQ kernel did not run"


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("layout", ["dense", "dense_tiles", "jagged", "cross"])
@pytest.mark.parametrize("D", [96, 128])
def test_deterministic_causal_window_backward_in_tiles_of_128_matches_reference(monkeypatch, D, layout):
    # Deterministic causal calls with a left window, which backward.py's kernel leaves (its ordered dQ adds need
    # none), in tiles of 128 (D96 padded): dK and dV stored by backward_wide.py's kernel, dQ by the Gluon dQ kernel.
    mask = "causal_window"
    launches = _route(monkeypatch, gluon_backward_wide, "launch_kv", "launch_backward", True)
    dq_launches = record_calls(monkeypatch, gluon_backward_dq, "launch")
    _check_backward(("gluon", launches), torch.bfloat16, D, layout, 8, 2, mask, deterministic=True)
    assert len(dq_launches) == 1, "the Gluon dQ kernel did not run"


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("D,mask", [(64, "window_left"), (128, "window"), (64, "causal_window")])
def test_deterministic_backward_elsewhere_keeps_the_triton_kernels(monkeypatch, D, mask):
    # A left window, which backward.py's ordered dQ adds don't take, where the stored Gluon kernels measured slower
    # than the Triton ones (bench/NOTES.md): D64, and D128 without a causal mask.
    launches = _route(monkeypatch, gluon_backward_wide, "launch_kv", "launch_backward", True)
    kv_launches = record_calls(monkeypatch, gluon_backward, "launch_kv")
    _check_backward(("triton", launches), torch.bfloat16, D, "jagged", 8, 2, mask, deterministic=True)
    assert not kv_launches


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("D", [64, 128])
def test_deterministic_backward_without_a_mask_repeats_bit_for_bit_at_16k_keys(monkeypatch, D):
    # Without a mask each query tile of a 16k-key sequence takes 128 key blocks' adds, each block waiting for the one
    # after it (the whole sequence in one chain): three calls agree bit for bit (the reference: the tests below).
    launches = record_calls(monkeypatch, gluon_backward, "launch_kv")
    g = torch.Generator().manual_seed(zlib.crc32(f"unmasked deterministic {D}".encode()))

    def rand(*shape):
        return torch.randn(*shape, generator=g).to("cuda", torch.bfloat16)

    q, k, v = (varlen.jagged([rand(L, heads, D) for L in (16384, 33)]) for heads in (4, 2, 2))
    grads = _repeated_grads(q, k, v, rand(*_values(q).shape), 3, 0.0, g)
    assert len(launches) == 3, "the Gluon backward did not take deterministic calls without a mask"
    for run in grads[1:]:
        for first, again in zip(grads[0], run, strict=True):
            assert torch.equal(first, again)


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("mask", ["none", "causal", "causal_bottom_right", "right_window"])
@pytest.mark.parametrize("layout", ["dense", "dense_tiles", "dense_batch", "jagged", "cross"])
@pytest.mark.parametrize("D", [40, 64, 96, 128])
def test_deterministic_backward_matches_reference(monkeypatch, D, layout, mask):
    # backward.py's kernel in deterministic mode (DET: each query tile's dQ adds in a fixed order, its last key block
    # first), without a mask and under causal-like masks, GQA 8/2.
    launches = _route(monkeypatch, gluon_backward, "launch_kv", "launch_backward", True)
    _check_backward(("gluon", launches), torch.bfloat16, D, layout, 8, 2, mask, deterministic=True)


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("D", [64, 96, 128])
@pytest.mark.parametrize("lengths", [[1] * 5, [1, 17, 0, 70]], ids=["one-row", "jagged"])
@pytest.mark.parametrize("scale", [1.0, -1.0])
def test_backward_keys_past_the_end_where_the_lse_is_far_below_zero(monkeypatch, scale, lengths, D, dtype,
                                                                    deterministic):
    """Unmasked calls whose last key block runs past the sequence's end, with a query whose scores (so its lse) lie far
    below 0: the keys past the end are zero rows of K, their score 0 and P = exp(-lse), whose dS overflowed its 16-bit
    form (inf in fp16 at an lse below about -11; inf in float32 below -88) and made NaN in dQ (stop 59's GPU fuzz: D96,
    fp16, deterministic, sequences of one key; the Triton kernels mask those keys). Sequence 0's first query and key
    score -100 here; the loss also takes the lse. A negative scale too: the lean form (D96, D128) starts those keys'
    products at +inf there, in units of S."""
    launches = _route(monkeypatch, gluon_backward, "launch_kv", "launch_backward", True)
    g = torch.Generator().manual_seed(zlib.crc32(f"past the end {lengths} {D} {dtype} {deterministic}".encode()))
    dense = len(set(lengths)) == 1
    rows = (len(lengths), lengths[0]) if dense else (sum(lengths),)
    q, k, v = (torch.randn(*rows, heads, D, generator=g) for heads in (4, 2, 2))
    first = (0, 0) if dense else (0,)
    direction = torch.randn(D, generator=g)
    direction *= 10 / direction.norm()  # (a score of -100 for query 0 and key 0 of sequence 0, head 0)
    q[first + (0,)] = direction
    k[first + (0,)] = -scale * direction
    q, k, v = (t.to("cuda", dtype) for t in (q, k, v))
    dout = torch.randn(*rows, 4, D, generator=g).cuda()
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], device="cuda")

    def grads(compute_dtype, run):
        leaves = [t.to(compute_dtype).requires_grad_(True) for t in (q, k, v)]
        inputs = leaves if dense else [varlen.JaggedTensor(t, offsets) for t in leaves]
        out, lse = run(*inputs)
        dlse = torch.linspace(-1, 1, lse.numel(), device="cuda").view(lse.shape)
        out = out if dense else out.values
        loss = (out.double() * dout.double()).sum() + (torch.where(torch.isfinite(lse), lse, 0).double() * dlse).sum()
        return torch.autograd.grad(loss, leaves)

    ref = grads(torch.float64, lambda a, b, c: attention_reference(a, b, c, scale=scale))
    low = grads(dtype, lambda a, b, c: attention_reference(a, b, c, scale=scale))
    got = grads(dtype, lambda a, b, c: varlen.attention(a, b, c, scale=scale, deterministic=deterministic,
                                                       return_lse=True))
    assert launches, "the Gluon backward did not run"
    for name, x, lo, r in zip(("dq", "dk", "dv"), got, low, ref, strict=True):
        assert torch.isfinite(x).all(), f"{name}: not finite at {(~torch.isfinite(x)).nonzero().tolist()}"
        err = (x.double() - r).abs().max().item()
        allowed = 2 * (lo.double() - r).abs().max().item() + 1e-5 * r.abs().max().item()
        assert err <= allowed, f"{name}: error {err:.3e} > {allowed:.3e} (2x PyTorch's at {dtype})"


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("case", [
    (torch.float16, "jagged", 4, "causal", 0.0, None), (torch.bfloat16, "dense", 4, "causal", 0.17, None),
    (torch.bfloat16, "jagged", 2, "causal", 0.17, None), (torch.bfloat16, "dense_batch", 4, "right_window", 0.17, None),
    (torch.float16, "dense", 8, "causal_bottom_right", 0.0, None), (torch.bfloat16, "jagged", 4, "none", 0.17, None),
    (torch.float16, "cross", 8, "none", 0.0, None),
    # (with a bias, the Triton kernels: the dQ writer shares the bias gradient's staging buffers)
    (torch.bfloat16, "dense_batch", 4, "causal", 0.0, "BHQK"), (torch.bfloat16, "jagged", 4, "causal", 0.0, "1HQK"),
])
@pytest.mark.parametrize("D", [64, 128])
def test_deterministic_backward_with_dropout_biases_and_fp16_matches_reference(monkeypatch, D, case):
    # (dtype, layout, kv heads of 8, mask, dropout, bias): DET beside dropout, MHA and GQA, in fp16; with a bias the
    # Triton kernels, a full bias's gradient stored and a broadcast one's recomputed (_bwd_dbias_kernel, fixed order).
    dtype, layout, kv_heads, mask, dropout_p, bias = case
    launches = _route(monkeypatch, gluon_backward, "launch_kv", "launch_backward", True)
    kernel = "gluon" if bias is None else "triton"
    _check_backward((kernel, launches), dtype, D, layout, 8, kv_heads, mask, dropout_p=dropout_p, bias=bias,
                    deterministic=True)


def _repeated_grads(q, k, v, dout, runs, dropout_p, g, **opts):
    """The gradients of ``q``, ``k`` and ``v``'s values from ``runs`` deterministic calls with ``opts``, each drawing
    its dropout mask (with ``dropout_p``) from the same seed."""
    leaves = [_values(t).requires_grad_() for t in (q, k, v)]
    grads = []
    for _ in range(runs):
        draws = _draws(0, g) if dropout_p else None
        if draws is not None:
            draws.manual_seed(7)
        out = varlen.attention(q, k, v, deterministic=True, dropout_p=dropout_p, generator=draws, **opts)
        grads.append(torch.autograd.grad(_values(out), leaves, dout))
    return grads


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("D,mask,dropout_p", [(64, "causal", 0.0), (64, "causal_bottom_right", 0.17),
                                              (128, "causal", 0.0), (128, "right_window", 0.17),
                                              (96, "causal_bottom_right", 0.0), (64, "none", 0.0),
                                              (128, "none", 0.17)])
@pytest.mark.parametrize("layout", ["dense", "jagged"])
def test_deterministic_backward_repeats_bit_for_bit(monkeypatch, D, mask, dropout_p, layout):
    # Many key blocks adding into each query tile (up to 32), run three times: the same bits each time.
    launches = record_calls(monkeypatch, gluon_backward, "launch_kv")
    g = torch.Generator().manual_seed(zlib.crc32(f"ordered dq {D} {mask} {dropout_p} {layout}".encode()))

    def rand(*shape):
        return torch.randn(*shape, generator=g).to("cuda", torch.bfloat16)

    if layout == "dense":
        q, k, v = rand(2, 2048, 8, D), rand(2, 2048, 2, D), rand(2, 2048, 2, D)
    else:
        lengths = [4096, 1000, 17, 0, 2500]
        q, k, v = (varlen.jagged([rand(L, heads, D) for L in lengths]) for heads in (8, 2, 2))
    grads = _repeated_grads(q, k, v, rand(*_values(q).shape), 3, dropout_p, g, **DETERMINISTIC_MASKS[mask])
    assert len(launches) == 3, "the Gluon backward did not take deterministic calls"
    for run in grads[1:]:
        for first, again in zip(grads[0], run, strict=True):
            assert torch.equal(first, again)


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("D,dropout_p", [(128, 0.0), (128, 0.17)])
def test_deterministic_causal_window_backward_in_tiles_of_128_repeats_bit_for_bit(monkeypatch, D, dropout_p):
    # (with dropout the Triton dQ kernel, beside the stored dK and dV)
    launches = record_calls(monkeypatch, gluon_backward_wide, "launch_kv")
    dq_launches = record_calls(monkeypatch, gluon_backward_dq, "launch")
    g = torch.Generator().manual_seed(zlib.crc32(f"deterministic {D} {dropout_p}".encode()))
    q, k, v = (_to(t, "cuda", torch.bfloat16) for t in _inputs("jagged", torch.bfloat16, 8, 2, D, g))
    dout = torch.randn(_values(q).shape, generator=g).to("cuda", torch.bfloat16)
    grads = _repeated_grads(q, k, v, dout, 2, dropout_p, g, **MASKS["causal_window"])
    assert len(launches) == 2 and len(dq_launches) == (0 if dropout_p else 2)
    for first, second in zip(*grads, strict=True):
        assert torch.equal(first, second)


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
def test_wide_backward_value_head_dims_are_deterministic(monkeypatch):
    launches = record_calls(monkeypatch, gluon_backward_wide, "launch_kv")
    g = torch.Generator().manual_seed(zlib.crc32(b"wide deterministic dv"))
    q, k, v = (_to(t, "cuda", torch.bfloat16) for t in _inputs("jagged", torch.bfloat16, 8, 2, 192, g, 128))
    leaves = [_values(t).requires_grad_() for t in (q, k, v)]
    dout = torch.randn(*_values(q).shape[:-1], 128, generator=g).to("cuda", torch.bfloat16)
    grads = [torch.autograd.grad(_values(varlen.attention(q, k, v, causal=True, deterministic=True)), leaves, dout)
             for _ in range(2)]
    assert len(launches) == 2, "the Gluon backward past 128 did not take deterministic calls"
    for first, second in zip(*grads, strict=True):
        assert torch.equal(first, second)


# The Triton kernels' backward past 128, in their tiles 256 wide (configs.HEAD256_SWEEP: 64-key blocks and a separate
# dQ kernel of 128-query blocks without a bias or dropout; the smallest tiles with one), D192 with its head padded in
# them: the path of every GPU but Hopper's, and of Hopper's with a bias or dropout (here routed there in every case);
# the forward with them where the Gluon forward declines (dropout, a bias). (mask, dropout, bias) per case.
LARGE_HEAD_DIM_CASES = [("none", 0.0, None), ("causal", 0.0, None), ("causal_bottom_right", 0.0, None),
                        ("window", 0.0, None), ("causal", 0.17, None), ("causal", 0.0, "1HQK"), ("none", 0.0, "BHQK")]


@pytest.mark.parametrize("mask,dropout_p,bias", LARGE_HEAD_DIM_CASES)
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("layout", ["dense", "jagged"])
@pytest.mark.parametrize("D", [192, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_large_head_dims_match_reference(monkeypatch, dtype, D, layout, heads, kv_heads, mask, dropout_p, bias):
    forward = _route(monkeypatch, gluon_forward, "launch", "launch_forward", True)
    backward = _route(monkeypatch, gluon_backward_wide, "launch_kv", "launch_backward", False)
    g = torch.Generator().manual_seed(zlib.crc32(f"large {dtype} {D} {layout} {heads} {mask} {dropout_p}".encode()))
    if bias is None:
        _check_forward(*_inputs(layout, dtype, heads, kv_heads, D, g), MASKS[mask], dtype, dropout_p, _draws(0, g))
    _check_backward(("triton", backward), dtype, D, layout, heads, kv_heads, mask, dropout_p, bias=bias)
    takes_forward = _hopper() and not dropout_p and bias is None  # (elsewhere the Triton forward runs every case)
    assert bool(forward) == takes_forward, "the Gluon forward ran with dropout, a bias or off Hopper, or did not run"


def _check_forward(q, k, v, opts, dtype, dropout_p=0.0, draws=None):
    """varlen.attention's output and lse against the float64 reference, by flash-attn's rule; with ``dropout_p``, the
    reference drops what the call draws from the generator ``draws``."""
    ref_opts = dict(opts, **_reference_dropout(q, k, dtype, dropout_p, draws))
    if dropout_p:
        opts = dict(opts, dropout_p=dropout_p, generator=draws)
    ref_out, ref_lse = attention_reference(*(_to(t, "cuda", torch.float64) for t in (q, k, v)), **ref_opts)
    low_out, low_lse = attention_reference(*(_to(t, "cuda", dtype) for t in (q, k, v)), **ref_opts)
    out, lse = varlen.attention(*(_to(t, "cuda", dtype) for t in (q, k, v)), return_lse=True, **opts)
    out, ref_out, low_out = (_values(t).double() for t in (out, ref_out, low_out))
    err = (out - ref_out).abs().max().item()
    allowed = 2 * (low_out - ref_out).abs().max().item() + 1e-5 * ref_out.abs().max().item()
    assert err <= allowed, f"out: error {err:.3e} > {allowed:.3e} (2x PyTorch's at {dtype})"
    lse, ref_lse, low_lse = (_values(t).double() for t in (lse, ref_lse, low_lse))
    sees = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), sees), "lse: -inf where a query sees no key, finite elsewhere"
    err = (lse[sees] - ref_lse[sees]).abs().max().item()
    allowed = 2 * (low_lse[sees] - ref_lse[sees]).abs().max().item() + 1e-5 * ref_lse[sees].abs().max().item()
    assert err <= allowed, f"lse: error {err:.3e} > {allowed:.3e} (2x PyTorch's at {dtype})"


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("D,DV,warpgroups", [(64, 64, 2), (64, 64, 3), (192, 192, 2), (256, 256, 2), (192, 128, 2)])
@pytest.mark.parametrize("programs", [1, 5])
@pytest.mark.parametrize("mask", ["none", "causal", "causal_bottom_right", "causal_window"])
@pytest.mark.parametrize("layout", ["dense", "jagged", "cross"])
def test_gluon_forward_persistent_programs(monkeypatch, layout, mask, programs, D, DV, warpgroups):
    """The persistent schedule with few programs, each walking many work items (ring positions, the Q block
    and the output staging carried across items; items past a sequence's end, items that see no key and
    blocks with warpgroups past the end in between), with two or three query warpgroups, and in tiles of 192 and 256
    (64-key tiles; at 256 the output staged in Q), also with V and O in tiles of 128 beside Q's and K's of 192: as the
    float64 reference. At the sizes of the test above most programs take one item."""
    launches = _route(monkeypatch, gluon_forward, "launch", "launch_forward", True)
    monkeypatch.setattr(gluon_forward, "sm_count", lambda device: programs)
    monkeypatch.setattr(gluon_forward, "query_warpgroups", lambda *args: warpgroups)
    taken, _ = _forward_warpgroups(monkeypatch)
    dims = f"{D}" if DV == D else f"{D} {DV}"
    g = torch.Generator().manual_seed(zlib.crc32(f"persistent {layout} {mask} {programs} {dims}".encode()))
    _check_forward(*_inputs(layout, torch.bfloat16, 8, 2, D, g, DV), MASKS[mask], torch.bfloat16)
    assert launches and set(taken) == {warpgroups}, "the Gluon kernel did not run with the warpgroups forced"


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
def test_gluon_forward_query_in_registers_repeats_bitwise(monkeypatch):
    """In tiles of 192 each query warpgroup reads its Q block into registers and releases Q's buffer at once, and the
    loader refills it by TMA with the next item's Q: without a proxy fence between the generic reads and the release,
    the refill could land under the reads (before the fence this test failed 4 of 4 runs on an H200, 113-500 of its
    500 calls moving; bench/NOTES.md). A persistent schedule of 5 programs walking many items, called 500 times: every
    call bitwise as the first, which is checked against the float64 reference (which program takes which item doesn't
    change the result)."""
    launches = _route(monkeypatch, gluon_forward, "launch", "launch_forward", True)
    monkeypatch.setattr(gluon_forward, "sm_count", lambda device: 5)
    monkeypatch.setattr(gluon_forward, "query_warpgroups", lambda *args: 2)
    g = torch.Generator().manual_seed(zlib.crc32(b"persistent cross causal_window 5 192"))
    q, k, v = _inputs("cross", torch.bfloat16, 8, 2, 192, g)
    _check_forward(q, k, v, MASKS["causal_window"], torch.bfloat16)
    assert launches and gluon_forward.query_in_registers(192, 192, 2), "Q was not read into registers"
    q, k, v = (_to(t, "cuda", torch.bfloat16) for t in (q, k, v))
    first_out, first_lse = (_values(t).clone() for t in varlen.attention(q, k, v, return_lse=True,
                                                                         **MASKS["causal_window"]))
    differing = 0
    for _ in range(500):
        out, lse = (_values(t) for t in varlen.attention(q, k, v, return_lse=True, **MASKS["causal_window"]))
        differing += int(not torch.equal(out, first_out) or not torch.equal(lse.nan_to_num(), first_lse.nan_to_num()))
    assert differing == 0, f"{differing} of 500 calls differ from the first"


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
def test_gluon_forward_declines_gapped_batches():
    """Dense tensors whose sequences don't follow one another in memory (a slice along the sequence axis) are
    not the Gluon forward's: its descriptors span all rows."""
    q, k, v = (torch.randn(2, 1100, 4, 64, device="cuda", dtype=torch.bfloat16)[:, :1000] for _ in range(3))
    problem, opts = Problem(2, 4, 4, 64, 64, 1000, 1000, True), AttentionOptions(scale=0.125)
    assert not gluon_forward.applies(problem, opts, q, k, v, None, None, None)
    assert gluon_forward.applies(problem, opts, *(t.contiguous() for t in (q, k, v)), None, None, None)


def _grads(q, k, v, dout, fn, dtype, device, bias=None, bias_grad=True):
    """Gradients of ``fn(q, k, v, bias)`` at ``dtype`` for q, k, v (and the bias, if given and ``bias_grad``)."""
    def prep(t, grad=True):
        if isinstance(t, varlen.JaggedTensor):
            return varlen.JaggedTensor(t.values.to(device, dtype).requires_grad_(), t.offsets.to(device), t.max_len)
        if t.dtype == torch.bool:  # (a mask, as given)
            return t.to(device)
        return t.to(device, dtype).requires_grad_(grad)

    q, k, v = (prep(t) for t in (q, k, v))
    leaves = [t.values if isinstance(t, varlen.JaggedTensor) else t for t in (q, k, v)]
    if bias is not None:
        bias = prep(bias, bias_grad)
        leaves += [bias] if bias_grad else []
    out = fn(q, k, v, bias)
    out = out.values if isinstance(out, varlen.JaggedTensor) else out
    return torch.autograd.grad(out, leaves, dout.to(device, dtype))


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("layout", ["dense", "dense_tiles", "jagged"])
@pytest.mark.parametrize("D", gluon_common.TILE_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_kernels_match_reference(backward_kernel, dtype, D, layout, heads, kv_heads, mask):
    _check_backward(backward_kernel, dtype, D, layout, heads, kv_heads, mask)


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("dropout_p,offset", DROPOUTS)
@pytest.mark.parametrize("mask", ["none", "causal", "causal_window"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("layout", ["dense", "dense_tiles", "jagged"])
@pytest.mark.parametrize("D", gluon_common.TILE_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_kernels_with_dropout_match_reference(backward_kernel, dtype, D, layout, heads, kv_heads, mask,
                                                       dropout_p, offset):
    # The Gluon kernel draws the mask itself (gluon/dropout.py), bit for bit the one attention_dropout_mask gives.
    _check_backward(backward_kernel, dtype, D, layout, heads, kv_heads, mask, dropout_p, offset)


def _mask_revealing_inputs(D, dropout_p, offset, seed):
    """Dense inputs whose output and dV show every keep bit of the mask the call draws: q = 0 makes the weights
    uniform (1 / D over D keys), v one-hot per key (o[i, j] = keep[i, j] * scale / D) and dO one-hot per query
    (dV[j, i] = keep[i, j] * scale / D); and that mask (``attention_dropout_mask``)."""
    B, H = 2, 3
    eye = torch.eye(D, device="cuda", dtype=torch.bfloat16)
    q = torch.zeros(B, D, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, D, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = eye[None, :, None, :].expand(B, D, H, D).contiguous().requires_grad_()
    dout = eye[None, :, None, :].expand(B, D, H, D).contiguous()
    draws = torch.Generator(device="cuda").manual_seed(seed)
    draws.set_offset(offset)
    keep = attention_dropout_mask(q, k, dropout_p, generator=draws)
    return q, k, v, dout, draws, keep


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("D", gluon_common.TILE_HEAD_DIMS)
@pytest.mark.parametrize("dropout_p,offset", DROPOUTS + [(0.5, 8)])
def test_kernels_draw_the_mask_exactly(forward_kernel, backward_kernel, D, dropout_p, offset):
    # The comparisons with the reference allow an error that a few wrong keep bits of a large tile could hide in;
    # these inputs show each bit, in the output (the forward) and in dV (the backward).
    q, k, v, dout, draws, keep = _mask_revealing_inputs(D, dropout_p, offset, seed=D + offset)
    out = varlen.attention(q, k, v, dropout_p=dropout_p, generator=draws)
    (dv,) = torch.autograd.grad(out, (v,), dout)
    for name, launches in (("forward", forward_kernel), ("backward", backward_kernel)):
        assert bool(launches[1]) == (launches[0] == "gluon"), f"the {name}'s {launches[0]} kernel did not run"
    assert torch.equal(out.float().permute(0, 2, 1, 3) > 0, keep)
    assert torch.equal(dv.float().permute(0, 2, 3, 1) > 0, keep)


def _key_in_memory(monkeypatch) -> list:
    """Calls from now on draw their dropout key on the GPU, as inside a captured CUDA graph (simulated: the capture
    test says yes), and the kernels load it (``options.DropoutSeed``); returns the list the keys drawn go to."""
    monkeypatch.setattr(function, "capturing", lambda device: True)
    return record_calls(monkeypatch, api, "dropout_seed")


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("D", gluon_common.TILE_HEAD_DIMS)
def test_kernels_draw_the_mask_of_a_key_in_memory(forward_kernel, backward_kernel, D, monkeypatch):
    """Every keep bit, forward and backward, is the mask of the key drawn on the GPU (the mask-revealing inputs of
    the test above)."""
    q, k, v, dout, draws, _ = _mask_revealing_inputs(D, 0.5, 0, seed=D + 1)
    drawn = _key_in_memory(monkeypatch)
    out = varlen.attention(q, k, v, dropout_p=0.5, generator=draws)
    (dv,) = torch.autograd.grad(out, (v,), dout)
    for name, launches in (("forward", forward_kernel), ("backward", backward_kernel)):
        assert bool(launches[1]) == (launches[0] == "gluon"), f"the {name}'s {launches[0]} kernel did not run"
    (key,) = drawn
    keep = dropout_keep_mask(2, 3, D, D, 0.5, seed=int(key), offset=0, device="cuda")
    assert torch.equal(out.float().permute(0, 2, 1, 3) > 0, keep)
    assert torch.equal(dv.float().permute(0, 2, 3, 1) > 0, keep)


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
def test_three_query_warpgroups_draw_the_mask_of_a_key_in_memory(three_query_warpgroups, monkeypatch):
    """The same with the forward's three query warpgroups (D64; dropout never takes them by the rule)."""
    q, k, v, _, draws, _ = _mask_revealing_inputs(64, 0.5, 0, seed=65)
    drawn = _key_in_memory(monkeypatch)
    with torch.no_grad():
        out = varlen.attention(q, k, v, dropout_p=0.5, generator=draws)
    assert three_query_warpgroups[0] == [3]
    (key,) = drawn
    keep = dropout_keep_mask(2, 3, 64, 64, 0.5, seed=int(key), offset=0, device="cuda")
    assert torch.equal(out.float().permute(0, 2, 1, 3) > 0, keep)


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("D", gluon_common.TILE_HEAD_DIMS)
def test_kernels_with_dropout_threshold_one(backward_kernel, D):
    # p = 2**-8 makes the mask's threshold 1, an integer Triton specializes as a constant (in the dropout tuple
    # too): the Gluon forward and backward failed to compile it. (The forward is the Gluon one where it applies.)
    assert dropout_threshold(2**-8) == 1
    _check_backward(backward_kernel, torch.bfloat16, D, "jagged", 8, 2, "causal", 2**-8, 0)


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("programs_per_sm", [0, 10**6])
@pytest.mark.parametrize("mask", ["causal", "causal_bottom_right"])
@pytest.mark.parametrize("layout", ["dense", "dense_tiles"])
@pytest.mark.parametrize("D", gluon_common.TILE_HEAD_DIMS)
def test_backward_program_orders(backward_kernel, programs_per_sm, mask, layout, D, monkeypatch):
    # Dense causal programs start heaviest first when they are few (program.blocks_last): both orders, whatever
    # the GPU, for both kernels; the Gluon kernel's descriptors made by its programs (dense) or on the host
    # (dense_tiles).
    # (The Gluon kernel's grid in groups of kv heads, which GQA takes first, apart: the test below.)
    monkeypatch.setattr(gluon_backward, "PROGRAMS_PER_SM", programs_per_sm)
    monkeypatch.setattr(triton_backward, "KV_PROGRAMS_PER_SM", programs_per_sm)
    monkeypatch.setattr(program, "kv_head_groups", lambda *args: 0)
    orders = record_calls(monkeypatch, program, "blocks_last")
    host_descriptors = record_calls(monkeypatch, gluon_backward, "host_descriptors")
    _check_backward(backward_kernel, torch.bfloat16, D, layout, 8, 2, mask)
    assert orders == [programs_per_sm > 0], orders
    made_on_host = [d is not None for d in host_descriptors]
    assert made_on_host == ([layout == "dense_tiles"] if backward_kernel[0] == "gluon" else []), made_on_host


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("heads,kv_heads,kv_heads_per_group", [(8, 2, 1), (8, 2, 2), (8, 2, 4), (6, 3, 2), (6, 3, 3)])
@pytest.mark.parametrize("mask", ["causal", "causal_bottom_right"])
@pytest.mark.parametrize("layout", ["dense", "dense_tiles"])
@pytest.mark.parametrize("D,paired", [(64, False), (64, True), (128, False)])
def test_gluon_backward_programs_in_groups_of_kv_heads(monkeypatch, heads, kv_heads, kv_heads_per_group, mask, layout,
                                                       D, paired):
    # GQA's dense causal programs in groups of kv heads (program.kv_head_groups), forced to a number dividing the
    # batch's (two sequences): groups within a sequence, a sequence's, across two, and (3 kv heads, 2 a group)
    # groups that end inside a sequence.
    launches = _route(monkeypatch, gluon_backward, "launch_kv", "launch_backward", True)
    monkeypatch.setattr(program, "kv_head_groups", lambda *args: kv_heads_per_group)
    monkeypatch.setattr(gluon_backward, "pairs", lambda *args: paired)
    grids, taken = _launch_arguments(monkeypatch, gluon_backward, "_bwd_kv_hopper", "GRID", "PAIRS")
    _check_backward(("gluon", launches), torch.bfloat16, D, layout, heads, kv_heads, mask)
    assert grids == [program.KV_GROUPS] and taken == [paired], (grids, taken)


def _backward_pairs(monkeypatch) -> list:
    """``PAIRS`` of every launch of the Gluon backward kernel from now on, in a list."""
    return _launch_arguments(monkeypatch, gluon_backward, "_bwd_kv_hopper", "PAIRS")[0]


@pytest.fixture
def paired_key_blocks(monkeypatch):
    """Route the Triton backend's backward through the Gluon kernel with two key blocks per program whatever the
    call: the automatic rule pairs them at D64 where programs are many (``gluon_backward.pairs``), but the kernel
    computes every D64 variant paired. Returns the kernel's launches and each one's ``PAIRS``."""
    launches = _route(monkeypatch, gluon_backward, "launch_kv", "launch_backward", True)
    monkeypatch.setattr(gluon_backward, "pairs", lambda *args: True)
    return launches, _backward_pairs(monkeypatch)


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("layout", ["dense", "dense_tiles", "jagged"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_paired_key_blocks_match_reference(paired_key_blocks, dtype, layout, heads, kv_heads, mask):
    # D64 (two K and V buffers: D128's shared memory has no room). Sequences of 0 to 8 key blocks of 128: programs
    # with two blocks, a last one with one (17 and 300 keys make 1 and 3 blocks; 129 makes 2, the second with one
    # key), programs past the pairs, which return, and second blocks no query sees (dense_tiles under a causal mask).
    launches, paired = paired_key_blocks
    _check_backward(("gluon", launches), dtype, 64, layout, heads, kv_heads, mask)
    assert paired and set(paired) == {True}


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("dropout_p,offset", DROPOUTS)
@pytest.mark.parametrize("mask", ["none", "causal", "causal_window"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("layout", ["dense", "dense_tiles", "jagged"])
def test_backward_paired_key_blocks_with_dropout_match_reference(paired_key_blocks, layout, heads, kv_heads, mask,
                                                                 dropout_p, offset):
    launches, paired = paired_key_blocks
    _check_backward(("gluon", launches), torch.bfloat16, 64, layout, heads, kv_heads, mask, dropout_p, offset)
    assert paired and set(paired) == {True}


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("D,layout,mask,sms,expected", [
    (64, "dense", "causal", 1, True), (64, "dense", "causal_bottom_right", 1, True), (64, "jagged", "causal", 1, True),
    (64, "dense", "causal", 10**4, False), (64, "jagged", "causal", 10**4, False), (128, "dense", "causal", 1, False),
    (64, "dense", "none", 1, False),
])
def test_gluon_backward_pairs_key_blocks_under_causal_masks(monkeypatch, D, layout, mask, sms, expected):
    # The automatic choice reaches the kernel: B2 x 1000 keys x 2 kv heads make 16 pairs of key blocks (the jagged
    # LENGTHS, 24 counted from the key rows), four per SM or more with one SM, not with 10**4; never at D128 or
    # without a mask.
    launches = _route(monkeypatch, gluon_backward, "launch_kv", "launch_backward", True)
    monkeypatch.setattr(gluon_backward, "sm_count", lambda device: sms)
    paired = _backward_pairs(monkeypatch)
    _check_backward(("gluon", launches), torch.bfloat16, D, layout, 8, 2, mask)
    assert paired == [expected]


BIASES = ["1HQK", "BHQK"]  # broadcast over sequences (float32 adds), and full (each element stored once)


def _bias(name, q, k, heads, g, masked=False, wider=0):
    """A bias of shape ``name`` (B, H or 1 for each of its first two dims; "bool": a (B, 1) bool mask, True at nine
    entries in ten) over the inputs' whole (query, key) planes; ``masked``: with -inf at one entry in ten. A jagged
    batch's bias is ``wider`` wider than its longest sequence, and holds NaN where no score reads it (past each
    sequence's queries and keys for a full-shape bias, past the longest sequence's for any)."""
    jagged = isinstance(q, varlen.JaggedTensor)
    batch, max_q, max_k = (q.batch_size, q.max_len, k.max_len) if jagged else (q.shape[0], q.shape[1], k.shape[1])
    if name == "bool":
        return torch.rand(batch, 1, max_q, max_k, generator=g) < 0.9
    dims = {"B": batch, "H": heads, "1": 1}
    bias = torch.randn(dims[name[0]], dims[name[1]], max_q + wider, max_k + wider, generator=g)
    if masked:
        bias = bias.masked_fill(torch.rand(bias.shape, generator=g) < 0.1, float("-inf"))
    if jagged:
        bias[:, :, max_q:] = float("nan")
        bias[:, :, :, max_k:] = float("nan")
    if jagged and name[0] == "B":
        for b, (lq, lk) in enumerate(zip(q.offsets.diff().tolist(), k.offsets.diff().tolist(), strict=True)):
            bias[b, :, lq:] = float("nan")
            bias[b, :, :, lk:] = float("nan")
    return bias


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("bias", BIASES)
@pytest.mark.parametrize("mask", ["none", "causal", "causal_window"])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("layout", ["dense", "dense_tiles", "jagged"])
@pytest.mark.parametrize("D", gluon_common.TILE_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backward_kernels_with_bias_match_reference(backward_kernel, dtype, D, layout, heads, kv_heads, mask, bias):
    # The bias's gradient too: stored (a full-shape bias) or added in float32 (broadcast over sequences).
    _check_backward(backward_kernel, dtype, D, layout, heads, kv_heads, mask, bias=bias)


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("layout,bias,mask,mode", [
    ("dense", "1HQK", "none", 3), ("dense_tiles", "1HQK", "none", 3), ("dense_batch", "1HQK", "none", 3),
    # Under masks (D64; D128 keeps zeros and adds there) the first sequence zeroes the tiles no query sees (with 512
    # queries and 1024 keys, causal: whole key blocks; bottom right: the tiles above the diagonal; windows: both
    # sides).
    ("dense_batch", "1HQK", "causal", 3), ("dense_tiles", "1HQK", "causal", 3),
    ("dense_tiles", "1HQK", "causal_bottom_right", 3), ("dense", "1HQK", "causal_window", 3),
    ("dense_batch", "1HQK", "window", 3),
    ("jagged", "1HQK", "none", 2), ("dense_batch", "11QK", "none", 2),  # (zeros and adds)
])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("D", gluon_common.TILE_HEAD_DIMS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gluon_backward_stores_the_first_sequences_bias_gradient(monkeypatch, dtype, D, heads, kv_heads, layout,
                                                                 bias, mask, mode):
    # A bias broadcast over sequences only, dense: the first sequence's programs store its float32 gradient (DB 3)
    # into memory that holds no zeros (here NaN: an element left unwritten shows), the others add once each tile's
    # flag is up. Elsewhere zeros and adds (DB 2).
    modes = []
    launch_kv = gluon_backward.launch_kv

    def poisoned(*args, **kwargs):
        modes.append(kwargs["dbias_mode"])
        if kwargs["dbias_mode"] == 3:
            kwargs["dbias"].fill_(float("nan"))
        return launch_kv(*args, **kwargs)

    monkeypatch.setattr(gluon_backward, "launch_kv", poisoned)
    launches = _route(monkeypatch, gluon_backward, "launch_kv", "launch_backward", True)
    _check_backward(("gluon", launches), dtype, D, layout, heads, kv_heads, mask, bias=bias)
    assert modes == [2 if mask != "none" and D > 64 else mode]


OTHER_BIASES = [  # (bias, masked, bias_grad, scale, wider)
    ("B1QK", False, True, None, 0), ("11QK", False, True, None, 0),  # broadcast over heads (and sequences)
    ("1HQK", True, True, None, 0), ("BHQK", True, True, None, 0),  # -inf entries: rows with few keys, or none
    ("1HQK", False, False, None, 0),  # no gradient wanted for the bias
    ("BHQK", False, True, -0.3, 0),  # a negative scale (the lean products start from bias / scale)
    ("1HQK", False, True, None, 24), ("BHQK", False, True, None, 24),  # wider than the longest sequence (jagged)
    ("bool", False, False, None, 0),  # a bool mask: an additive one of the inputs' dtype (varlen.attention)
]


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("layout,bias,masked,bias_grad,scale,wider",
                         [(layout, *case) for layout in ("dense", "jagged") for case in OTHER_BIASES
                          if layout == "jagged" or not case[-1]])  # (a dense bias is exactly the planes)
@pytest.mark.parametrize("D", gluon_common.TILE_HEAD_DIMS)
def test_backward_kernels_with_other_biases_match_reference(backward_kernel, D, layout, bias, masked, bias_grad,
                                                            scale, wider):
    _check_backward(backward_kernel, torch.bfloat16, D, layout, 4, 4, "none", bias=bias, bias_masked=masked,
                    bias_grad=bias_grad, scale=scale, bias_wider=wider)


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernel needs an sm_90 GPU")
@pytest.mark.parametrize("keys,bias_dtype", [(1001, torch.bfloat16), (1000, torch.float32)])
def test_gluon_backward_leaves_other_biases_to_the_triton_kernel(monkeypatch, keys, bias_dtype):
    # Keys no multiple of 8 (the gradient's rows are no whole 16-byte units), or a bias of another dtype than q: the
    # Triton kernel computes the call (and tests/test_attention.py its gradients).
    launches = _route(monkeypatch, gluon_backward, "launch_kv", "launch_backward", True)
    q, k, v = (torch.randn(1, n, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for n in (64, keys, keys))
    bias = torch.randn(1, 4, 64, keys, device="cuda", dtype=bias_dtype, requires_grad=True)
    varlen.attention(q, k, v, bias=bias).sum().backward()
    assert not launches and bias.grad.dtype == bias_dtype and bias.grad.isfinite().all()
    bias = bias.detach().to(torch.bfloat16)[..., :1000].contiguous().requires_grad_()
    varlen.attention(q, k[:, :1000], v[:, :1000], bias=bias).sum().backward()
    assert launches  # (the same call, with keys and a bias it takes)


def _check_backward(backward_kernel, dtype, D, layout, heads, kv_heads, mask, dropout_p=0.0, offset=0, bias=None,
                    bias_masked=False, bias_grad=True, scale=None, bias_wider=0, DV=None, deterministic=False):
    dims = f"{D}" if DV is None else f"{D} {DV}"
    g = torch.Generator().manual_seed(zlib.crc32(f"{dtype} {dims} {layout} {heads} {mask} {dropout_p}".encode()))
    q, k, v = _inputs(layout, dtype, heads, kv_heads, D, g, DV)
    rows = q.values.shape if isinstance(q, varlen.JaggedTensor) else q.shape
    dout = torch.randn(*rows[:-1], D if DV is None else DV, generator=g)
    opts = dict(DETERMINISTIC_MASKS[mask], scale=scale)
    draws = _draws(offset, g)
    bias = None if bias is None else _bias(bias, q, k, heads, g, bias_masked, bias_wider)
    ref_opts = dict(opts, **_reference_dropout(q, k, dtype, dropout_p, draws))
    args = dict(bias=bias, bias_grad=bias_grad)
    ref = _grads(q, k, v, dout, lambda a, b, c, d: attention_reference(a, b, c, bias=d, **ref_opts)[0],
                 torch.float64, "cuda", **args)
    low = _grads(q, k, v, dout, lambda a, b, c, d: attention_reference(a, b, c, bias=d, **ref_opts)[0], dtype,
                 "cuda", **args)
    got = _grads(q, k, v, dout, lambda a, b, c, d: varlen.attention(a, b, c, bias=d, **opts, dropout_p=dropout_p,
                                                                    generator=draws, deterministic=deterministic),
                 dtype, "cuda", **args)
    kernel, gluon_launches = backward_kernel
    assert bool(gluon_launches) == (kernel == "gluon"), f"the {kernel} kernel did not run"
    for name, x, lo, r in zip(("dq", "dk", "dv", "dbias")[:len(got)], got, low, ref, strict=True):
        err = (x.double() - r).abs().max().item()
        allowed = 2 * (lo.double() - r).abs().max().item() + 1e-5 * r.abs().max().item()
        assert err <= allowed, f"{name}: error {err:.3e} > {allowed:.3e} (2x PyTorch's at {dtype})"
