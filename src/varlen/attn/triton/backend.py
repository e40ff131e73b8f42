"""The Triton attention backend: what it takes, and its forward and backward entry points."""

from __future__ import annotations

import torch

from ..._backend import triton_unsupported_reason
from ...capabilities import Capabilities
from ...tiling import last_dim_contiguous
from . import configs
from .backward import launch_backward
from .forward import launch_forward
from .launch import use_tma

NAME = "triton"
# Every feature; head dims up to 256 (the tiles of larger ones don't fit sm_90's shared memory); no float64
# (no float64 tensor-core dots).
CAPABILITIES = Capabilities("triton", (torch.float16, torch.bfloat16, torch.float32), ("cuda",), max_head_dim=256,
                            device_check=triton_unsupported_reason)


def forward(q, k, v, bias, alibi, problem, opts, seed):
    tma = use_tma(q, k, v)
    config = configs.forward_config(problem, q.dtype, q.device, bias=bias is not None, dropout=seed is not None,
                                    tma=tma)
    return launch_forward(q, k, v, bias, alibi, problem, opts, seed, config, tma=tma and config.tma)


def backward(dout, dlse, q, k, v, out, lse, bias, alibi, problem, opts, seed, needs_grad):
    dout = last_dim_contiguous(dout)  # (q, k and v come with a head dim of stride 1: options.py)
    if dlse is not None:
        dlse = dlse.contiguous()
    tma = use_tma(q, k, v, dout)
    config = configs.backward_config(problem, q.dtype, opts.masked, opts.deterministic, q.device,
                                     bias=bias is not None, dropout=seed is not None, tma=tma)
    return launch_backward(dout, dlse, q, k, v, out, lse, bias, alibi, problem, opts, seed, config,
                           need_dbias=bias is not None and needs_grad[3], tma=tma and config.kv.tma)
