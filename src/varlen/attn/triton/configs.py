"""Tile sizes and launch settings per kernel, chosen from the problem's shape and the machine.

Tuning as data: the tables below are keyed by compute capability (:data:`TABLES`) and each names its
source: sweep rows committed under ``bench/results/sweeps/`` (``tests/test_configs.py`` checks that the
entries are the sweeps' best), the earlier H200 sweeps recorded in ``bench/NOTES.md``, or ``UNTUNED``.
To tune: ``bench/attention_sweep.py --focus ... --csv bench/results/sweeps/NAME.csv`` on the GPU, then
update the table and its source.
"""

import dataclasses
import functools

import torch

from ..._amp import dot_precision
from ..._backend import interpreter_enabled


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    tma: bool = True  # load tiles through TMA descriptors where the hardware and alignment allow


# How the backward computes dQ.
DQ_SEPARATE = 0  # a second kernel walks key tiles per query block: no atomics, deterministic
DQ_ATOMIC = 1    # the kv kernel adds each dQ tile with element atomics
DQ_TMA = 2       # the kv kernel adds each dQ tile with one TMA bulk reduce (Hopper and newer)


@dataclasses.dataclass(frozen=True)
class BackwardConfig:
    kv: KernelConfig
    q: KernelConfig | None = None  # the dQ kernel's tiles, for DQ_SEPARATE
    dq_mode: int = DQ_ATOMIC


# Under the interpreter, small tiles make short test sequences span several tiles, so every stage of
# the tile walk (masked edges, unmasked middle) runs.
INTERPRETER_CONFIG = KernelConfig(block_m=16, block_n=16, num_warps=1, num_stages=1, tma=False)

K = KernelConfig

# Where each table comes from (bench/results/sweeps/*.csv rows are checked by tests/test_configs.py):
H200_SWEEPS = "H200 sweeps of 2026-11-21, bf16 (bench/NOTES.md; rows not kept: re-run bench/attention_sweep.py --csv)"
FP32_SWEEP = "bench/results/sweeps/fp32_h100_2026-11-22.csv"
# float32 at full accuracy, forward and backward, with bf16 parts (splits_bf16): its own sweep, which replaced
# FP32_SWEEP's "tf32x3" rows (those timed Triton's tf32x3 dots and the backward's earlier 3xTF32 form).
FP32_PARTS_SWEEP = "bench/results/sweeps/fp32_parts_h100_2026-11-25.csv"
# The bias and dropout tiles re-swept on an H100 after the bias loads were vectorized and broadcast-bias gradients
# moved to a heads-last grid (bench/attention_sweep.py --focus heavy, B4 S2048 H16 D128).
HEAVY_SWEEP = "bench/results/sweeps/heavy_h100_2026-11-26.csv"
# Head dim 256 (and 129-255, computed in tiles 256 wide) on an H100 (bench/attention_sweep.py --focus head256, B4 S4096
# H8 D256, causal or not): the forward and the backward without a bias or dropout.
HEAD256_SWEEP = "bench/results/sweeps/head256_h100_2026-11-27.csv"
# The dQ kernel's tiles with dropout at head dim 256, beside the Gluon dK and dV kernel in tiles of 256 (which takes
# the kv kernel's place on Hopper; bench/attention_sweep.py --focus head256_dropout, B8 S2048 H8, causal or not).
HEAD256_DROPOUT_SWEEP = "bench/results/sweeps/head256_dropout_h100_2026-11-27.csv"
UNTUNED = "untuned: the smallest tiles that fit the shared memory, never timed against others"


