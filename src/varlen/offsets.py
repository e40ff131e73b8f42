"""Offsets: the ``(B + 1,)`` row boundaries of a jagged batch, and what kernels and index ops derive from
them.

On a GPU offsets are trusted (checking them reads them on the host; see ``varlen.set_checks``), so
everything derived here is clamped to the rows it describes: wrong offsets give wrong sequences, never an
index outside a tensor. :func:`check_offsets` is the check itself.
"""

from __future__ import annotations

import torch

from ._checks import INDEX_DTYPES, capturing, check_dtype, check_tensor


def check_offsets_tensor(name: str, offsets) -> None:
    """What can be checked of offsets without reading them: a 1-D integer tensor of ``B + 1 >= 2`` entries."""
    check_tensor(name, offsets)
    if offsets.dim() != 1 or offsets.shape[0] < 2:
        raise ValueError(f"{name}: expected shape (B + 1,) with B >= 1, got {tuple(offsets.shape)}")
    check_dtype(name, offsets, INDEX_DTYPES)


def read_on_host(t: torch.Tensor, name: str, remedy: str) -> torch.Tensor:
    """Offsets or lengths ``t`` as a CPU int64 tensor: a device-to-host copy on a GPU, which a CUDA graph capture
    can't contain (torch's own error there leaves the capture broken without naming the cause): ``remedy`` says
    what the caller can do instead."""
    if capturing(t.device):
        raise ValueError(f"{name}: reading these CUDA offsets or lengths on the host (to check them, find the longest "
                         f"length or size a result) is a device-to-host sync, which a CUDA graph capture can't "
                         f"contain; {remedy}")
    return t.detach().to("cpu", torch.int64)


def check_offsets(offsets: torch.Tensor, total: int, max_len: int | None, *,
                  names: tuple[str, str, str] = ("offsets", "values.shape[0]", "max_len")) -> torch.Tensor:
    """Validate ``offsets`` against ``total`` rows and ``max_len`` (None: not checked) and return them as
    a CPU int64 tensor (a device-to-host copy on a GPU). ``names``: how the errors call the offsets, the
    row count and the maximum length."""
    offsets_name, total_name, max_name = names
    host = read_on_host(offsets, offsets_name, f"inside the capture pass {max_name}, with validate=False where the "
                        "call takes it and the checking mode (varlen.set_checks) off, or use the jagged tensors "
                        "that ops return")
    if int(host[0]) != 0:
        raise ValueError(f"{offsets_name}: must start at 0, got {offsets_name}[0] = {int(host[0])}")
    steps = host[1:] - host[:-1]
    if bool((steps < 0).any()):
        b = int((steps < 0).nonzero()[0, 0])
        raise ValueError(f"{offsets_name}: must not decrease, got {offsets_name}[{b}] = {int(host[b])} > "
                         f"{offsets_name}[{b + 1}] = {int(host[b + 1])}")
    if int(host[-1]) != total:
        raise ValueError(f"{offsets_name}: must end at {total_name} = {total}, got {offsets_name}[-1] = "
                         f"{int(host[-1])}")
    longest = int(steps.max())
    if max_len is not None and max_len < longest:
        b = int(steps.argmax())
        raise ValueError(f"{max_name}: got {max_len}, but sequence {b} has length {longest}; it must be at "
                         "least the longest length")
    return host


def segment_ids(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """``(total,)`` int64: for each row, the index b of its sequence. No host sync.

    Row r belongs to the sequence whose end offset is the first one greater than r (empty sequences
    share their end offset with the next one and so are skipped). Rows past the last offset (offsets that
    don't cover the rows: trusted metadata gone wrong) are given to the last sequence, so that the ids
    always index a ``(B,)`` tensor.
    """
    ends = offsets[1:].to(torch.int64)
    ids = torch.searchsorted(ends, torch.arange(total, device=offsets.device), right=True)
    return ids.clamp_(max=offsets.shape[0] - 2)


def sequence_bounds(offsets: torch.Tensor, total: int, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(starts, lengths)`` (int64, ``(B,)``) of the sequences ``offsets`` describe in ``total`` rows, clamped
    as the kernels clamp them: each sequence lies within the rows and is at most ``longest`` long, whatever
    the offsets say (a sequence whose end precedes its start is empty)."""
    offsets = offsets.to(torch.int64)
    starts = offsets[:-1].clamp(0, total)
    ends = torch.maximum(offsets[1:].clamp(max=total), starts)
    return starts, (ends - starts).clamp_(max=longest)


def row_positions(offsets: torch.Tensor, total: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of ``total`` rows: its sequence and its position inside it (int64, no host sync), clamped
    to index a ``(B, width)`` tensor whatever the offsets say."""
    seq = segment_ids(offsets, total)
    pos = torch.arange(total, device=offsets.device) - offsets.to(torch.int64)[seq]
    return seq, pos.clamp_(0, max(width - 1, 0))
