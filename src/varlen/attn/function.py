"""The attention op: one forward and one backward, run by a backend, glued to autograd.

Backend calling convention (a backend is a module of ``backends.py``):
    forward(q, k, v, bias, alibi, problem, opts, seed) -> (out, lse)
    backward(dout, dlse, q, k, v, out, lse, bias, alibi, problem, opts, seed, needs_grad)
        -> (dq, dk, dv, dbias)
``seed`` is a ``DropoutSeed`` or None (no dropout): the same object in an eager call's forward and backward, whose
``kept`` memo carries what the forward drew to the backward (``options.DropoutSeed``); ``needs_grad`` is ``(q, k, v,
bias)`` booleans;
``dlse`` is None when the caller didn't use the lse (eager; a compiled graph may pass zeros instead);
``dbias`` has the bias's own shape and dtype (None when not needed). Layouts are those of ``options.py``.

Two entries share :func:`run_forward` and :func:`run_backward`:

- Eager calls take ``_EagerAttention``, a plain ``autograd.Function`` (a custom op's Python dispatch costs
  a few hundred microseconds per call, the whole GPU time of a small attention). It supports
  ``torch.func.grad``/``vjp`` (``setup_context``); ``vmap`` raises a clear error.
- ``torch.compile`` traces the ops ``varlen::attention_forward`` and ``varlen::attention_backward``: opaque
  nodes whose fake implementations give the exact output shapes, so a compiled model keeps attention in
  one graph and the host ints ``max_q``/``max_k`` stay symbolic (new lengths reuse the graph). Ops take
  only tensors and primitives: the bias (which gets a gradient) on its own, the other optional tensors as
  one list (``EXTRA_TENSORS``: no gradient), the options as
  one argument per field of ``AttentionOptions`` (the schema is generated from the dataclass, so a new
  option crosses the boundary with no edit here), the backend by name, and the dropout seed as an int64 tensor
  (``[seed, offset]`` built on the host, or ``[key]`` drawn on the GPU inside a captured CUDA graph or a compiled
  graph: see :func:`dropout_seed`).

Double backward (the gradient of a gradient) is not supported: it raises a clear error, on both paths.
Outputs are contiguous (the fake implementations promise it), gradients included.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .. import _amp
from .._backend import refuse_double_backward
from .._checks import accumulate_dtype, capturing
from . import backends, op_checks
from .dropout import SEED_LIMIT, draw_dropout_seed
from .options import AttentionOptions, DropoutSeed, Problem

DOUBLE_BACKWARD = ("varlen.attention: double backward (the gradient of a gradient through attention) is not "
                   "supported; compute first-order gradients only (no create_graph=True through attention)")


# --------------------------------------------------------------------------------- shared core
def run_forward(impl, q, k, v, bias, alibi, problem: Problem, opts: AttentionOptions, seed: DropoutSeed | None):
    """``(out, lse)`` from the backend module ``impl``, contiguous, outside autocast."""
    with _amp.disabled(q.device):
        out, lse = impl.forward(q, k, v, bias, alibi, problem, opts, seed)
    return out.contiguous(), lse.contiguous()


def run_backward(impl, dout, dlse, q, k, v, out, lse, bias, alibi, problem: Problem, opts: AttentionOptions,
                 seed: DropoutSeed | None, needs: tuple[bool, bool, bool, bool]):
    """``(dq, dk, dv, dbias)`` (None where not needed), contiguous, outside autocast."""
    if impl.NAME != "torch" and any(map(_functorch_wrapped, (dout, q, k, v))):
        raise NotImplementedError("varlen.attention: torch.func transforms (grad, vjp, jacrev) run on the PyTorch "
                                  "backend only (pass backend='torch'); the Triton kernels take plain tensors")
    if dout is None:
        dout = torch.zeros_like(out)
    with _amp.disabled(q.device):
        grads = impl.backward(dout, dlse, q, k, v, out, lse, bias, alibi, problem, opts, seed, needs)
    return tuple(g.contiguous() if need else None for g, need in zip(grads, needs, strict=True))


def _eager_seed(seed: Tensor | None, inputs: tuple) -> DropoutSeed | None:
    """The ``DropoutSeed`` of an eager call, with an empty ``kept`` memo where a backward will follow (grad mode on and
    one of ``inputs`` requiring a gradient) and no saved-tensor hooks are set: its forward and backward get this one
    object. Under such hooks (activation checkpointing, ``save_on_cpu``) the caller has asked for what the backward
    needs to be dropped, moved or recomputed; a memo would keep it beside them, so the backward recomputes it."""
    if seed is None:
        return None
    backward = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    return _seed(seed, {} if backward and not _saved_tensor_hooks() else None)


def _saved_tensor_hooks() -> bool:
    """Whether saved-tensor hooks are set (``torch.autograd.graph.saved_tensors_hooks``: checkpointing, offloading)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is not None and top(True) is not None


