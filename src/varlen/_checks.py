"""Input validation that survives ``python -O``.

Every error names the argument, the value it got, and what is allowed. Library code validates with
these helpers (or raises ValueError/TypeError itself), never with ``assert``.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
from collections.abc import Iterable

import torch

INT32_MAX = 2**31 - 1

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


# ------------------------------------------------------------------------------------ checking mode
_checks_on = os.environ.get("VARLEN_CHECKS", "").strip().lower() not in ("", "0", "false", "no", "off")


def set_checks(enabled: bool) -> None:
    """Turn the checking mode on or off (its initial state: the ``VARLEN_CHECKS`` environment variable,
    on for ``1``/``true``/``yes``/``on``).

    The trust contract: offsets (``cu_seqlens``) and maximum lengths (``max_seqlen``, ``max_len``, a
    nested tensor's max-seqlen hint) on a GPU are trusted, because checking them against the data reads
    them on the host (a device-to-host sync per call). Wrong ones never make a kernel read or write
    outside its tensors (sequence bounds are clamped to the buffers inside the kernels), but the rows they
    describe wrongly hold unspecified values. In checking mode they are read and validated on every call
    that takes them, with the errors the CPU always gives: offsets start at 0, never decrease and end at
    the row count, and no sequence is longer than its maximum (a larger maximum is legal); ``cross_entropy``'s
    targets lie in the logits' classes; ``query_offset`` is in range. On the CPU they are always checked (reading
    them costs no sync). Nothing is checked while ``torch.compile`` traces: a read there would break the graph.
    """
    global _checks_on
    _checks_on = check_bool("enabled", enabled)


def checks_enabled() -> bool:
    """Whether the checking mode is on (see :func:`set_checks`)."""
    return _checks_on


def checks_metadata(device: torch.device) -> bool:
    """Whether offsets and maximum lengths on ``device`` are validated against the data: always on the
    CPU, on a GPU in checking mode, never while torch.compile traces."""
    if torch.compiler.is_compiling():
        return False
    return device.type == "cpu" or (_checks_on and device.type != "meta")


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on ``device``'s current stream (never for a non-CUDA device)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype varlen computes and accumulates in for inputs of ``dtype``: float64 for float64, else
    float32 (also the dtype of attention's lse)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _names(items: Iterable) -> str:
    return ", ".join(str(i).replace("torch.", "") for i in items)


def type_name(value) -> str:
    """``value``'s type as an error names it: ``int``, ``numpy.bool``, ``torch.Tensor`` (a bare ``bool`` would not tell
    numpy's bool from Python's)."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def check_tensor(name: str, value, *, kind: str = "a torch.Tensor") -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected {kind}, got {type_name(value)}")
    return value


def check_dtype(name: str, t: torch.Tensor, allowed: Iterable[torch.dtype]) -> None:
    allowed = tuple(allowed)
    if t.dtype not in allowed:
        raise TypeError(f"{name}: dtype {str(t.dtype).replace('torch.', '')} is not supported; allowed: "
                        f"{_names(allowed)}")


def check_ndim(name: str, t: torch.Tensor, ndim: int, layout: str) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims {layout}, got shape {tuple(t.shape)}")


def check_rows(name: str, t: torch.Tensor, rows: int, what: str) -> None:
    """``t``'s first dim is ``rows`` long (``what``: what those rows are), as a kernel indexing it by them reads (a
    custom op can be called directly with any shapes)."""
    if t.dim() == 0 or t.shape[0] != rows:
        raise ValueError(f"{name}: expected {rows} rows, {what}; got shape {tuple(t.shape)}")


def check_same_device(names_and_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    items = [(n, t) for n, t in names_and_tensors if t is not None]
    if not items:
        return
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{name}: on device {t.device}, but {first_name} is on {first.device}; "
                             "all inputs must be on one device")