@dataclasses.dataclass(frozen=True)
class Tables:
    """The tiles of one GPU generation (compute capability), each table with its source above."""

    forward: dict  # head dim bound -> forward tiles; H200_SWEEPS at D64/128 (S4096), HEAD256_SWEEP at D256
    # (head dim bound, causal) -> (kv tiles, dQ tiles, fastest dQ mode when atomics are allowed). At D=128
    # without a causal mask the separate dQ kernel beats in-kernel reduction, so it is used (deterministic for
    # free). H200_SWEEPS at D64/128, HEAD256_SWEEP at D256: there the separate dQ kernel lets the kv kernel take
    # 64 x 64 tiles at two stages (in-kernel dQ at its best 141-157 TFLOP/s against 199-267; the untuned 32 x 64 x 1
    # stage tiles ran 67-115).
    backward: dict
    # float32, by (dot precision, head dim bound): FP32_SWEEP (B8 S2048 H=512/D; the "tf32x3" rows:
    # FP32_PARTS_SWEEP, same shapes), the best row without a mask (TFLOP/s full / causal in the comments); dQ
    # tiles: the best of the deterministic (separate dQ) rows.
    forward_float32: dict
    backward_float32: dict
    # D256 float32, and float32 with a bias, dropout or pointer loads: UNTUNED. At D256 the backward's pointer
    # loads need smaller tiles still (32x64 took 448 KiB of shared memory: tools/compile_check.py).
    float32_untuned: KernelConfig
    float32_untuned_256_pointers: KernelConfig
    # ... and with TF32 dots the D256 backward's kv kernel at float32_untuned's 32x64 tiles took 256 KiB of shared
    # memory (TMA loads; a GPU test crashed there): 16x64 fits (192 KiB; tools/compile_check.py). UNTUNED.
    float32_untuned_256_tf32: KernelConfig
    # The float32 forward and backward with bf16 parts (:func:`splits_bf16`) keep each loaded tile's three parts in
    # shared memory: 16-query tiles fit next to a bias or dropout (tools/compile_check.py); two stages, since
    # Triton 3.6 miscompiles the backward's split kernel with one (parts.runs_split). UNTUNED.
    float32_split_untuned: KernelConfig
    # With a bias (its tiles are pipelined like K and V) or dropout (its bits are shuffled through shared memory)
    # the largest tiles overflow the 227 KiB of shared memory of sm_90. H200_SWEEPS at B4 S2048 H16 D128 (--focus
    # heavy): a bias runs best with 128x64 forward tiles and a separate dQ kernel (222 TFLOP/s backward vs 156
    # with in-kernel dQ), dropout with 64x64 forward tiles and in-kernel dQ (237 vs 197: the Philox bits are then
    # drawn once per tile, not twice). HEAVY_SWEEP (H100) kept every D128 choice: backward with a (B,H,S,S) bias
    # 218 vs 161 in-kernel, (1,H,S,S) 180 vs 142, dropout (the Triton kernel) 246 vs 233 separate. D64 and D256
    # entries: UNTUNED (D128's choice, resized to fit; the D256 backward's: the smallest tiles, which the plain
    # backward took before HEAD256_SWEEP), but D256's dQ tiles with dropout: HEAD256_DROPOUT_SWEEP (they run beside
    # the Gluon kernel in tiles of 256 on Hopper, and in deterministic mode).
    forward_bias: dict
    forward_dropout: dict
    backward_bias: dict
    backward_dropout: dict
    q_heavy: dict  # dQ-kernel tiles that fit next to dropout at D64 (other head dims: the tables above): UNTUNED
    # GQA under a causal mask at D=128: the dQ kernel runs per query head, the kv kernel per kv head, so the
    # split keeps more programs busy (H200_SWEEPS, B2 Hq32 Hkv8 S4096: 322 vs 277 TFLOP/s backward). kv tiles
    # 32x64: after the bundles rewrite the 64x64 kv kernel spilled differently and ran 19% slower (H100, same
    # shape: backward 2.23 ms vs 2.00-2.04 before the rewrite); 32x64 gives 2.08 ms, the best of 9 kv tiles.
    backward_gqa_causal_128: tuple
    # Short causal sequences at D<=64 (H200_SWEEPS, B16 S1024 H32: 218 vs 197 TFLOP/s backward), used up to
    # ``short`` keys: UNTUNED threshold (measured at S1024 and S4096 only; the crossover between is not known).
    backward_short_causal_64: tuple
    short: int


