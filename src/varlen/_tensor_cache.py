"""Values derived from tensors (offsets, mostly), kept while the same tensors come back unchanged.

A model's layers pass their batch's offsets tensor call after call; what the host derives from it (an int32
copy, the CPU attention's length buckets) is made once per batch, not once per layer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch

T = TypeVar("T")


class TensorCache:
    """The last ``size`` values built, each keyed by its tensors (the same objects, their version counters
    unchanged: an in-place change misses) and an extra key; the oldest goes first."""

    def __init__(self, size: int):
        self.size = size
        self._entries: dict = {}

    def get(self, tensors: tuple[torch.Tensor, ...], extra: Hashable, build: Callable[[], T]) -> T:
        """The value kept for ``tensors`` and ``extra``, else ``build()`` (kept). Inference tensors, which have no
        version counter, are never kept."""
        if any(t.is_inference() for t in tensors):
            return build()
        key = (tuple(id(t) for t in tensors), tuple(t._version for t in tensors), extra)
        entry = self._entries.get(key)
        if entry is not None and all(ref() is t for ref, t in zip(entry[0], tensors, strict=True)):
            return entry[1]  # (the weak references tell a tensor from a new one at a freed one's address)
        value = build()
        if len(self._entries) >= self.size and key not in self._entries:
            del self._entries[next(iter(self._entries))]
        self._entries[key] = (tuple(weakref.ref(t) for t in tensors), value)
        return value
