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
           "gluon", "ir", "mbarrier", "tma", "warpgroup_mma", "warpgroup_mma_wait", "HEAD_DIMS", "plain_call",
           "hopper_layout", "sequences_adjacent", "shared_layout", "gluon_api_supported"]

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


HEAD_DIMS = (64, 128)  # the head dims the Gluon kernels are written for (D = Dv)


def plain_call(problem, opts, dtype, bias, alibi) -> bool:
    """Whether a call is one the Gluon kernels compute (whatever the machine): fp16/bf16, D = Dv in
    :data:`HEAD_DIMS`, no bias, ALiBi, softcap, prefix, documents or query positions (dropout allowed: without
    query positions each sequence draws its own mask, as the kernels do)."""
    if dtype not in (torch.float16, torch.bfloat16) or problem.head_dim != problem.head_dim_v:
        return False
    if problem.head_dim not in HEAD_DIMS:
        return False
    if bias is not None or alibi is not None or opts.softcap > 0:
        return False
    return opts.prefix_len is None and opts.documents is None and opts.query_offset is None


def hopper_layout(head_dim: int, *tensors) -> bool:
    """Whether a Gluon kernel can take these CUDA tensors here: Gluon present, not the interpreter, an sm_90
    GPU, each tensor's heads packed in a row (its descriptor spans rows x (heads x D)) and TMA-aligned."""
    q = tensors[0]
    if not HAVE_GLUON or interpreter_enabled() or q.device.type != "cuda":
        return False
    if compute_capability(q.device)[0] != 9:
        return False
    return all(t.stride(-2) == head_dim for t in tensors) and tma_aligned(*tensors)


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
