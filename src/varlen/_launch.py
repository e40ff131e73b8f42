"""Kernel launches without Triton's per-launch binding: ``@fast_launch`` over a ``@triton.jit`` kernel.

``kernel[grid](*args, **kwargs)`` goes through Triton 3.6's ``JITFunction.run``, which binds every argument (each
tensor, integer and bundle field through ``specialize_impl``), builds a cache key as strings, reads the knobs and
checks the kernel's globals before the launcher runs: on the H100 machine's host 66-77 us per launch of the
attention forward in a tight loop, 108-156 us inside a training step, where the caches are cold (bench/NOTES.md,
"Host time per call"). A ``FastLaunch`` keeps what Triton compiled under a key of its own, made from the
arguments in Python (9-18 us for the attention kernels' 40-80 bundle fields on the development machine's CPU, a
few times that on the GPU machines' hosts), and launches a kept kernel through its launcher directly: 55-57 us per
forward launch in the same loop.

The key is never coarser than Triton's on CUDA: each argument's type, each tensor's dtype and 16-byte alignment,
each integer's value class (its width, being 1, being a multiple of 16), each top-level constexpr's value and type, a
constexpr bundle's identity (varlen makes one object per value), the launch options with their types, the kernel's
and the knob's debug flag and the instrumentation mode. So two calls with one key are two calls Triton would give one
compiled kernel; a new key goes through ``JITFunction.run`` (which compiles or finds its kernel, and launches it) and
keeps the kernel it returns. Anything else takes Triton's own path on every call: a hook on launches (a profiler's),
a pre-run hook, a grid given as a function, a kernel under the interpreter or without Triton, a Triton version whose
``run`` this doesn't mirror, a backend other than CUDA (ROCm specializes tensors on their storage's size too), an
argument of a type the key doesn't know, another current device than the kernel's. Not repeated on a kept kernel:
``run``'s check that the globals the kernel read are unchanged (varlen's kernels read module constants only).
``VARLEN_FAST_LAUNCH=0`` in the environment when varlen is imported leaves every kernel to Triton's path.
"""

from __future__ import annotations

import os

import torch

try:
    from triton import __version__ as _TRITON_VERSION
    from triton import knobs
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction
except ImportError:  # (no Triton, or one without these: every launch takes the kernel's own path)
    JITFunction = None

# Triton versions whose ``JITFunction.run`` this mirrors (its launcher's arguments, the knobs it reads), checked on
# the GPU (tests/test_launch.py); other versions launch through Triton's own path.
MIRRORED_TRITON = ("3.6.",)
# Keys kept per kernel, at most: a few per model and dtype in practice (varlen's bundles are made once per value).
KEPT_LIMIT = 256
_MISSING = object()


class _Unkeyed(Exception):
    """An argument the key can't represent: the launch takes Triton's path."""


def _extend_key(append, values) -> None:
    """Append (``append``: a list's) the key of each of ``values`` (non-constexpr arguments, or a bundle's fields). A
    leaf's first item is of a kind no other leaf's first item equals (an integer class is an int; the rest start with
    a string, a dtype or a type), so two keys are equal only where their structures are."""
    for value in values:
        kind = type(value)
        if kind is int:
            # Triton specializes an integer on its width (i32, i64, u64), on being 1 and on being a multiple of 16:
            # most are 32-bit and not 1 (False or True: a multiple of 16); the others 2 and up.
            if value != 1 and -2**31 <= value < 2**31:
                append(value % 16 == 0)
            else:
                width = 0 if -2**31 <= value < 2**31 else 4 if -2**63 <= value < 2**63 else 8
                append(width + (value == 1) * 2 + (value % 16 == 0))
        elif kind is torch.Tensor or isinstance(value, torch.Tensor):  # (a subclass too: a Parameter)
            append(value.dtype)
            append(value.data_ptr() % 16 == 0)
        elif value is None:
            append("none")
        elif kind is float:
            append("float")
        elif kind is bool:
            append("true" if value else "false")
        elif isinstance(value, tuple):  # (bundles: namedtuples of tensors, integers and constexprs)
            append(kind)
            append(len(value))
            _extend_key(append, value)
        elif kind.__name__ == "constexpr" or kind is str or isinstance(value, torch.dtype):
            append(kind)
            append(value)
        elif kind.__name__ == "TensorDescriptor":
            base = value.base
            append(kind)
            append((base.dtype, base.data_ptr() % 16 == 0, tuple(value.block_shape),
                    tuple(n % 16 == 0 for n in value.shape), tuple(n % 16 == 0 for n in value.strides),
                    getattr(value, "layout", None), value.padding))  # (Gluon's layout: hashable)
        else:
            raise _Unkeyed(kind)


