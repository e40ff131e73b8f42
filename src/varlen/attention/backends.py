"""The attention backends, what each can take, and how a call picks one.

A backend is a module with ``NAME``, ``CAPABILITIES`` (a ``varlen.capabilities.Capabilities``: what it
runs), ``forward(...)`` and ``backward(...)`` (see ``function.py`` for the calling convention).
"""

from __future__ import annotations

import torch

from .. import _backend, capabilities
from .._checks import check_choice
from .options import AttentionOptions, DropoutSeed, Problem

_MODULES: dict = {}


def _modules():
    """The backend modules by name; the Triton one is imported on first use (it imports Triton)."""
    if not _MODULES:
        from . import torch_backend
        from .triton import backend as triton_backend

        _MODULES.update(triton=triton_backend, torch=torch_backend)
    return _MODULES


def module(name: str):
    """The backend module called ``name`` (``"triton"`` or ``"torch"``)."""
    return _modules()[name]


def select(name: str | None, q, bias, alibi, problem: Problem, opts: AttentionOptions):
    """The backend module that runs this call (``name`` None: the scope's choice, ``varlen.use_backend``);
    ValueError listing every reason when none can."""
    name = _backend.scoped() if name is None else name
    check_choice("backend", name, _backend.BACKENDS)
    modules = _modules()
    auto_order = ["triton", "torch"] if q.device.type == "cuda" else ["torch"]
    order = auto_order if name == "auto" else [name]
    call = capabilities.Call(q, bias, alibi, problem, opts)
    reasons = {}
    for candidate in order:
        why = capabilities.unsupported_reasons(modules[candidate].CAPABILITIES, call)
        if not why:
            return modules[candidate]
        reasons[candidate] = why
    listed = "; ".join(f"backend={n!r} can't take {', '.join(r)}" for n, r in reasons.items())
    raise ValueError(f"backend: no attention backend can run these inputs ({listed})")


def draw_dropout_seed(opts: AttentionOptions, generator: torch.Generator | None,
                      device: torch.device) -> DropoutSeed | None:
    """The Philox key of one call, drawn from ``generator`` on the host (no device sync).

    A CUDA generator gives its seed and current offset, then advances the offset, as PyTorch's own
    dropout does; a CPU generator gives a random 63-bit seed. Either way the generator's state moves,
    so consecutive calls get different masks and a restored state replays the same one.
    """
    if opts.dropout_p == 0.0:
        return None
    if generator is None:
        generator = default_generator(device)
    if generator.device.type == "cuda":
        offset = generator.get_offset()
        generator.set_offset(offset + 4)
        return DropoutSeed(seed=generator.initial_seed() & (2**63 - 1), offset=offset)
    seed = int(torch.randint(0, 2**63 - 1, (1,), generator=generator, dtype=torch.int64))
    return DropoutSeed(seed=seed, offset=0)


def default_generator(device: torch.device) -> torch.Generator:
    """Torch's default generator for ``device`` (the one ``varlen.attention`` draws from by default)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return torch.default_generator
