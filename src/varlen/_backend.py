"""Which implementation runs an op: the Triton kernels or the PyTorch path.

``"auto"`` picks Triton for CUDA tensors and PyTorch elsewhere. ``"triton"`` on CPU tensors is
allowed only under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton is imported): that
is how CI runs the kernels without a GPU. The choice for the jagged ops is scoped with
:func:`use_backend`; ``varlen.attention`` takes its own ``backend=`` argument.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

BACKENDS = ("auto", "triton", "torch")

# The scoped choice of `use_backend`, per thread. A threading.local rather than a ContextVar: torch.compile
# reads (and guards on) its attributes, but can't trace ContextVar.get (a graph break in every jagged op).
_scope = threading.local()


def _scoped() -> str:
    return getattr(_scope, "name", "auto")


def interpreter_enabled() -> bool:
    """True when Triton kernels run through Triton's CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the machine
        return f"triton is not installed ({exc})"
    return None


# Computed once at import (the jagged ops import Triton then anyway): a constant, which torch.compile reads
# without the warning that a functools.cache-wrapped function draws.
_TRITON_IMPORT_ERROR = _triton_import_error()


def triton_import_error() -> str | None:
    """Why Triton can't be imported here, or None when it can."""
    return _TRITON_IMPORT_ERROR


@contextlib.contextmanager
def use_backend(name: str):
    """Run the jagged ops inside the block with backend ``name`` (``"auto"``, ``"triton"``, ``"torch"``)."""
    if name not in BACKENDS:
        raise ValueError(f"backend: got {name!r}; allowed: {', '.join(map(repr, BACKENDS))}")
    previous = _scoped()
    _scope.name = name
    try:
        yield
    finally:
        _scope.name = previous


def triton_unsupported_reason(device: torch.device) -> str | None:
    """Why the Triton kernels can't run on ``device``, or None when they can."""
    err = triton_import_error()
    if err is not None:
        return err
    if device.type == "cuda":
        return None
    if device.type == "cpu" and interpreter_enabled():
        return None
    return (f"Triton kernels need a CUDA tensor, or TRITON_INTERPRET=1 for CPU tensors; "
            f"got a tensor on {device}")


def resolve(device: torch.device, requested: str | None = None) -> str:
    """The backend (``"triton"`` or ``"torch"``) that runs an op on ``device``.

    ``requested`` overrides the scoped choice of :func:`use_backend`; ``"auto"`` means Triton on CUDA
    and PyTorch elsewhere. Asking for Triton where it can't run raises ValueError saying why.
    """
    name = _scoped() if requested is None else requested
    if name not in BACKENDS:
        raise ValueError(f"backend: got {name!r}; allowed: {', '.join(map(repr, BACKENDS))}")
    if name == "torch":
        return "torch"
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_import_error() is None else "torch"
    reason = triton_unsupported_reason(device)
    if reason is not None:
        raise ValueError(f"backend='triton' can't run here: {reason}")
    return "triton"