SM90 = Tables(
    forward={64: K(128, 64, 4, 3), 128: K(128, 128, 8, 3), 256: K(128, 64, 8, 2)},  # D256: 507 / 432
    backward={
        (64, False): (K(64, 64, 4, 3), K(64, 64, 4, 2), DQ_TMA),
        (64, True): (K(64, 64, 4, 3), K(64, 64, 4, 2), DQ_TMA),
        (128, False): (K(64, 64, 4, 2), K(128, 128, 8, 2), DQ_SEPARATE),
        (128, True): (K(64, 128, 8, 3, tma=False), K(64, 64, 4, 2), DQ_TMA),
        (256, False): (K(64, 64, 8, 2), K(128, 32, 8, 3), DQ_SEPARATE),  # 267
        (256, True): (K(64, 64, 8, 2), K(128, 32, 8, 3), DQ_SEPARATE),  # 199
    },
    forward_float32={
        ("tf32", 64): K(128, 64, 4, 2),  # 155 / 111
        ("tf32", 128): K(32, 64, 4, 2),  # 118 / 98
        # bf16 parts (splits_bf16); with Triton's tf32x3 dots: 56 / 47 and 41 / 31.
        ("tf32x3", 64): K(64, 32, 4, 2),  # 68 / 55
        ("tf32x3", 128): K(128, 32, 8, 2),  # 67 / 46
    },
    backward_float32={
        ("tf32", 64): (K(64, 128, 8, 2), K(128, 32, 4, 2), DQ_ATOMIC),  # 117 / 87
        ("tf32", 128): (K(32, 128, 8, 2), K(128, 32, 4, 2), DQ_TMA),  # 100 / 60
        # bf16 parts (splits_bf16), dK and dV summed in float32 (parts.dot6; summed in the tensor cores: 68 / 53 and
        # 55 / 43, 15-30x less accurate); with 3xTF32 over split operands: 44 / 33 and 22 / 16; before any split:
        # 34 / 25 and 19 / 12.
        ("tf32x3", 64): (K(32, 64, 4, 2), K(64, 32, 4, 2), DQ_ATOMIC),  # 65 / 52
        ("tf32x3", 128): (K(32, 64, 4, 2), K(64, 64, 4, 2), DQ_TMA),  # 46 / 34
    },
    float32_untuned=K(32, 64, 4, 1),
    float32_untuned_256_pointers=K(16, 32, 4, 1),
    float32_untuned_256_tf32=K(16, 64, 4, 1),
    float32_split_untuned=K(16, 64, 4, 2),
    forward_bias={64: K(128, 64, 4, 2), 128: K(128, 64, 8, 3), 256: K(64, 32, 4, 2)},
    forward_dropout={64: K(64, 64, 4, 2), 128: K(64, 64, 4, 2), 256: K(64, 32, 4, 2)},
    backward_bias={64: (K(64, 64, 4, 2), K(64, 64, 4, 2), DQ_SEPARATE),
                   128: (K(64, 64, 4, 2), K(64, 64, 4, 2), DQ_SEPARATE),
                   256: (K(32, 64, 8, 1), K(32, 64, 8, 1), DQ_TMA)},
    backward_dropout={128: (K(64, 128, 8, 3, tma=False), K(64, 64, 4, 2), DQ_TMA),
                      256: (K(32, 64, 8, 1), K(128, 32, 8, 2), DQ_TMA)},
    q_heavy={64: K(64, 64, 4, 2)},
    backward_gqa_causal_128=(K(32, 64, 4, 2), K(64, 64, 4, 2), DQ_SEPARATE),
    backward_short_causal_64=(K(64, 64, 4, 2, tma=False), K(64, 64, 4, 2), DQ_TMA),
    short=2048,
)
# By compute capability. Others use the nearest older table below them (sm_90's for newer GPUs: untuned there);
# the kernels need TMA-capable GPUs for their tuned tiles anyway (use_tma falls back to pointer loads).
TABLES = {(9, 0): SM90}


def tables(device: torch.device) -> Tables:
    """The tables for ``device``'s compute capability (sm_90's off the GPU: tools/compile_check.py targets it)."""
    if device.type != "cuda":
        return SM90
    capability = compute_capability(device)
    tuned = [c for c in TABLES if c <= capability]
    return TABLES[max(tuned)] if tuned else SM90


