"""What the Gluon kernels share: the Gluon imports, the register budget of their partitions, and where they
apply (an sm_90 GPU, heads packed in a row, TMA-aligned tensors)."""

from __future__ import annotations

import functools
import re

import torch

from ..._backend import interpreter_enabled
from ..triton.configs import compute_capability
from ..triton.launch import DATA_DEPENDENT, tma_aligned

# The kernels are written against Triton 3.6's Gluon API, which later releases change (3.9's has no
# gl.thread_barrier, so the kernels failed to compile there): with any other Triton the Triton kernels run instead.
GLUON_TRITON = (3, 6)


def gluon_api_supported(triton_version: str) -> bool:
    """Whether a Triton of this version string has the Gluon API the kernels are written for (``GLUON_TRITON``)."""
    release = re.match(r"(\d+)\.(\d+)", triton_version)
    return release is not None and (int(release[1]), int(release[2])) == GLUON_TRITON


try:  # (CI's CPU-only Triton may be another release; nothing here runs there)
    import triton

    if not gluon_api_supported(triton.__version__):
        raise ImportError(f"varlen's Gluon kernels need Triton {GLUON_TRITON[0]}.{GLUON_TRITON[1]}, "
                          f"not {triton.__version__}")
    from triton._C.libtriton import ir
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language._core import builtin
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False  # (the kernels are defined only when it is True; these names stay unused)
    ir = gluon = gl = builtin = fence_async_shared = mbarrier = tma = warpgroup_mma = warpgroup_mma_wait = None
    TensorDescriptor = None

__all__ = ["DATA_DEPENDENT", "GLUON_TRITON", "HAVE_GLUON", "TensorDescriptor", "builtin", "fence_async_shared", "gl",
           "gluon", "ir", "mbarrier", "tma", "warpgroup_mma", "warpgroup_mma_wait", "TILE_HEAD_DIMS",
           "tile_head_dim", "wide_tile_head_dim", "same_tile_head_dims", "wide_tile_head_dims",
           "plain_call", "hopper_layout",
           "host_head_descriptor", "head_descriptor", "sequence_descriptor", "load_head_tile", "store_head_tile",
           "query_vector",
           "sequences_adjacent", "shared_layout", "gluon_api_supported"]

# Registers per thread: a kernel's 384 threads (two warpgroups of consumers and the loader's warp, padded to
# four warps) share MAX_REGS x 384 (the launch's maxnreg); the loader keeps LOADER_REGS, each consumer
# warpgroup gets CONSUMER_REGS (the default partition receives what the workers leave). With three consumer
# warpgroups (512 threads: the forward at D64, gluon/forward.py's query_warpgroups), THREE_WG_MAX_REGS x 512: the
# two worker consumers get THREE_WG_CONSUMER_REGS, the loader LOADER_REGS, the default partition's consumer the
# rest (65536 / 128 - 2 x 160 - 24 = 168).
MAX_REGS = 168
CONSUMER_REGS = 240
LOADER_REGS = 24
THREE_WG_MAX_REGS = 128
THREE_WG_CONSUMER_REGS = 160


TILE_HEAD_DIMS = (64, 128)  # the head dims the Gluon kernels' tiles are written for


def tile_head_dim(head_dim: int) -> int | None:
    """The tile head dim (of :data:`TILE_HEAD_DIMS`) a Gluon kernel computes ``head_dim`` in: the smallest that
    holds it, for multiples of 8 (a head's row a whole number of 16-byte units, as TMA needs) from 40 to 128. Below
    the tile's, the kernels' descriptors are 3-D over (rows, heads, head_dim): their boxes read zeros past the head's
    last column (TMA's fill), which add nothing to Q Kᵀ and make zero columns of O, dK and dV (and of dQ, whose
    accumulator has the tile's columns), and their stores are clipped there (``head_descriptor``). None where no tile
    holds it, or where the Triton kernels are faster: at 32, half a tile of 64, the Gluon forward ran at 0.87-0.93x
    the Triton kernel (H200, bench/NOTES.md, "Head dims in a larger tile") and the backward at 0.77-1.00x (H100,
    "The Gluon backward at head dim 32"), where at 40 the forward ran 1.18-1.33x and at 80 and 96 1.29-1.74x, the
    backward 1.2-3.2x."""
    if head_dim % 8 or not 40 <= head_dim <= TILE_HEAD_DIMS[-1]:
        return None
    return next(d for d in TILE_HEAD_DIMS if head_dim <= d)


