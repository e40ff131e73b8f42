"""The attention op: two PyTorch custom ops (forward, backward) gluing a backend to autograd.

Backend calling convention (a backend is a module of ``backends.py``):
    forward(q, k, v, bias, alibi, problem, opts, seed) -> (out, lse)
    backward(dout, dlse, q, k, v, out, lse, bias, alibi, problem, opts, seed, needs_grad)
        -> (dq, dk, dv, dbias)
``seed`` is a ``DropoutSeed`` or None (no dropout); ``needs_grad`` is ``(q, k, v, bias)`` booleans;
``dlse`` is None when the caller didn't use the lse (eager; a compiled graph may pass zeros instead);
``dbias`` has the bias's own shape and dtype (None when not needed). Layouts are those of ``options.py``.
Double backward is not supported (the backward op has no derivative of its own).

Why custom ops. ``torch.compile`` sees ``varlen::attention_forward`` and ``varlen::attention_backward``
as two opaque nodes whose fake implementations give the exact output shapes, so a compiled model keeps
the attention in one graph (no break, whatever a backend does inside: Triton launches, the PyTorch
backend's loop over query chunks), and the host ints ``max_q``/``max_k`` stay symbolic: batches of new
lengths reuse the compiled graph. Custom ops take only tensors and primitives, so the frozen
``Problem``/``AttentionOptions`` are flattened into their fields at the boundary and rebuilt inside, the
backend travels by name, and the dropout seed as a CPU int64 tensor ``[seed, offset]`` (built on the host:
no device sync). Inside a compiled graph that tensor is drawn by the graph itself (:func:`dropout_seed`).

Outputs are contiguous (the fake implementations promise it), gradients included.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _amp
from .._checks import accumulate_dtype
from . import backends
from .options import AttentionOptions, DropoutSeed, Problem

# Seeds drawn inside a compiled graph lie in [0, SEED_LIMIT), as the eager ones (63 bits).
SEED_LIMIT = 2**63 - 1


# --------------------------------------------------------------------------------- the boundary
def _flatten(problem: Problem, opts: AttentionOptions, backend: str) -> tuple:
    """The primitives after the tensors in both ops' signatures. Shapes that the tensors carry (batch,
    heads, head dims) are read back from them; ``max_q``/``max_k`` are not, for jagged inputs."""
    return (problem.max_q, problem.max_k, opts.scale, opts.causal, opts.window_left, opts.window_right,
            opts.bottom_right, opts.softcap, opts.dropout_p, opts.deterministic, backend)


def _rebuild(q, k, v, cu_q, cu_k, seed, max_q, max_k, scale, causal, window_left, window_right, bottom_right,
             softcap, dropout_p, deterministic):
    problem = Problem(batch=q.shape[0] if cu_q is None else cu_q.shape[0] - 1, heads=q.shape[-2],
                      kv_heads=k.shape[-2], head_dim=q.shape[-1], head_dim_v=v.shape[-1], max_q=max_q,
                      max_k=max_k, dense=cu_q is None, cu_q=cu_q, cu_k=cu_k)
    opts = AttentionOptions(scale=scale, causal=causal, window_left=window_left, window_right=window_right,
                            bottom_right=bottom_right, softcap=softcap, dropout_p=dropout_p,
                            deterministic=deterministic)
    drawn = None if seed is None else DropoutSeed(*seed.tolist())
    return problem, opts, drawn


def _backend_module(name: str):
    return backends._modules()[name]


def _lse_shape(q: Tensor, cu_q: Tensor | None) -> tuple:
    """``(B, H, Sq)`` dense, ``(H, Tq)`` jagged."""
    return (q.shape[0], q.shape[2], q.shape[1]) if cu_q is None else (q.shape[1], q.shape[0])


# ------------------------------------------------------------------------------------ forward op
@torch.library.custom_op("varlen::attention_forward", mutates_args=())
def _forward_op(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, alibi: Tensor | None, cu_q: Tensor | None,
                cu_k: Tensor | None, seed: Tensor | None, max_q: int, max_k: int, scale: float, causal: bool,
                window_left: int, window_right: int, bottom_right: bool, softcap: float, dropout_p: float,
                deterministic: bool, backend: str) -> tuple[Tensor, Tensor]:
    problem, opts, drawn = _rebuild(q, k, v, cu_q, cu_k, seed, max_q, max_k, scale, causal, window_left,
                                    window_right, bottom_right, softcap, dropout_p, deterministic)
    with _amp.disabled(q.device):
        out, lse = _backend_module(backend).forward(q, k, v, bias, alibi, problem, opts, drawn)
    return out.contiguous(), lse.contiguous()


@_forward_op.register_fake
def _forward_fake(q, k, v, bias, alibi, cu_q, cu_k, seed, max_q, max_k, scale, causal, window_left, window_right,
                  bottom_right, softcap, dropout_p, deterministic, backend):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    return out, q.new_empty(_lse_shape(q, cu_q), dtype=accumulate_dtype(q.dtype))


# ----------------------------------------------------------------------------------- backward op
@torch.library.custom_op("varlen::attention_backward", mutates_args=())
def _backward_op(dout: Tensor, dlse: Tensor | None, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                 bias: Tensor | None, alibi: Tensor | None, cu_q: Tensor | None, cu_k: Tensor | None,
                 seed: Tensor | None, max_q: int, max_k: int, scale: float, causal: bool, window_left: int,
                 window_right: int, bottom_right: bool, softcap: float, dropout_p: float, deterministic: bool,
                 backend: str, need_q: bool, need_k: bool, need_v: bool, need_bias: bool) -> list[Tensor]:
    """The gradients of the inputs flagged ``need_*``, in the order q, k, v, bias (a custom op can't
    return None, so the list holds only the needed ones)."""
    problem, opts, drawn = _rebuild(q, k, v, cu_q, cu_k, seed, max_q, max_k, scale, causal, window_left,
                                    window_right, bottom_right, softcap, dropout_p, deterministic)
    needs = (need_q, need_k, need_v, need_bias)
    with _amp.disabled(q.device):
        grads = _backend_module(backend).backward(dout, dlse, q, k, v, out, lse, bias, alibi, problem, opts,
                                                  drawn, needs)
    return [g.contiguous() for g, need in zip(grads, needs, strict=True) if need]


@_backward_op.register_fake
def _backward_fake(dout, dlse, q, k, v, out, lse, bias, alibi, cu_q, cu_k, seed, max_q, max_k, scale, causal,
                   window_left, window_right, bottom_right, softcap, dropout_p, deterministic, backend, need_q,
                   need_k, need_v, need_bias):
    needs = (need_q, need_k, need_v, need_bias)
    return [t.new_empty(t.shape) for t, need in zip((q, k, v, bias), needs, strict=True) if need]


# ------------------------------------------------------------------------------------- autograd
_N_TENSOR_INPUTS = 8  # q, k, v, bias, alibi, cu_q, cu_k, seed


def _setup_context(ctx, inputs, output):
    q, k, v, bias, alibi, cu_q, cu_k, seed = inputs[:_N_TENSOR_INPUTS]
    out, lse = output
    ctx.set_materialize_grads(False)
    ctx.primitives = inputs[_N_TENSOR_INPUTS:]
    if any(ctx.needs_input_grad[:4]):
        ctx.save_for_backward(q, k, v, out, lse, bias, alibi, cu_q, cu_k, seed)


def _backward(ctx, dout, dlse):
    needs = tuple(ctx.needs_input_grad[:4])
    nones = (None,) * (_N_TENSOR_INPUTS - 4 + len(ctx.primitives))
    if dout is None and dlse is None:
        return (None,) * 4 + nones
    q, k, v, out, lse, bias, alibi, cu_q, cu_k, seed = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    grads = iter(torch.ops.varlen.attention_backward(dout, dlse, q, k, v, out, lse, bias, alibi, cu_q, cu_k, seed,
                                                     *ctx.primitives, *needs))
    return (*(next(grads) if need else None for need in needs), *nones)


_forward_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------- entry
def dropout_seed(opts: AttentionOptions, generator: torch.Generator | None, device: torch.device) -> Tensor | None:
    """The dropout seed of one call as a CPU int64 tensor ``[seed, offset]``, or None without dropout.

    Eager: drawn from ``generator`` by :func:`backends.draw_dropout_seed` (so
    ``varlen.attention_dropout_mask`` predicts the mask). Inside ``torch.compile`` the graph draws it
    with ``torch.randint`` from the default CPU generator (reproducible under ``torch.manual_seed``, but
    not the eager call's mask); a ``generator`` can't be passed there.
    """
    if opts.dropout_p == 0.0:
        return None
    if torch.compiler.is_compiling():
        if generator is not None:
            raise ValueError("generator: not supported inside torch.compile (the compiled graph draws the "
                             "dropout seed from the default generator); pass generator=None")
        return torch.randint(0, SEED_LIMIT, (2,), dtype=torch.int64, device="cpu")
    drawn = backends.draw_dropout_seed(opts, generator, device)
    return torch.tensor([drawn.seed, drawn.offset], dtype=torch.int64)


class _EagerAttention(torch.autograd.Function):
    """The same backend calls as the custom ops, for eager mode.

    Calling a ``torch.library.custom_op`` from Python costs a few hundred microseconds of dispatch
    (``fill_defaults`` alone took 0.16 ms per call here), which is the whole GPU time of a small attention
    (B16 S1024 H32 D64 causal ran at 89 TFLOP/s forward through the op on an H200). Eager calls take this
    plain autograd function; ``torch.compile`` traces the custom ops, whose results it must match (tested).
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, alibi, problem, opts, impl, seed):
        drawn = None if seed is None else DropoutSeed(*seed.tolist())
        with _amp.disabled(q.device):
            out, lse = impl.forward(q, k, v, bias, alibi, problem, opts, drawn)
        ctx.set_materialize_grads(False)
        if any(ctx.needs_input_grad[:4]):
            ctx.save_for_backward(q, k, v, out, lse, bias, alibi)
        ctx.call = (problem, opts, impl, drawn)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if dout is None and dlse is None:
            return (None,) * 9
        q, k, v, out, lse, bias, alibi = ctx.saved_tensors
        problem, opts, impl, drawn = ctx.call
        if dout is None:
            dout = torch.zeros_like(out)
        with _amp.disabled(q.device):
            grads = impl.backward(dout, dlse, q, k, v, out, lse, bias, alibi, problem, opts, drawn,
                                  tuple(ctx.needs_input_grad[:4]))
        return (*grads, None, None, None, None, None)


def attention_function(q, k, v, bias, alibi, problem: Problem, opts: AttentionOptions, impl, seed: Tensor | None):
    """(out, lse) for normalized inputs (see ``options.py`` for layouts), differentiable.

    ``impl`` is the backend module; ``seed`` comes from :func:`dropout_seed`.
    """
    if not torch.compiler.is_compiling():
        return _EagerAttention.apply(q, k, v, bias, alibi, problem, opts, impl, seed)
    return torch.ops.varlen.attention_forward(q, k, v, bias, alibi, problem.cu_q, problem.cu_k, seed,
                                              *_flatten(problem, opts, impl.NAME))
