"""The attention backends, what each can take, and how a call picks one.

A backend is a module with ``NAME``, ``CAPABILITIES`` (a ``varlen.capabilities.Capabilities``: what it
runs), ``forward(...)`` and ``backward(...)`` (see ``function.py`` for the calling convention).
"""

from __future__ import annotations

from .. import _backend, capabilities
from .._checks import check_choice
from . import torch_backend
from .options import AttentionOptions, Problem
from .triton import backend as triton_backend

_MODULES = {"triton": triton_backend, "torch": torch_backend}


def module(name: str):
    """The backend module called ``name`` (``"triton"`` or ``"torch"``)."""
    return _MODULES[name]


def select(name: str | None, q, bias, alibi, problem: Problem, opts: AttentionOptions):
    """The backend module that runs this call (``name`` None: the scope's choice, ``varlen.use_backend``);
    ValueError listing every reason when none can."""
    name = _backend.scoped() if name is None else name
    check_choice("backend", name, _backend.BACKENDS)
    auto_order = ["triton", "torch"] if q.device.type == "cuda" else ["torch"]
    order = auto_order if name == "auto" else [name]
    call = capabilities.Call(q, bias, alibi, problem, opts)
    reasons = {}
    for candidate in order:
        why = capabilities.unsupported_reasons(_MODULES[candidate].CAPABILITIES, call)
        if not why:
            return _MODULES[candidate]
        reasons[candidate] = why
    listed = "; ".join(f"backend={n!r} can't take {', '.join(r)}" for n, r in reasons.items())
    raise ValueError(f"backend: no attention backend can run these inputs ({listed})")
