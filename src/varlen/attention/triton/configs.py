"""Tile sizes and launch settings per kernel, chosen from the problem's shape and the machine."""

import dataclasses

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

# Chosen by bench/attention_sweep.py on an H200 (bf16, S=4096, 2026-11-21); see bench/results/.
# Forward: (head dim bound) -> tiles.
_FORWARD = {64: K(128, 64, 4, 3), 128: K(128, 128, 8, 3), 256: K(64, 64, 4, 2)}
# Backward: (head dim bound, causal) -> (kv tiles, dQ tiles, fastest dQ mode when atomics are allowed).
# At D=128 without a causal mask the separate dQ kernel beats in-kernel reduction, so it is used
# (and is deterministic for free).
_BACKWARD = {
    (64, False): (K(64, 64, 4, 3), K(64, 64, 4, 2), DQ_TMA),
    (64, True): (K(64, 64, 4, 3), K(64, 64, 4, 2), DQ_TMA),
    (128, False): (K(64, 64, 4, 2), K(128, 128, 8, 2), DQ_SEPARATE),
    (128, True): (K(64, 128, 8, 3, tma=False), K(64, 64, 4, 2), DQ_TMA),
    (256, False): (K(32, 64, 8, 1), K(32, 64, 8, 1), DQ_TMA),
    (256, True): (K(32, 64, 8, 1), K(32, 64, 8, 1), DQ_TMA),
}
# float32, by dot precision ("tf32" when torch allows TF32, "tf32x3" for float32 accuracy) and head dim bound.
# Measured by bench/attention_sweep.py --focus fp32 on an H100 (B8 S2048 H=512/D, 2026-11-22; TFLOP/s in the
# comments, full and causal).
_FORWARD_FLOAT32 = {
    ("tf32", 64): K(128, 64, 4, 2),  # 155 / 111
    ("tf32", 128): K(32, 64, 4, 2),  # 118 / 98
    ("tf32x3", 64): K(128, 64, 8, 2),  # 56 / 47
    ("tf32x3", 128): K(128, 64, 8, 2),  # 41 / 31
}
_BACKWARD_FLOAT32 = {
    ("tf32", 64): (K(64, 128, 8, 2), K(64, 32, 4, 2), DQ_ATOMIC),  # 117 / 87
    ("tf32", 128): (K(32, 128, 8, 2), K(64, 32, 4, 2), DQ_TMA),  # 100 / 60
    ("tf32x3", 64): (K(64, 64, 4, 2), K(64, 32, 4, 2), DQ_TMA),  # 34 / 25
    ("tf32x3", 128): (K(64, 64, 4, 2), K(64, 32, 4, 2), DQ_TMA),  # 19 / 12
}
# D256, and the float32 calls with a bias, dropout or pointer loads: the smallest tiles, which fit their shared
# memory.
_FLOAT32_UNTUNED = K(32, 64, 4, 1)
# With a bias (its tiles are pipelined like K and V) or dropout (its bits are shuffled through shared
# memory) the largest tiles above overflow the 227 KiB of shared memory of sm_90. Measured at B4 S2048 H16
# D128 (bench/attention_sweep.py --focus heavy): a bias runs best with 128x64 forward tiles and a separate
# dQ kernel (222 TFLOP/s backward vs 156 with in-kernel dQ), dropout with 64x64 forward tiles and in-kernel
# dQ (237 vs 197: the Philox bits are then drawn once per tile, not twice).
_FORWARD_BIAS = {64: K(128, 64, 4, 2), 128: K(128, 64, 8, 3), 256: K(64, 32, 4, 2)}
_FORWARD_DROPOUT = {64: K(64, 64, 4, 2), 128: K(64, 64, 4, 2), 256: K(64, 32, 4, 2)}
_BACKWARD_BIAS = {64: (K(64, 64, 4, 2), K(64, 64, 4, 2), DQ_SEPARATE),
                  128: (K(64, 64, 4, 2), K(64, 64, 4, 2), DQ_SEPARATE)}