@functools.cache
def _capability_of(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def compute_capability(device: torch.device) -> tuple[int, int]:
    """``device``'s (major, minor) compute capability, read once per GPU (torch's query costs host time per call)."""
    return _capability_of(device.index if device.index is not None else torch.cuda.current_device())


def _bound(d: int) -> int:
    return 64 if d <= 64 else 128 if d <= 128 else 256


def head_bound(problem) -> int:
    """The head-dim bound (64, 128 or 256) that picks a problem's tiles."""
    return _bound(max(problem.head_dim, problem.head_dim_v))


def splits_bf16(dtype: torch.dtype, problem, tma: bool) -> bool:
    """Whether the forward and the backward's kv kernel compute float32's full-accuracy products as six bf16
    products of operands split once per call into three bf16 parts (``parts.py``) instead of Triton's
    ``tf32x3`` dots, which split both operands of every dot in registers and transpose the 32-bit ones that
    wgmma needs K-major through them. Only when tiles load through TMA (``tma``), up to head dim 128 (at 256 a
    key block's parts overflow shared memory), and never under the interpreter (its bf16 dots give wrong numbers
    and its float32 to bf16 conversions truncate)."""
    return (tma and dtype == torch.float32 and dot_precision(dtype) == "tf32x3" and head_bound(problem) <= 128
            and not interpreter_enabled())


def _tuned_float32(dtype: torch.dtype, split: bool, tma: bool, bias: bool, dropout: bool) -> bool:
    """Whether a float32 call takes its precision's tuned tiles: not next to a bias or dropout, nor with pointer
    loads (the tuned tiles would overflow shared memory), and at full accuracy only with the bf16 parts (the
    "tf32x3" tiles are the parts' kernels': Triton's own tf32x3 dots spill at them)."""
    return not (bias or dropout) and tma and (split or dot_precision(dtype) != "tf32x3")


def forward_config(problem, dtype: torch.dtype, device: torch.device, bias: bool = False, dropout: bool = False,
                   tma: bool = True) -> KernelConfig:
    """``tma``: whether the tiles will load through TMA (the tuned float32 tiles need it: with pointer loads
    they overflow shared memory)."""
    if interpreter_enabled():
        return INTERPRETER_CONFIG
    t = tables(device)
    bound = head_bound(problem)
    if dtype == torch.float32:
        split = splits_bf16(dtype, problem, tma)
        untuned = t.float32_split_untuned if split else t.float32_untuned
        if not _tuned_float32(dtype, split, tma, bias, dropout):
            return untuned
        return t.forward_float32.get((dot_precision(dtype), bound), untuned)
    if dropout:
        return t.forward_dropout[bound]
    if bias:
        return t.forward_bias[bound]
    return t.forward[bound]


def has_tma(device: torch.device) -> bool:
    """Whether ``device`` has the Tensor Memory Accelerator (Hopper and newer): descriptor loads, bulk reduce."""
    return device.type == "cuda" and compute_capability(device)[0] >= 9


def backward_config(problem, dtype: torch.dtype, masked: bool, deterministic: bool, device: torch.device,
                    bias: bool = False, dropout: bool = False, tma: bool = True) -> BackwardConfig:
    """``masked``: causal or a window; ``tma`` as in :func:`forward_config`."""
    if interpreter_enabled():
        mode = DQ_SEPARATE if deterministic else DQ_ATOMIC
        return BackwardConfig(INTERPRETER_CONFIG, INTERPRETER_CONFIG, mode)
    t = tables(device)
    bound = head_bound(problem)
    if dtype == torch.float32:
        split = splits_bf16(dtype, problem, tma)
        if split:
            small = t.float32_split_untuned
        elif bound == 256 and not tma:
            small = t.float32_untuned_256_pointers
        elif bound == 256 and dot_precision(dtype) == "tf32":
            small = t.float32_untuned_256_tf32
        else:
            small = t.float32_untuned
        untuned = (small, small, DQ_TMA)
        tuned = _tuned_float32(dtype, split, tma, bias, dropout)
        kv, q, mode = t.backward_float32.get((dot_precision(dtype), bound), untuned) if tuned else untuned
    elif bias and bound in t.backward_bias:
        kv, q, mode = t.backward_bias[bound]
    elif dropout and bound in t.backward_dropout:
        kv, q, mode = t.backward_dropout[bound]
    elif bound == 64 and masked and problem.max_k <= t.short:
        kv, q, mode = t.backward_short_causal_64
    elif bound == 128 and masked and problem.group > 1:
        kv, q, mode = t.backward_gqa_causal_128
    else:
        kv, q, mode = t.backward[(bound, masked)]
        if bias or dropout:
            q = t.q_heavy[bound]
    if deterministic:
        mode = DQ_SEPARATE
    elif mode == DQ_TMA and not has_tma(device):
        mode = DQ_ATOMIC
    return BackwardConfig(kv, q, mode)