def wide_tile_head_dim(head_dim: int) -> int | None:
    """The tile head dim of the kernels that also take tiles past 128, the forward (``gluon/forward.py``) and the
    backward's dK and dV kernel (``gluon/backward_wide.py``): :func:`tile_head_dim`'s, 192 for head dims from 136 to
    192 and 256 from 200 to 256 (multiples of 8). A tile of 192 is computed as parts of 128 and 64 columns (Triton's
    tensors have power-of-two shapes: two accumulators, two boxes per tile); in a tile of 256 a head of 192 spent a
    quarter of every product on zeros. (``gluon/backward.py``'s kernel has no such tiles: each of its warpgroups holds
    its keys' 64 x D float32 dK and dV, which at 256 would alone take 256 registers per thread.)"""
    if head_dim % 8 == 0 and TILE_HEAD_DIMS[-1] < head_dim <= 256:
        return 192 if head_dim <= 192 else 256
    return tile_head_dim(head_dim)


def same_tile_head_dims(head_dim: int, head_dim_v: int) -> tuple[int, int] | None:
    """The tile head dims (of Q and K, of V and O) of ``gluon/backward.py``'s kernel: D = Dv in a
    :func:`tile_head_dim`."""
    tile = tile_head_dim(head_dim) if head_dim == head_dim_v else None
    return None if tile is None else (tile, tile)


def wide_tile_head_dims(head_dim: int, head_dim_v: int) -> tuple[int, int] | None:
    """The tile head dims of the forward (``gluon/forward.py``) and of the backward's dK and dV kernel
    (``gluon/backward_wide.py``): Q's and K's :func:`wide_tile_head_dim`, and V's and O's the same where Dv = D, else a
    tile of 64 or 128 (:func:`tile_head_dim`: a 64 x 128 float32 O takes no more registers than a tile of 128's), e.g.
    (192, 128) for multi-head latent attention's heads (DeepSeek-V2 and V3: q and k 192 = 128 + 64 rotary columns, v
    128); so Dv past 128 only where it equals D. None where no tile holds either."""
    tile = wide_tile_head_dim(head_dim)
    if tile is None or head_dim_v == head_dim:
        return None if tile is None else (tile, tile)
    value_tile = tile_head_dim(head_dim_v)
    return None if value_tile is None else (tile, value_tile)


def plain_call(problem, opts, dtype, bias, alibi, tiles=same_tile_head_dims) -> bool:
    """Whether a call is one the Gluon kernels compute (whatever the machine): fp16/bf16, head dims in the kernel's
    tiles (``tiles``: its rule, :func:`same_tile_head_dims` or :func:`wide_tile_head_dims`), no bias, ALiBi, softcap,
    prefix, documents or query positions (dropout allowed: without query positions each sequence draws its own mask, as
    the kernels do)."""
    if dtype not in (torch.float16, torch.bfloat16) or tiles(problem.head_dim, problem.head_dim_v) is None:
        return False
    if bias is not None or alibi is not None or opts.softcap > 0:
        return False
    return opts.prefix_len is None and opts.documents is None and opts.query_offset is None


def hopper_layout(*tensors) -> bool:
    """Whether a Gluon kernel can take these CUDA tensors here: Gluon present, not the interpreter, an sm_90
    GPU, each tensor's heads packed in a row (its descriptor spans rows x heads: ``head_descriptor``) and
    TMA-aligned."""
    q = tensors[0]
    if not HAVE_GLUON or interpreter_enabled() or q.device.type != "cuda":
        return False
    if compute_capability(q.device)[0] != 9:
        return False
    return all(t.stride(-2) == t.shape[-1] for t in tensors) and tma_aligned(*tensors)


