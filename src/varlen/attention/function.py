"""The autograd function gluing a backend's forward and backward.

Backend calling convention:
    forward(q, k, v, bias, alibi, problem, opts, seed) -> (out, lse)
    backward(dout, dlse, q, k, v, out, lse, bias, alibi, problem, opts, seed, needs_grad)
        -> (dq, dk, dv, dbias)
``needs_grad`` is ``(q, k, v, bias)`` booleans; ``dlse`` is None unless the caller used the lse;
``dbias`` has the bias's own shape and dtype (None when not needed).
"""

from __future__ import annotations

import torch


class _AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, alibi, problem, opts, impl, seed):
        out, lse = impl.forward(q, k, v, bias, alibi, problem, opts, seed)
        ctx.set_materialize_grads(False)
        if any(ctx.needs_input_grad[:4]):
            ctx.save_for_backward(q, k, v, out, lse, bias, alibi)
        ctx.problem, ctx.opts, ctx.impl, ctx.seed = problem, opts, impl, seed
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, bias, alibi = ctx.saved_tensors
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv, dbias = ctx.impl.backward(dout, dlse, q, k, v, out, lse, bias, alibi, ctx.problem,
                                              ctx.opts, ctx.seed, tuple(ctx.needs_input_grad[:4]))
        return dq, dk, dv, dbias, None, None, None, None, None


def attention_function(q, k, v, bias, alibi, problem, opts, impl, seed):
    """(out, lse) for normalized inputs (see ``options.py`` for layouts), differentiable."""
    return _AttentionFunction.apply(q, k, v, bias, alibi, problem, opts, impl, seed)
