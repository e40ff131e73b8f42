"""Which implementation runs an op: the Triton kernels or the PyTorch path.

``"auto"`` picks Triton for CUDA tensors and PyTorch elsewhere. ``"triton"`` on CPU tensors is
allowed only under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton is imported): that
is how CI runs the kernels without a GPU. The choice is scoped with :func:`use_backend`, for the jagged
ops and ``varlen.attention`` alike; a ``backend=`` argument overrides it for one call. What each backend
runs is declared in ``varlen.capabilities``.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

from ._triton import IMPORT_ERROR

BACKENDS = ("auto", "triton", "torch")

# The scoped choice of `use_backend`, per thread. A threading.local rather than a ContextVar: torch.compile
# reads (and guards on) its attributes, but can't trace ContextVar.get (a graph break in every jagged op).
_scope = threading.local()


def scoped() -> str:
    """The backend chosen by this thread's innermost :func:`use_backend` (``"auto"`` outside any)."""
    return getattr(_scope, "name", "auto")


def interpreter_enabled() -> bool:
    """True when Triton kernels run through Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@contextlib.contextmanager
def use_backend(name: str):
    """Run the jagged ops and attention inside the block with backend ``name`` (``"auto"``, ``"triton"``,
    ``"torch"``), unless a call names its own ``backend=``."""
    if name not in BACKENDS:
        raise ValueError(f"backend: got {name!r}; allowed: {', '.join(map(repr, BACKENDS))}")
    previous = scoped()
    _scope.name = name
    try:
        yield
    finally:
        _scope.name = previous


def triton_unsupported_reason(device: torch.device) -> str | None:
    """Why the Triton kernels can't run on ``device``, or None when they can."""
    if IMPORT_ERROR is not None:
        return IMPORT_ERROR
    if device.type == "cuda":
        return None
    if device.type == "cpu" and interpreter_enabled():
        return None
    return (f"Triton kernels need a CUDA tensor, or TRITON_INTERPRET=1 for CPU tensors; "
            f"got a tensor on {device}")


def through_custom_op() -> bool:
    """Whether a jagged op calls its ``torch.library`` custom op rather than its implementation: while
    torch.compile traces (the graph holds the opaque op, its shape from the fake implementation) and under
    a dispatch mode (fake tensors, tracing, FLOP counters see the op). Plain eager calls skip it: the
    custom op's Python dispatch costs tens of microseconds of host time per call, as much as a small
    kernel's whole GPU time (so a benchmark of one op, or a small model, waits on the host)."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def gradient_op(function: type[torch.autograd.Function], run, *args):
    """A backward's gradient that is itself a jagged op: through that op's autograd ``function`` while autograd
    records (``create_graph=True``, where a double backward needs it), else ``run(*args)`` directly. A plain
    backward runs with grad mode off, where the Function's apply only costs host time (about 15 us on an H100
    host, a tenth of the backward call)."""
    return function.apply(*args) if torch.is_grad_enabled() else run(*args)


class _RefuseDoubleBackward(torch.autograd.Function):
    """Passes gradients through, attached to ``anchor`` (an input that requires grad, so that the outputs do too);
    differentiating them again raises NotImplementedError with ``message``."""

    @staticmethod
    def forward(message, anchor, *grads):
        return tuple(None if g is None else g.view_as(g) for g in grads)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.message = inputs[0]

    @staticmethod
    def backward(ctx, *_):
        raise NotImplementedError(ctx.message)


def refuse_double_backward(message: str, grads: tuple, *inputs) -> tuple:
    """A backward's ``grads``, made to raise ``NotImplementedError(message)`` if a double backward reaches them.

    ``torch.autograd.function.once_differentiable`` only guards a gradient whose incoming gradient requires grad: a
    gradient penalty (``grad(f(x), x, create_graph=True)``, then ``(g * x).sum().backward()``) would silently miss
    the second-order term. Here, under ``create_graph=True``, the gradients hang on one of ``inputs`` that requires
    grad, and differentiating them raises."""
    anchors = [t for t in inputs if t is not None and t.requires_grad]
    if torch.is_grad_enabled() and anchors:
        return _RefuseDoubleBackward.apply(message, anchors[0], *grads)
    return grads
