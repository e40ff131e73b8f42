"""The Triton attention backend: what it takes, and its forward and backward entry points."""

from __future__ import annotations

import torch

from ..._backend import triton_unsupported_reason
from . import configs
from .backward import launch_backward
from .forward import launch_forward
from .launch import use_tma

NAME = "triton"
MAX_HEAD_DIM = 256
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def unsupported_reasons(q, k, v, bias, alibi, problem, opts) -> list[str]:
    reasons = []
    device_reason = triton_unsupported_reason(q.device)
    if device_reason is not None:
        reasons.append(device_reason)
    if q.dtype not in DTYPES:
        reasons.append(f"dtype {q.dtype} is not supported (allowed: float16, bfloat16, float32)")
    if max(problem.head_dim, problem.head_dim_v) > MAX_HEAD_DIM:
        reasons.append(f"head dims ({problem.head_dim}, {problem.head_dim_v}) exceed {MAX_HEAD_DIM}")
    return reasons


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def forward(q, k, v, bias, alibi, problem, opts, seed):
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    tma = use_tma(q, k, v)
    config = configs.forward_config(problem, q.dtype, bias=bias is not None, dropout=seed is not None, tma=tma)
    return launch_forward(q, k, v, bias, alibi, problem, opts, seed, config, tma=tma and config.tma)


def backward(dout, dlse, q, k, v, out, lse, bias, alibi, problem, opts, seed, needs_grad):
    q, k, v, dout = (_last_dim_contiguous(t) for t in (q, k, v, dout))
    if dlse is not None:
        dlse = dlse.contiguous()
    tma = use_tma(q, k, v, dout)
    config = configs.backward_config(problem, q.dtype, opts.masked, opts.deterministic, q.device,
                                     bias=bias is not None, dropout=seed is not None, tma=tma)
    return launch_backward(dout, dlse, q, k, v, out, lse, bias, alibi, problem, opts, seed, config,
                           need_dbias=bias is not None and needs_grad[3], tma=tma and config.kv.tma)