def sequences_adjacent(*tensors) -> bool:
    """Whether each dense ``(B, S, ...)`` tensor's sequences lie one after another in memory, so that one
    descriptor spans all its B x S rows."""
    return all(t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1) for t in tensors)


@functools.cache
def shared_layout(block: tuple, dtype: torch.dtype):
    """The shared-memory layout a kernel gives a ``block`` tile of ``dtype`` (``NVMMASharedLayout``'s default),
    for descriptors made on the host, whose layout must match the kernel's."""
    gl_dtype = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for(list(block), gl_dtype)


def host_head_descriptor(t: torch.Tensor, box_rows: int, box_columns: int, tile_dim: int):
    """A TMA descriptor made on the host over a dense ``(B, S, heads, head_dim)`` tensor's B x S rows (its sequences
    one after another in memory), boxes of ``box_rows`` rows x ``box_columns`` of one head's columns, as
    ``head_descriptor`` makes them on the device for a tile head dim ``tile_dim``."""
    rows, heads, head_dim = t.shape[0] * t.shape[1], t.shape[2], t.shape[3]
    if head_dim == tile_dim:
        box = [box_rows, box_columns]
        return TensorDescriptor(t, [rows, heads * head_dim], [t.stride(1), 1], box, shared_layout(tuple(box), t.dtype))
    box = [box_rows, 1, box_columns]
    return TensorDescriptor(t, [rows, heads, head_dim], [t.stride(1), t.stride(2), 1], box,
                            shared_layout(tuple(box), t.dtype))