_BACKWARD_DROPOUT = {128: (K(64, 128, 8, 3, tma=False), K(64, 64, 4, 2), DQ_TMA)}
# dQ-kernel tiles that fit next to a bias or dropout (deterministic mode, other head dims).
_Q_HEAVY = {64: K(64, 64, 4, 2), 128: K(64, 64, 4, 2), 256: K(32, 64, 8, 1)}
# GQA under a causal mask at D=128: the dQ kernel runs per query head, the kv kernel per kv head, so the
# split keeps more programs busy (B2 Hq32 Hkv8 S4096: 322 vs 277 TFLOP/s backward with in-kernel dQ).
_BACKWARD_GQA_CAUSAL_128 = (K(64, 64, 4, 2), K(64, 64, 4, 2), DQ_SEPARATE)
# Short causal sequences at D<=64 (B16 S1024 H32: 218 vs 197 TFLOP/s backward).
_BACKWARD_SHORT_CAUSAL_64 = (K(64, 64, 4, 2, tma=False), K(64, 64, 4, 2), DQ_TMA)
SHORT = 2048


def _bound(d: int) -> int:
    return 64 if d <= 64 else 128 if d <= 128 else 256


def forward_config(problem, dtype: torch.dtype, bias: bool = False, dropout: bool = False,
                   tma: bool = True) -> KernelConfig:
    """``tma``: whether the tiles will load through TMA (the tuned float32 tiles need it: with pointer loads
    they overflow shared memory)."""
    if interpreter_enabled():
        return INTERPRETER_CONFIG
    bound = _bound(max(problem.head_dim, problem.head_dim_v))
    if dtype == torch.float32:
        if bias or dropout or not tma:  # the tuned float32 tiles would overflow shared memory: untuned
            return _FLOAT32_UNTUNED
        return _FORWARD_FLOAT32.get((dot_precision(dtype), bound), _FLOAT32_UNTUNED)
    if dropout:
        return _FORWARD_DROPOUT[bound]
    if bias:
        return _FORWARD_BIAS[bound]
    return _FORWARD[bound]


def _tma_reduce_available(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def backward_config(problem, dtype: torch.dtype, masked: bool, deterministic: bool, device: torch.device,
                    bias: bool = False, dropout: bool = False, tma: bool = True) -> BackwardConfig:
    """``masked``: causal or a window; ``tma`` as in :func:`forward_config`."""
    if interpreter_enabled():
        mode = DQ_SEPARATE if deterministic else DQ_ATOMIC
        return BackwardConfig(INTERPRETER_CONFIG, INTERPRETER_CONFIG, mode)
    bound = _bound(max(problem.head_dim, problem.head_dim_v))
    if dtype == torch.float32:
        untuned = (_FLOAT32_UNTUNED, _FLOAT32_UNTUNED, DQ_TMA)
        tuned = not (bias or dropout) and tma
        kv, q, mode = _BACKWARD_FLOAT32.get((dot_precision(dtype), bound), untuned) if tuned else untuned
    elif bias and bound in _BACKWARD_BIAS:
        kv, q, mode = _BACKWARD_BIAS[bound]
    elif dropout and bound in _BACKWARD_DROPOUT:
        kv, q, mode = _BACKWARD_DROPOUT[bound]
    elif bound == 64 and masked and problem.max_k <= SHORT:
        kv, q, mode = _BACKWARD_SHORT_CAUSAL_64
    elif bound == 128 and masked and problem.group > 1:
        kv, q, mode = _BACKWARD_GQA_CAUSAL_128
    else:
        kv, q, mode = _BACKWARD[(bound, masked)]
        if bias or dropout:
            q = _Q_HEAVY[bound]
    if deterministic:
        mode = DQ_SEPARATE
    elif mode == DQ_TMA and not _tma_reduce_available(device):
        mode = DQ_ATOMIC
    return BackwardConfig(kv, q, mode)