def _functorch_wrapped(t) -> bool:
    """Whether ``t`` is a tensor wrapped by a ``torch.func`` transform."""
    check = getattr(torch._C._functorch, "is_functorch_wrapped_tensor", None)
    return t is not None and check is not None and check(t)


def _seed(seed: Tensor | None, kept: dict | None = None) -> DropoutSeed | None:
    """The ``DropoutSeed`` of :func:`dropout_seed`'s tensor: ``[seed, offset]`` on the host, or one key drawn on the
    device, which stays there (read on the host, it would sync, and break a capture); ``kept``: its memo."""
    if seed is None:
        return None
    if seed.dtype != torch.int64 or seed.dim() != 1 or seed.numel() not in (1, 2):
        raise ValueError(f"seed: expected int64 [seed, offset] on the host or [key] on the device, got shape "
                         f"{tuple(seed.shape)} of {seed.dtype}")
    if seed.numel() == 1:  # (the only one-element form: a host seed always comes with its offset)
        return DropoutSeed(seed=seed, offset=0, kept=kept)
    return DropoutSeed(*seed.tolist(), kept=kept)


# --------------------------------------------------------------------------------- eager entry
class _EagerAttention(torch.autograd.Function):
    @classmethod
    def apply(cls, *args):
        # torch's Function.apply binds the arguments through inspect.signature on every call when setup_context
        # is defined (for its functorch path): about 40 us, a third of this call's host time. The arguments are
        # always the nine positional ones, so outside functorch transforms they go to the C++ apply as they are.
        if torch._C._are_functorch_transforms_active():
            return super().apply(*args)
        return super(torch.autograd.Function, cls).apply(*torch._functorch.utils.unwrap_dead_wrappers(args))

    @staticmethod
    def forward(q, k, v, bias, alibi, problem, opts, impl, seed):
        """``seed``: the call's ``DropoutSeed`` (:func:`_eager_seed`), or None."""
        return run_forward(impl, q, k, v, bias, alibi, problem, opts, seed)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, bias, alibi, problem, opts, impl, seed = inputs
        ctx.set_materialize_grads(False)
        if any(ctx.needs_input_grad[:4]):
            ctx.save_for_backward(q, k, v, *output, bias, alibi)
        ctx.call = (problem, opts, impl, seed)

    @staticmethod
    def backward(ctx, dout, dlse):
        needs = tuple(ctx.needs_input_grad[:4])
        if (dout is None and dlse is None) or not any(needs):
            return (None,) * 9
        q, k, v, out, lse, bias, alibi = ctx.saved_tensors
        problem, opts, impl, seed = ctx.call
        with torch.no_grad():
            grads = run_backward(impl, dout, dlse, q, k, v, out, lse, bias, alibi, problem, opts, seed, needs)
        return (*refuse_double_backward(DOUBLE_BACKWARD, grads, dout, dlse, q, k, v), None, None, None, None, None)

    @staticmethod
    def vmap(info, in_dims, *args):
        raise NotImplementedError("varlen.attention: torch.func.vmap is not supported; attention already takes a "
                                  "batch dim (or jagged batches): fold the vmapped dim into it")


# ------------------------------------------------------------------------------- the op boundary
# AttentionOptions fields holding tensors cross in the extras list, the others as one argument each.
_TENSOR_OPTIONS = tuple(f.name for f in dataclasses.fields(AttentionOptions) if "Tensor" in f.type)
_OPTION_FIELDS = tuple(f.name for f in dataclasses.fields(AttentionOptions) if f.name not in _TENSOR_OPTIONS)
# The optional tensors without a gradient, in the ops' list.
EXTRA_TENSORS = ("alibi", "cu_q", "cu_k", "seed", *_TENSOR_OPTIONS)
_SCHEMA_TYPES = {"float": "float", "bool": "bool", "int": "int"}
_OPTIONS_SCHEMA = ", ".join(f"{_SCHEMA_TYPES[f.type]} {f.name}" for f in dataclasses.fields(AttentionOptions)
                            if f.name in _OPTION_FIELDS)


