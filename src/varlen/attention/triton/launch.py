"""Host-side pieces shared by the attention launchers: strides, feature arguments, TMA checks."""

from __future__ import annotations

import functools

import torch
import triton
from triton.runtime import _allocation

from ..._backend import interpreter_enabled
from ..dropout import dropout_threshold
from .scores import LOG2E

# Kernel arguments whose values change from batch to batch: the longest lengths, the dropout key and the
# lse buffer's strides (its rows are the batch's tokens). Triton specializes integer arguments on their
# value (equal to 1, divisible by 16); these must not be, or every new batch could meet a new kernel
# variant and compile it. (tests/specialization_probe.py finds them.)
DATA_DEPENDENT = ["seq_q", "seq_k", "seed", "offset_lo", "stride_lb", "stride_lh"]


# Plain Python on the launch path: triton.cdiv / next_power_of_2 are JIT-callable wrappers in recent Triton,
# about 10 us per call on the host, which small attention calls feel.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def head_block(d: int) -> int:
    """The power-of-two tile width a head dim is padded to inside the kernels."""
    return max(16, 1 << (d - 1).bit_length())


def row_strides(t: torch.Tensor, dense: bool) -> tuple[int, int, int]:
    """(batch, row, head) strides of a (B, S, H, X) or (T, H, X) tensor; batch stride 0 when jagged."""
    return (t.stride(0), t.stride(1), t.stride(2)) if dense else (0, t.stride(0), t.stride(1))


def lse_strides(lse: torch.Tensor, dense: bool) -> tuple[int, int]:
    """(batch, head) strides of an lse-shaped buffer: (B, H, Sq) dense, (H, T) jagged (row stride 1)."""
    return (lse.stride(0), lse.stride(1)) if dense else (0, lse.stride(0))


def broadcast_strides(t: torch.Tensor) -> tuple[int, ...]:
    """Strides with 0 on size-1 dims, so a broadcast dim indexed by b, h, i or j reads one element."""
    return tuple(0 if n == 1 else s for n, s in zip(t.shape, t.stride(), strict=True))


def feature_args(q, bias, alibi, opts, seed):
    """Kernel arguments and constexprs for bias, ALiBi, softcap and dropout (placeholders when off).

    Positional: Bias, its 4 strides, Alibi, its 2 strides, softcap_scale, softcap2, seed, offset_lo,
    threshold, keep_scale.
    """
    has_bias, has_alibi, softcap, dropout = bias is not None, alibi is not None, opts.softcap > 0, seed is not None
    bias_args = (bias, *broadcast_strides(bias)) if has_bias else (q, 0, 0, 0, 0)
    alibi_args = (alibi, *broadcast_strides(alibi)) if has_alibi else (q, 0, 0)
    cap = opts.softcap if softcap else 1.0
    if dropout:
        # Philox keys with the seed's two words; the offset's high word is folded into the second.
        key = seed.seed ^ ((seed.offset >> 32) << 32)
        offset_lo = seed.offset & 0xFFFFFFFF
        offset_lo = offset_lo - 2**32 if offset_lo >= 2**31 else offset_lo  # the same bits, as an int32
        drop = (key, offset_lo, dropout_threshold(opts.dropout_p), 1.0 / (1.0 - opts.dropout_p))
    else:
        drop = (0, 0, 0, 1.0)
    args = (*bias_args, *alibi_args, opts.scale / cap, cap * LOG2E.value, *drop)
    constexprs = dict(HAS_BIAS=has_bias, HAS_ALIBI=has_alibi, SOFTCAP=softcap, DROPOUT=dropout)
    return args, constexprs


@functools.cache
def _has_tma(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_tma(*tensors) -> bool:
    """Tiles load through TMA descriptors on Hopper+, when every base and row stride is 16-byte aligned."""
    t0 = tensors[0]
    if t0.device.type != "cuda" or interpreter_enabled() or not _has_tma(t0.device.index or 0):
        return False
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16 or any((st * size) % 16 for st in t.stride()[:-1]):
            return False
    ensure_allocator()
    return True


def _torch_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Device-side descriptors need scratch memory from a Triton allocator; ours hands out torch memory.

    Triton keeps the allocator in a ContextVar, which autograd's backward thread does not inherit, so
    this runs before every launch that needs it; an allocator the user set is left alone.
    """
    current = getattr(_allocation, "_allocator", None)
    if current is None or isinstance(current.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)