if HAVE_GLUON:
    @gluon.jit
    def head_descriptor(ptr, rows, heads, row_stride, BOX_ROWS: gl.constexpr, BOX_COLUMNS: gl.constexpr,
                        D: gl.constexpr, HEAD_D: gl.constexpr):
        """A TMA descriptor over a tensor's ``rows`` x ``heads`` heads of ``HEAD_D`` columns (heads packed in a row,
        rows ``row_stride`` elements apart), boxes of ``BOX_ROWS`` rows x ``BOX_COLUMNS`` of one head's columns, for
        tiles of head dim ``D``: over rows x (heads x D) where ``HEAD_D`` is ``D``; else 3-D over (rows, heads,
        HEAD_D), whose boxes read zeros past a head's ``HEAD_D`` columns and store nothing there
        (:func:`tile_head_dim`). Copies through it: ``load_head_tile``, ``store_head_tile``."""
        dtype: gl.constexpr = ptr.dtype.element_ty
        if HEAD_D == D:
            return tma.make_tensor_descriptor(ptr, [rows, heads * D], [row_stride, 1], [BOX_ROWS, BOX_COLUMNS],
                                              gl.NVMMASharedLayout.get_default_for([BOX_ROWS, BOX_COLUMNS], dtype))
        else:
            return tma.make_tensor_descriptor(ptr, [rows, heads, HEAD_D], [row_stride, HEAD_D, 1],
                                              [BOX_ROWS, 1, BOX_COLUMNS],
                                              gl.NVMMASharedLayout.get_default_for([BOX_ROWS, 1, BOX_COLUMNS], dtype))

    @gluon.jit
    def sequence_descriptor(host_desc, ptr, rows, heads, row_stride, BOX_ROWS: gl.constexpr,
                            BOX_COLUMNS: gl.constexpr, D: gl.constexpr, HEAD_D: gl.constexpr, HOST: gl.constexpr):
        """``host_desc`` (``HOST``: made on the host over all B x S rows), or a :func:`head_descriptor` made here over
        the ``rows`` rows of a sequence from ``ptr``, its first (boxes clip at the sequence's end). The Gluon backward
        kernels call this in each partition for the descriptors that partition copies through. A descriptor written on
        the device reaches TMA through an acquire fence, which Triton runs in the first warp of the partition that makes
        it, then a barrier of the partition; NVIDIA acquires in each warp that issues copies. Made in the partitions, a
        one-warp loader acquires what it loads through; a warpgroup's stores and reduces rely on that barrier where
        Triton splits a box into copies from several of its warps (its rows past the 128-byte swizzle: in the PTX, warps
        0 and 1 at 128 bf16 columns), as every Triton kernel that makes descriptors on the device does. (Made before the
        partitions, only the default partition's first warp acquired, and every other partition relied on the barriers
        across the partitions' start. Made in the partitions, the seven descriptors of the backward are also made side
        by side, not one after another: bench/NOTES.md, "Descriptors made by the partitions".)"""
        if HOST:
            return host_desc
        else:
            return head_descriptor(ptr, rows, heads, row_stride, BOX_ROWS, BOX_COLUMNS, D, HEAD_D)

    @gluon.jit
    def head_box(smem, desc, FIRST_ROW: gl.constexpr):
        """Rows ``FIRST_ROW..`` (as many as ``desc``'s box has) of a 2-D shared-memory tile, as the destination or
        source of ``desc``'s box: where that is 3-D (a middle dim of 1), the whole tile reinterpreted (the same
        bytes), then sliced, since the rows of a slice of a wider tile need not lie together (128-byte swizzled
        columns are stored in chunks of 64 two-byte columns, each over all the tile's rows)."""
        ROWS: gl.constexpr = desc.block_shape[0]
        if len(desc.block_shape) == 3:
            smem = smem._reinterpret(smem.dtype, [smem.shape[0], 1, smem.shape[1]], desc.layout)
        if smem.shape[0] == ROWS:
            return smem
        else:
            return smem.slice(FIRST_ROW, ROWS)

    @gluon.jit
    def load_head_tile(desc, row, head, barrier, smem, D: gl.constexpr, HEAD_D: gl.constexpr, COLUMN: gl.constexpr = 0):
        """TMA load of the box at row ``row`` of head ``head`` of a ``head_descriptor`` into ``smem`` (a tile of
        the box's rows), its bytes counted on ``barrier``; ``COLUMN``: the box's first column in the head (a tile of
        192 loads as boxes of 128 and 64 columns, ``wide_tile_head_dim``)."""
        coord = [row, head * D + COLUMN] if HEAD_D == D else [row, head, COLUMN]
        tma.async_copy_global_to_shared(desc, coord, barrier, head_box(smem, desc, 0))

    @gluon.jit
    def store_head_tile(desc, row, head, smem, FIRST_ROW: gl.constexpr, D: gl.constexpr, HEAD_D: gl.constexpr,
                        COLUMN: gl.constexpr = 0):
        """TMA store of rows ``FIRST_ROW..`` of ``smem`` (as many as the box has) into the box at row ``row`` of
        head ``head`` of a ``head_descriptor`` (``COLUMN``: as :func:`load_head_tile`'s)."""
        coord = [row, head * D + COLUMN] if HEAD_D == D else [row, head, COLUMN]
        tma.async_copy_shared_to_global(desc, coord, head_box(smem, desc, FIRST_ROW))

    @gluon.jit
    def query_vector(ptr, m0, Lq, other, BM: gl.constexpr):
        """``ptr[m0 + i]`` for a tile's BM queries (``other`` past ``Lq``), loaded by the loader (one warp)."""
        gl.static_assert(BM % 32 == 0, "a whole number of queries per lane of the loader warp")
        queries = m0 + gl.arange(0, BM, layout=gl.BlockedLayout([BM // 32], [32], [1], [0]))
        return gl.load(ptr + queries, mask=queries < Lq, other=other)


else:  # pragma: no cover - depends on the installed Triton
    head_descriptor = sequence_descriptor = load_head_tile = store_head_tile = query_vector = None