def flatten(alibi, problem: Problem, opts: AttentionOptions, backend: str, seed: Tensor | None):
    """``(extras, primitives)``: the ops' arguments after q, k, v and the bias. The problem's other fields are
    read back from the tensors (batch, heads, head dims, layout); ``max_q``/``max_k`` can't be, for jagged
    inputs."""
    extras = [alibi, problem.cu_q, problem.cu_k, seed, *(getattr(opts, name) for name in _TENSOR_OPTIONS)]
    return extras, (problem.max_q, problem.max_k, *(getattr(opts, name) for name in _OPTION_FIELDS), backend)


def rebuild(q, k, v, extras, primitives):
    """The inverse of :func:`flatten`: ``(alibi, problem, opts, backend, seed)``."""
    alibi, cu_q, cu_k, seed, *tensor_options = extras
    max_q, max_k, *options, backend = primitives
    problem = Problem(batch=q.shape[0] if cu_q is None else cu_q.shape[0] - 1, heads=q.shape[-2],
                      kv_heads=k.shape[-2], head_dim=q.shape[-1], head_dim_v=v.shape[-1], max_q=max_q,
                      max_k=max_k, dense=cu_q is None, cu_q=cu_q, cu_k=cu_k)
    opts = AttentionOptions(**dict(zip(_OPTION_FIELDS, options, strict=True)),
                            **dict(zip(_TENSOR_OPTIONS, tensor_options, strict=True)))
    return alibi, problem, opts, backend, _seed(seed)


_LIB = torch.library.Library("varlen", "FRAGMENT")
_LIB.define(f"attention_forward(Tensor q, Tensor k, Tensor v, Tensor? bias, Tensor?[] extras, SymInt max_q, "
            f"SymInt max_k, {_OPTIONS_SCHEMA}, str backend) -> (Tensor, Tensor)")
_LIB.define(f"attention_backward(Tensor dout, Tensor? dlse, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
            f"Tensor? bias, Tensor?[] extras, SymInt max_q, SymInt max_k, {_OPTIONS_SCHEMA}, str backend, "
            "bool[4] needs) -> Tensor[]")


def _forward_impl(q, k, v, bias, extras, *primitives):
    alibi, problem, opts, backend, seed = rebuild(q, k, v, extras, primitives)
    q, k, v, bias, alibi, problem, opts = op_checks.forward_operands(q, k, v, bias, alibi, problem, opts)
    impl = backends.select(backend, q, bias, alibi, problem, opts)
    return run_forward(impl, q, k, v, bias, alibi, problem, opts, seed)


def _backward_impl(dout, dlse, q, k, v, out, lse, bias, extras, *primitives_and_needs):
    """The gradients flagged in ``needs``, in the order q, k, v, bias (an op can't return None, so the list
    holds only the needed ones)."""
    *primitives, needs = primitives_and_needs
    alibi, problem, opts, backend, seed = rebuild(q, k, v, extras, primitives)
    q, k, v, bias, alibi, problem, opts = op_checks.forward_operands(q, k, v, bias, alibi, problem, opts)
    dout, dlse, out, lse = op_checks.backward_operands(dout, dlse, q, v, out, lse, bias, problem, needs)
    impl = backends.select(backend, q, bias, alibi, problem, opts)
    grads = run_backward(impl, dout, dlse, q, k, v, out, lse, bias, alibi, problem, opts, seed, tuple(needs))
    return [g for g in grads if g is not None]


def _forward_fake(q, k, v, bias, extras, *primitives):
    cu_q = extras[EXTRA_TENSORS.index("cu_q")]
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))
    return out, q.new_empty(op_checks.lse_shape(q, cu_q), dtype=accumulate_dtype(q.dtype))


def _backward_fake(dout, dlse, q, k, v, out, lse, bias, extras, *primitives_and_needs):
    needs = primitives_and_needs[-1]
    return [t.new_empty(t.shape) for t, need in zip((q, k, v, bias), needs, strict=True) if need]


def _setup_context(ctx, inputs, output):
    q, k, v, bias, extras, *primitives = inputs
    ctx.set_materialize_grads(False)
    ctx.primitives = primitives
    ctx.needs = tuple(ctx.needs_input_grad[:4])
    if any(ctx.needs):
        ctx.save_for_backward(q, k, v, *output, bias, *extras)


def _backward(ctx, dout, dlse):
    nones = (None,) * (1 + len(ctx.primitives))  # the extras and the primitives get no gradient
    if (dout is None and dlse is None) or not any(ctx.needs):
        return None, None, None, None, *nones
    q, k, v, out, lse, bias, *extras = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    grads = iter(torch.ops.varlen.attention_backward(dout, dlse, q, k, v, out, lse, bias, extras, *ctx.primitives,
                                                     list(ctx.needs)))
    return (*(next(grads) if need else None for need in ctx.needs), *nones)


