"""Triton, or a stand-in when it isn't installed, so that ``import varlen`` works without it.

Triton is an optional dependency: the PyTorch paths (the CPU, and CUDA with ``backend="torch"``) need
none of it. Modules that define kernels import ``triton`` and ``tl`` from here. Without Triton the
stand-in lets those modules load (``@triton.jit`` gives a kernel that can't be launched, ``tl.constexpr``
and ``triton.constexpr_function`` work) and :data:`IMPORT_ERROR` says why; the backend choice reads it and never
picks the Triton path (asking for it raises ValueError with that message).
"""

from __future__ import annotations

import types

try:
    import triton
    import triton.language as tl

    IMPORT_ERROR: str | None = None
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by tests/test_packaging.py
    IMPORT_ERROR = f"triton is not installed ({exc})"

    class _Unlaunchable:
        """What ``@triton.jit`` gives without Triton: a kernel that says why it can't run."""

        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            raise RuntimeError(f"{self.fn.__name__}: {IMPORT_ERROR}")

        def __call__(self, *args, **kwargs):
            raise RuntimeError(f"{self.fn.__name__}: {IMPORT_ERROR}")

    def _jit(fn=None, **options):
        return _Unlaunchable(fn) if fn is not None else _Unlaunchable

    class _Constexpr:
        def __init__(self, value):
            self.value = value

    tl = types.SimpleNamespace(constexpr=_Constexpr, float32="fp32", float64="fp64")
    triton = types.SimpleNamespace(jit=_jit, constexpr_function=lambda fn: fn, language=tl)

__all__ = ["IMPORT_ERROR", "tl", "triton"]