def _hooked(hook) -> bool:
    """Whether a launch hook is set (a function, or a chain of them: later Triton versions keep an empty one)."""
    return hook is not None and bool(getattr(hook, "calls", True))


class FastLaunch:
    """A ``@triton.jit`` kernel whose launches skip Triton's binding once a call of the same key has compiled
    (module docstring). Launched as the kernel is, ``fast[grid](*args, **kwargs)``; other attributes are the
    kernel's."""

    def __init__(self, kernel):
        self.kernel = kernel
        self._names = tuple(p.name for p in kernel.params)
        self._defaults = {p.name: p.default for p in kernel.params if p.has_default}
        self._position = {name: i for i, name in enumerate(self._names)}
        self._runtime = tuple(i for i, p in enumerate(kernel.params) if not p.is_constexpr)
        self._constexprs = tuple(i for i, p in enumerate(kernel.params) if p.is_constexpr)
        self._kept = {}  # key -> (device, CompiledKernel, the constexprs: their identities are in the key)

    def __getattr__(self, name):
        if name == "kernel":  # (not set yet: an object being copied or unpickled)
            raise AttributeError(name)
        return getattr(self.kernel, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args, kwargs):
        """Launch on ``grid`` (a tuple of up to three ints); the kernel's own path where the key can't serve."""
        found = self._look_up(grid, args, kwargs)
        if found is None:
            return self.kernel[grid](*args, **kwargs)
        key, values, constexprs, kept = found
        if kept is not None:
            device, compiled, _ = kept
            if driver.active.get_current_device() == device:
                n = len(grid)
                compiled.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
                             driver.active.get_current_stream(device), compiled.function, compiled.packed_metadata,
                             None, None, None, *values)
                return compiled
        compiled = self.kernel[grid](*args, **kwargs)
        # (Not a tool's stand-in for run, nor an interpreted launch; CUDA's specialization only, see above.)
        if isinstance(compiled, CompiledKernel) and compiled.metadata.target.backend == "cuda":
            if len(self._kept) >= KEPT_LIMIT:  # (bundles made anew for each call would be new keys each time)
                self._kept.clear()
            self._kept[key] = (driver.active.get_current_device(), compiled, constexprs)
        return compiled

    def _look_up(self, grid, args, kwargs):
        """``(key, every parameter's value in order, the constexprs' values, the kept entry or None)``, or None where
        the call goes to Triton's path: hooks or a grid given as a function, or arguments Triton must refuse (extra,
        repeated, missing) or the key can't hold (an unknown type, an unhashable value)."""
        kernel = self.kernel
        if (_hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook)
                or kernel.pre_run_hooks or callable(grid)):
            return None
        n_args, names = len(args), self._names
        if n_args > len(names) or (n_args and any(name in kwargs for name in names[:n_args])):
            return None
        get = kwargs.get
        values = [*args, *[get(name, _MISSING) for name in names[n_args:]]]
        options = [(name, type(value), value) for name, value in kwargs.items() if name not in self._position]
        if n_args + len(kwargs) - len(options) < len(names):  # (parameters not given: their defaults)
            for i in range(n_args, len(names)):
                if values[i] is _MISSING:
                    values[i] = self._defaults.get(names[i], _MISSING)
                    if values[i] is _MISSING:
                        return None
        # Constexprs by value and type, as Triton compiles them; bundles (tuples) by identity: hashing their constexpr
        # fields costs microseconds, and the kept entry holds them, so no other bundle takes their id.
        constexprs = [values[i] for i in self._constexprs]
        key = [kernel.debug, knobs.runtime.debug, knobs.compilation.instrumentation_mode, *options,
               *[id(value) if isinstance(value, tuple) else (value, type(value)) for value in constexprs]]
        try:
            _extend_key(key.append, [values[i] for i in self._runtime])
            key = tuple(key)
            kept = self._kept.get(key)
        except (_Unkeyed, TypeError):  # (TypeError: an unhashable value)
            return None
        return key, values, constexprs, kept


def fast_launch(kernel):
    """``kernel`` (a ``@triton.jit`` or ``@gluon.jit`` kernel) as a :class:`FastLaunch`; as it is where it is no
    ``JITFunction`` (the interpreter's, or the stand-in without Triton), Triton's version is not one mirrored, or
    ``VARLEN_FAST_LAUNCH`` is ``0``."""
    if (JITFunction is None or not isinstance(kernel, JITFunction) or not _TRITON_VERSION.startswith(MIRRORED_TRITON)
            or os.environ.get("VARLEN_FAST_LAUNCH") == "0"):
        return kernel
    return FastLaunch(kernel)