def _no_double_backward(ctx, *_):
    raise NotImplementedError(DOUBLE_BACKWARD)


_LIB.impl("attention_forward", _forward_impl, "CompositeExplicitAutograd")
_LIB.impl("attention_backward", _backward_impl, "CompositeExplicitAutograd")
torch.library.register_fake("varlen::attention_forward", _forward_fake, lib=_LIB)
torch.library.register_fake("varlen::attention_backward", _backward_fake, lib=_LIB)
torch.library.register_autograd("varlen::attention_forward", _backward, setup_context=_setup_context, lib=_LIB)
torch.library.register_autograd("varlen::attention_backward", _no_double_backward,
                                setup_context=lambda ctx, inputs, output: None, lib=_LIB)


# ---------------------------------------------------------------------------------------- entry
def dropout_seed(opts: AttentionOptions, generator: torch.Generator | None, device: torch.device) -> Tensor | None:
    """The dropout seed of one call as an int64 tensor, or None without dropout: ``[seed, offset]`` on the host, or
    ``[key]`` on ``device`` where the host can't hold the key (:func:`_seed` reads either).

    Eager: drawn from ``generator`` by :func:`dropout.draw_dropout_seed` (so ``varlen.attention_dropout_mask``
    predicts the mask). While a CUDA graph is being captured, drawn on the device with ``torch.randint`` from
    ``generator`` (torch's default CUDA generator when None; another CUDA generator must be registered with the
    graph), graph-safely like torch's random ops: each replay of the graph draws a new key, which the kernels load,
    so each replay drops other weights (a host value would be replayed as it was captured);
    ``attention_dropout_mask`` can't predict those masks. Inside ``torch.compile`` the graph draws it with
    ``torch.randint`` from the default generator of the call's device, on the GPU for CUDA calls (reproducible under
    ``torch.manual_seed``, but not the eager call's mask; a CUDA graph of the compiled code,
    ``mode="reduce-overhead"``, draws anew on each replay); a ``generator`` can't be passed there.
    """
    if opts.dropout_p == 0.0:
        return None
    if torch.compiler.is_compiling():
        if generator is not None:
            raise ValueError("generator: not supported inside torch.compile (the compiled graph draws the "
                             "dropout seed from the default generator); pass generator=None")
        if device.type == "cuda":
            return torch.randint(0, SEED_LIMIT, (1,), dtype=torch.int64, device=device)
        return torch.randint(0, SEED_LIMIT, (2,), dtype=torch.int64, device="cpu")
    if capturing(device):
        return _captured_seed(opts, generator, device)
    drawn = draw_dropout_seed(generator, device)
    return torch.tensor([drawn.seed, drawn.offset], dtype=torch.int64)


def _captured_seed(opts: AttentionOptions, generator: torch.Generator | None, device: torch.device) -> Tensor:
    """The key of a call inside a CUDA graph capture, drawn on ``device`` from ``generator``; a generator the capture
    can't draw from raises a ValueError that says which one it can (torch's own errors name neither)."""
    if generator is not None and generator.device.type != device.type:
        raise ValueError(f"generator: a {generator.device.type} generator while a CUDA graph is being captured "
                         f"(dropout_p={opts.dropout_p}); inside a capture the key is drawn on the GPU: pass None "
                         "(torch's default CUDA generator) or a CUDA generator registered with the graph "
                         "(graph.register_generator_state(generator))")
    try:
        return torch.randint(0, SEED_LIMIT, (1,), dtype=torch.int64, device=device, generator=generator)
    except RuntimeError as error:
        if "not in capture mode" not in str(error):
            raise
        raise ValueError("generator: this CUDA generator is not registered with the CUDA graph being captured; "
                         "call graph.register_generator_state(generator) before the capture, or pass None (torch's "
                         "default CUDA generator)") from error


def attention_function(q, k, v, bias, alibi, problem: Problem, opts: AttentionOptions, impl, seed: Tensor | None):
    """(out, lse) for normalized inputs (see ``options.py`` for layouts), differentiable.

    ``impl`` is the backend module; ``seed`` comes from :func:`dropout_seed`.
    """
    if not torch.compiler.is_compiling():
        return _EagerAttention.apply(q, k, v, bias, alibi, problem, opts, impl, _eager_seed(seed, (q, k, v, bias)))
    extras, primitives = flatten(alibi, problem, opts, impl.NAME, seed)
    return torch.ops.varlen.attention_forward(q, k, v, bias, extras, *primitives)
