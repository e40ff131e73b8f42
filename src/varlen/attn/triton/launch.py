"""Host side of the attention launches: the constexpr bundles, which arguments change per batch, TMA.

Every kernel takes two constexpr bundles besides its tensor and runtime bundles (``program.py``,
``masks.py``, ``scores.py``):

- ``Features``: which layout, masks and score modifiers a call uses (one compiled variant each);
- ``Tiles``: head dims, tile sizes, GQA group, dot precision and whether tiles load through TMA.
"""

from __future__ import annotations

import collections
import functools

import torch

from ..._amp import dot_precision
from ..._backend import interpreter_enabled
from ..._triton import tl, triton
from ...tiling import next_power_of_2
from .configs import has_tma

Features = collections.namedtuple("Features", "VARLEN BOTTOM_RIGHT HAS_WL HAS_R PREFIX DOCS HAS_BIAS HAS_ALIBI "
                                              "SOFTCAP DROPOUT RAW_SCORES POSITIONS")
Tiles = collections.namedtuple("Tiles", "D DV BLOCK_M BLOCK_N BLOCK_D BLOCK_DV GROUP DOT_PRECISION TMA")

# Kernel arguments whose values change from batch to batch: row counts, longest lengths, the dropout key.
# Triton specializes integer arguments on their value (equal to 1, divisible by 16); these must not be, or
# every new batch could meet a new kernel variant and compile it. (tests/specialization_probe.py finds them.)
DATA_DEPENDENT = ["total_q", "total_k", "max_q", "max_k", "seed", "offset_lo"]


def head_block(d: int) -> int:
    """The power-of-two tile width a head dim is padded to inside the kernels."""
    return max(16, next_power_of_2(d))


def constexprs(bundle):
    """``bundle`` (a namedtuple or tuple) with each field wrapped in ``tl.constexpr``: Triton 3.6 hands a
    constexpr bundle's fields to the kernel as plain Python values, which builtins such as ``tl.zeros``
    reject; wrapped, they are constexprs (the interpreter takes either). Made once per distinct bundle (a few
    per model): wrapping costs microseconds on every launch."""
    return _wrapped(type(bundle), tuple(bundle))


@functools.lru_cache(maxsize=4096)
def _wrapped(kind, values):
    wrapped = [tl.constexpr(v) for v in values]
    return kind(*wrapped) if hasattr(kind, "_fields") else tuple(wrapped)


def features(problem, opts, bias, alibi, seed) -> Features:
    R = opts.visible_right()
    return constexprs(Features(VARLEN=not problem.dense, BOTTOM_RIGHT=opts.bottom_right, HAS_WL=opts.window_left >= 0,
                    HAS_R=R >= 0, PREFIX=opts.prefix_len is not None, DOCS=opts.documents is not None,
                    HAS_BIAS=bias is not None, HAS_ALIBI=alibi is not None, SOFTCAP=opts.softcap > 0,
                    DROPOUT=seed is not None, RAW_SCORES=raw_scores(opts, bias, alibi),
                    POSITIONS=opts.query_offset is not None))


def raw_scores(opts, bias, alibi) -> bool:
    """Whether the forward keeps raw ``q.k`` products, scaling them inside its ``exp2`` (FlashAttention-2's
    form): possible without softcap, bias and ALiBi, when a larger product is a larger score (scale >= 0).
    One FMA per score instead of a multiply and a subtract, and an lse of ``max * scale + log(sum)``
    whose large term is rounded once: within 2x the error of float32 math, where the scaled running max
    was 3.5x (float16, rows of length 1)."""
    return opts.softcap == 0 and bias is None and alibi is None and opts.scale >= 0


def tiles(problem, config, dtype: torch.dtype, tma: bool) -> Tiles:
    """The ``Tiles`` bundle of a kernel with ``config``'s blocks."""
    return constexprs(Tiles(D=problem.head_dim, DV=problem.head_dim_v, BLOCK_M=config.block_m,
                            BLOCK_N=config.block_n, BLOCK_D=head_block(problem.head_dim),
                            BLOCK_DV=head_block(problem.head_dim_v), GROUP=problem.group,
                            DOT_PRECISION=dot_precision(dtype), TMA=tma))


def use_tma(*tensors) -> bool:
    """Tiles load through TMA descriptors on Hopper+, when every base and row stride is 16-byte aligned."""
    if interpreter_enabled() or not has_tma(tensors[0].device) or not tma_aligned(*tensors):
        return False
    ensure_allocator()
    return True


def tma_aligned(*tensors) -> bool:
    """Whether every base address and every stride but the last is a multiple of 16 bytes (TMA's rule)."""
    for t in tensors:  # (loops, not nested any() over generators: half the host time, on every launch)
        if t.data_ptr() % 16:
            return False
        size = t.element_size()
        for stride in t.stride()[:-1]:
            if stride * size % 16:
                return False
    return True


def _torch_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Device-side descriptors need scratch memory from a Triton allocator; ours hands out torch memory.

    Triton keeps the allocator in a ContextVar, which autograd's backward thread does not inherit, so
    this runs before every launch that needs it; an allocator the user set is left alone.
    """
    from triton.runtime import _allocation  # Triton-only: this runs on the Triton path

    current = getattr(_allocation, "_allocator", None)
    if current is None or isinstance(current.get(), _allocation.NullAllocator):
        triton.set_allocator(_torch_scratch)