def check_same_dtype(names_and_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    items = [(n, t) for n, t in names_and_tensors if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.dtype != first.dtype:
            raise TypeError(f"{name}: dtype {t.dtype} differs from {first_name}'s {first.dtype}; "
                            "they must match")


def check_choice(name: str, value, allowed: Iterable) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name}: got {value!r}; allowed: {', '.join(repr(a) for a in allowed)}")


def check_bool(name: str, value, *, allow_none: bool = False) -> bool | None:
    """A Python bool (or None where ``allow_none``), returned as is; TypeError naming the argument and the type it got
    otherwise. As torch's own flags, numpy's bool is refused."""
    if not (isinstance(value, bool) or value is None and allow_none):
        raise TypeError(f"{name}: expected a bool{' or None' if allow_none else ''}, got {type_name(value)} {value!r}")
    return value


def is_int(value) -> bool:
    """Whether :func:`check_int` takes ``value``: an int or another integral number (a numpy int), not a bool."""
    if isinstance(value, bool):
        return False
    # (int first: under torch.compile a symbolic int passes it, and the ABC is never asked.)
    return True if isinstance(value, int) else isinstance(value, numbers.Integral)


def check_int(name: str, value, *, minimum: int | None = None) -> int:
    """An int (not a bool), returned as a Python int: as torch's own arguments, other integral numbers (a numpy int)
    are taken through ``operator.index``; a Python int, symbolic under torch.compile, is returned as it is (its
    index would fix it to this call's value)."""
    if not is_int(value):
        raise TypeError(f"{name}: expected an int, got {type_name(value)} {value!r}")
    if not isinstance(value, int):
        value = operator.index(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name}: got {value}; must be >= {minimum}")
    return value


def check_real(name: str, value) -> float:
    """A real number (not a bool), returned as a float; TypeError naming the argument otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type_name(value)} {value!r}")
    return float(value)


# The magnitudes a softmax scale may take: the kernels compute in float32, with the scale and its inverse.
SCALE_RANGE = (2.0**-100, 2.0**100)


def check_scale(name: str, value, *, allow_none: bool = False) -> float | None:
    """A softmax scale: a real number, finite and nonzero, returned as a float (None passes where ``allow_none``).
    Zero is refused: it weighs every visible key alike, and the kernels scale scores that masks have made -inf, which
    gave NaN; varlen refuses it rather than compute it wrong. So is a magnitude outside ``SCALE_RANGE``, where the
    scale or its inverse is 0 or infinite in float32 (1e-46 was accepted, and gave NaN)."""
    if value is None and allow_none:
        return None
    expected = f"{'None or ' if allow_none else ''}a nonzero finite float"
    # (Comparisons, not math.isfinite, which torch.compile can't trace on a symbolic float: a module's scale.)
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not -math.inf < value < math.inf or value == 0:
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    if not SCALE_RANGE[0] <= abs(value) <= SCALE_RANGE[1]:
        raise ValueError(f"{name}: expected {expected}, got {value!r}: its magnitude must lie in [2**-100, 2**100] "
                         "(the kernels compute in float32, with 1 / scale too)")
    return float(value)


def check_probability(name: str, value) -> float:
    """A dropout probability: a real number in ``[0, 1)``, returned as a float."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < 1:
        raise ValueError(f"{name}: expected a float in [0, 1), got {value!r}")
    return float(value)


def check_generator(name: str, value) -> None:
    if value is not None and not isinstance(value, torch.Generator):
        raise TypeError(f"{name}: expected a torch.Generator or None, got {type_name(value)}")


def is_integer_dtype(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` holds integers: neither floating point, complex nor bool."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def host_int(name: str, value) -> int:
    """``value`` as a non-negative Python int: an int (or another integral number, e.g. a numpy int), or a
    1-element integer tensor, read on the host (a device-to-host copy on a GPU). Bools, floats and other
    tensors are rejected with :func:`check_int`'s errors."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or not is_integer_dtype(value.dtype):
            raise TypeError(f"{name}: expected an int, got Tensor of shape {tuple(value.shape)} and dtype "
                            f"{value.dtype}")
        value = int(value)
    return check_int(name, value, minimum=0)


def normalize_dim(name: str, dim: int, ndim: int) -> int:
    dim = check_int(name, dim)
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name}: {dim} is out of range for a tensor of {ndim} dims "
                         f"(allowed: {-ndim} to {ndim - 1})")
    # A Python int even where dim is symbolic (an int argument of a function compiled with dynamic shapes): the dim
    # picks the computation, so a graph takes it as a constant (each comparison guards), and sets, sorts and `in` over
    # symbolic dims failed a fullgraph trace.
    dim %= ndim
    return next(constant for constant in range(ndim) if dim == constant)
