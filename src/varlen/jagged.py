"""JaggedTensor: a batch of variable-length sequences stored without padding.

A batch of B sequences of lengths L_b with logical shape ``(B, j, *inner)`` (dim 0 the batch, dim 1
ragged) is stored as ``values`` of shape ``(sum L_b, *inner)`` (an ordinary tensor that carries
autograd) and ``offsets`` of shape ``(B + 1,)`` on the same device, sequence b being
``values[offsets[b]:offsets[b + 1]]``. ``max_len`` is kept as a host int, so no op needs ``.item()``
to size its launch grid.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from ._checks import (
    INDEX_DTYPES,
    INT32_MAX,
    check_bool,
    check_dtype,
    check_int,
    check_real,
    check_tensor,
    checks_metadata,
    is_int,
)
from .offsets import check_offsets, check_offsets_tensor, read_on_host, segment_ids
from .padding import jagged_to_padded, padded_to_jagged

# (from_padded with lengths on a GPU reads at least their sum on the host: it is the row count, a shape.)
_FROM_PADDED_OUTSIDE = "call from_padded outside the capture (its row count is a shape)"


class JaggedTensor:
    """A batch of sequences of different lengths: flat ``values`` plus ``offsets``.

    Args:
        values: ``(total, *inner)``, the sequences one after another.
        offsets: ``(B + 1,)`` int32 or int64 on ``values``' device; starts at 0, never decreases,
            ends at ``total``.
        max_len: the longest length (or any larger bound), as a host int. Computed from ``offsets`` when
            omitted (one device-to-host copy when ``offsets`` is on a GPU).
        validate: check ``offsets`` and ``max_len`` against ``values`` even on a GPU outside the checking
            mode (one device-to-host copy). With ``validate=False`` they are trusted on a GPU (see
            :func:`varlen.set_checks` for the contract); on the CPU they are always checked.
    """

    __slots__ = ("values", "offsets", "max_len", "_host_offsets")

    def __init__(self, values: torch.Tensor, offsets: torch.Tensor, max_len: int | None = None, *,
                 validate: bool = True):
        check_tensor("values", values)
        check_offsets_tensor("offsets", offsets)
        if values.dim() < 1:
            raise ValueError("values: expected at least 1 dim (total, *inner), got a 0-dim tensor")
        if offsets.device != values.device:
            raise ValueError(f"offsets: on device {offsets.device}, but values is on {values.device}; "
                             "they must be on one device")
        offsets = offsets.contiguous()  # kernels read offsets[b] with stride 1
        if offsets.dtype == torch.int32 and values.shape[0] > INT32_MAX:
            raise ValueError(f"offsets: int32 can't index values with {values.shape[0]} rows "
                             f"(more than {INT32_MAX}); use int64 offsets")
        if max_len is not None:
            max_len = check_int("max_len", max_len, minimum=0)
        check_bool("validate", validate)
        host = None
        if offsets.device.type == "meta":  # (no data to check or read: shapes only)
            if max_len is None:
                raise ValueError("max_len: required for meta tensors (their offsets hold no values to find it from)")
        elif validate or checks_metadata(offsets.device):
            host = check_offsets(offsets, values.shape[0], max_len)
        elif max_len is None:
            host = read_on_host(offsets, "offsets", "inside the capture pass max_len (JaggedTensor(values, offsets, "
                                    "max_len, validate=False)), or use the jagged tensors that ops return")
        if max_len is None:
            max_len = int((host[1:] - host[:-1]).max())
        self.values = values
        self.offsets = offsets
        self.max_len = max_len
        self._host_offsets = host

    @classmethod
    def _trusted(cls, values: torch.Tensor, offsets: torch.Tensor, max_len: int,
                 host_offsets: torch.Tensor | None = None) -> JaggedTensor:
        """Build without checks or syncs; for ops whose output shares a valid input's offsets."""
        out = cls.__new__(cls)
        out.values = values
        out.offsets = offsets
        out.max_len = max_len
        out._host_offsets = host_offsets
        return out

    @classmethod
    def _from_metadata(cls, values: torch.Tensor, offsets: torch.Tensor, max_len: int | None,
                       names: tuple[str, str, str]) -> JaggedTensor:
        """Over offsets and a maximum length from outside (a nested tensor's, flash-attn's ``cu_seqlens``):
        checked where that costs no sync (CPU) or in checking mode, else trusted (``varlen.set_checks``);
        a maximum of None is computed (a host read). ``names``: as :func:`check_offsets`'."""
        host = None
        if max_len is None or checks_metadata(offsets.device):
            host = check_offsets(offsets, values.shape[0], max_len, names=names)
            max_len = int((host[1:] - host[:-1]).max()) if max_len is None else max_len
        return cls._trusted(values, offsets.contiguous(), max_len, host)

    def with_values(self, values: torch.Tensor) -> JaggedTensor:
        """A jagged tensor with these offsets and new ``values`` (same number of rows, on the offsets' device)."""
        check_tensor("values", values)
        if values.dim() < 1:
            raise ValueError("values: expected at least 1 dim (total, *inner), got a 0-dim tensor")
        if values.device != self.offsets.device:
            raise ValueError(f"values: on device {values.device}, but the offsets are on {self.offsets.device}; "
                             "they must be on one device")
        if values.shape[0] != self.values.shape[0]:
            raise ValueError(f"values: expected {self.values.shape[0]} rows to match the offsets, "
                             f"got {values.shape[0]}")
        return JaggedTensor._trusted(values, self.offsets, self.max_len, self._host_offsets)

    # ----------------------------------------------------------------------------------- shape
    @property
    def batch_size(self) -> int:
        return self.offsets.shape[0] - 1

    @property
    def inner_shape(self) -> torch.Size:
        return self.values.shape[1:]

    @property
    def shape(self) -> tuple:
        """Logical shape ``(B, None, *inner)``; None marks the ragged dim."""
        return (self.batch_size, None, *self.inner_shape)

    def dim(self) -> int:
        return 1 + self.values.dim()

    @property
    def ndim(self) -> int:
        return self.dim()

    @property
    def lengths(self) -> torch.Tensor:
        """``(B,)`` lengths on the offsets' device and dtype."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def total(self) -> int:
        return self.values.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def requires_grad(self) -> bool:
        return self.values.requires_grad

    @property
    def grad(self) -> JaggedTensor | None:
        g = self.values.grad
        return None if g is None else self.with_values(g)

    def requires_grad_(self, requires_grad: bool = True) -> JaggedTensor:
        self.values.requires_grad_(requires_grad)
        return self

    def detach(self) -> JaggedTensor:
        return self.with_values(self.values.detach())

    def host_offsets(self) -> torch.Tensor:
        """Offsets as a CPU int64 tensor (one device-to-host copy the first time, then cached)."""
        if self._host_offsets is None:
            self._host_offsets = read_on_host(self.offsets, "offsets", "what needs them (unbind, select on dim 0, or "
                                              "on dim 1 without fill_value) runs outside the capture")
        return self._host_offsets

    def segment_ids(self) -> torch.Tensor:
        """``(total,)`` int64: the sequence each row of ``values`` belongs to (no host sync)."""
        return segment_ids(self.offsets, self.total)

    # ------------------------------------------------------------------------------ conversion
    def to(self, *args, **kwargs) -> JaggedTensor:
        """Like ``Tensor.to``: a device moves values and offsets, a dtype changes values only."""
        values = self.values.to(*args, **kwargs)
        offsets = self.offsets if values.device == self.offsets.device else self.offsets.to(values.device)
        return JaggedTensor._trusted(values, offsets, self.max_len, self._host_offsets)

    def cpu(self) -> JaggedTensor:
        return self.to("cpu")

    def cuda(self, device=None) -> JaggedTensor:
        return self.to(torch.device("cuda") if device is None else device)

    def to_padded(self, padding_value: float = 0.0, max_len: int | None = None) -> torch.Tensor:
        """``(B, max_len, *inner)`` dense tensor; positions past a sequence's end hold ``padding_value``.

        Differentiable: its backward gathers the gradient of the valid positions.
        """
        width = self.max_len if max_len is None else check_int("max_len", max_len, minimum=self.max_len)
        check_real("padding_value", padding_value)
        return jagged_to_padded(self.values, self.offsets, width, padding_value)

    @classmethod
    def from_padded(cls, padded: torch.Tensor, lengths, *, max_len: int | None = None) -> JaggedTensor:
        """Take the first ``lengths[b]`` rows of ``padded[b]`` for each b. Differentiable.

        ``lengths`` is a list of ints or an integer tensor of shape ``(B,)``. A tensor on the GPU costs
        one device-to-host copy for the checks and ``max_len``, unless ``max_len`` (the longest length or
        any larger bound up to ``padded.shape[1]``) is given: then the lengths are trusted to lie in
        ``[0, max_len]`` outside the checking mode (see :func:`varlen.set_checks`).
        """
        check_tensor("padded", padded)
        if padded.dim() < 2:
            raise ValueError(f"padded: expected (B, max_len, *inner), got shape {tuple(padded.shape)}")
        B, width = padded.shape[0], padded.shape[1]
        if B == 0:
            raise ValueError(f"padded: expected at least one sequence (B >= 1), got shape {tuple(padded.shape)}")
        if isinstance(lengths, torch.Tensor):
            check_dtype("lengths", lengths, INDEX_DTYPES)
            if lengths.shape != (B,):
                raise ValueError(f"lengths: expected shape ({B},) to match padded's batch, "
                                 f"got {tuple(lengths.shape)}")
            lengths_dev = lengths.to(padded.device, torch.int64)
            trusted = max_len is not None and not checks_metadata(lengths.device)
            host = None if trusted else read_on_host(lengths, "lengths", _FROM_PADDED_OUTSIDE)
        else:
            if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Iterable):
                raise TypeError(f"lengths: expected a list of ints or an integer tensor of shape ({B},), got "
                                f"{type(lengths).__name__}")
            lengths = list(lengths)
            for b, n in enumerate(lengths):
                if not is_int(n):
                    raise TypeError(f"lengths: expected ints, got lengths[{b}] = {n!r}")
            host = torch.as_tensor(lengths, dtype=torch.int64)
            if host.shape != (B,):
                raise ValueError(f"lengths: expected {B} lengths to match padded's batch, got {host.numel()}")
            lengths_dev = host.to(padded.device)
        if max_len is not None:
            max_len = check_int("max_len", max_len, minimum=0)
            if max_len > width:
                raise ValueError(f"max_len: {max_len} exceeds padded.shape[1] = {width}")
        host_offsets = total = None
        if host is not None:
            bad = (host < 0) | (host > width)
            if bool(bad.any()):
                b = int(bad.nonzero()[0, 0])
                raise ValueError(f"lengths: lengths[{b}] = {int(host[b])} is outside [0, {width}] "
                                 f"(padded.shape[1] = {width})")
            longest = int(host.max())
            if max_len is not None and max_len < longest:
                b = int(host.argmax())
                raise ValueError(f"max_len: got {max_len}, but lengths[{b}] = {longest}; it must be at least "
                                 "the longest length")
            max_len = longest if max_len is None else max_len
            host_offsets = torch.cat([host.new_zeros(1), host.cumsum(0)])
            total = int(host_offsets[-1])
        offsets = torch.cat([lengths_dev.new_zeros(1), lengths_dev.cumsum(0)])
        if total is None:
            # The row count is a shape: it has to reach the host once.
            total = int(read_on_host(offsets[-1:], "lengths", _FROM_PADDED_OUTSIDE)[0])
        values = padded_to_jagged(padded, offsets, total, max_len)
        return cls._trusted(values, offsets, max_len, host_offsets)

    def unbind(self) -> tuple[torch.Tensor, ...]:
        """The sequences as a tuple of views of ``values`` (uses host offsets: one copy on GPU)."""
        host = self.host_offsets()
        return tuple(self.values[int(host[b]):int(host[b + 1])] for b in range(self.batch_size))

    def to_nested(self) -> torch.Tensor:
        """A ``torch.nested`` tensor of layout ``torch.jagged`` sharing ``values`` and ``offsets``."""
        return torch.nested.nested_tensor_from_jagged(self.values, self.offsets.to(torch.int64)
                                                      if self.offsets.dtype != torch.int64 else self.offsets,
                                                      max_seqlen=self.max_len)

    @classmethod
    def from_nested(cls, nt: torch.Tensor) -> JaggedTensor:
        """Zero-copy view of a ``torch.nested`` jagged-layout tensor whose ragged dim is dim 1."""
        if not isinstance(nt, torch.Tensor) or not nt.is_nested:
            raise TypeError(f"nt: expected a torch.nested tensor, got {type(nt).__name__}")
        if nt.layout != torch.jagged:
            raise ValueError(f"nt: expected layout torch.jagged, got {nt.layout}")
        if nt._ragged_idx != 1:
            raise ValueError(f"nt: the ragged dim must be dim 1, got dim {nt._ragged_idx}")
        if nt._lengths is not None:
            raise ValueError("nt: a nested tensor with holes (lengths given apart from offsets) is "
                             "not supported; call .contiguous() on it first")
        values, offsets = nt.values(), nt.offsets()
        hint = nt._maybe_max_seqlen  # trusted like any max_len (see varlen.set_checks)
        return cls._from_metadata(values, offsets, None if hint is None else int(hint),
                                  ("nt.offsets()", "nt.values().shape[0]", "nt's max_seqlen hint"))

    def __repr__(self) -> str:
        return (f"JaggedTensor(batch_size={self.batch_size}, max_len={self.max_len}, "
                f"inner_shape={tuple(self.inner_shape)}, dtype={self.dtype}, device={self.device})")


def jagged(tensors: Sequence[torch.Tensor], *, device=None, dtype=None,
           offsets_dtype: torch.dtype = torch.int32) -> JaggedTensor:
    """A JaggedTensor from a list of tensors of shapes ``(L_b, *inner)`` with one ``inner``.

    No device-to-host copies: lengths are read from the tensors' shapes.
    """
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence) or len(tensors) == 0:
        raise TypeError("tensors: expected a non-empty list of tensors of shapes (L_b, *inner)")
    for i, t in enumerate(tensors):
        check_tensor(f"tensors[{i}]", t)
        if t.dim() < 1:
            raise ValueError(f"tensors[{i}]: expected shape (L, *inner), got a 0-dim tensor")
        if t.shape[1:] != tensors[0].shape[1:]:
            raise ValueError(f"tensors[{i}]: inner shape {tuple(t.shape[1:])} differs from tensors[0]'s "
                             f"{tuple(tensors[0].shape[1:])}")
        if t.dtype != tensors[0].dtype or t.device != tensors[0].device:
            raise ValueError(f"tensors[{i}]: dtype/device {t.dtype}/{t.device} differ from tensors[0]'s "
                             f"{tensors[0].dtype}/{tensors[0].device}")
    if offsets_dtype not in INDEX_DTYPES:
        raise TypeError(f"offsets_dtype: expected one of {', '.join(map(str, INDEX_DTYPES))}, got {offsets_dtype!r}")
    lengths = [t.shape[0] for t in tensors]
    host_offsets = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
    values = torch.cat(list(tensors), dim=0).to(device=device, dtype=dtype)
    if offsets_dtype == torch.int32 and values.shape[0] > INT32_MAX:
        offsets_dtype = torch.int64
    offsets = host_offsets.to(device=values.device, dtype=offsets_dtype)
    return JaggedTensor._trusted(values, offsets, max(lengths), host_offsets)


def as_jagged(x, name: str) -> JaggedTensor:
    """``x`` as a JaggedTensor (a ``torch.nested`` jagged tensor is viewed, not copied)."""
    if isinstance(x, JaggedTensor):
        return x
    if isinstance(x, torch.Tensor) and x.is_nested:
        return JaggedTensor.from_nested(x)
    raise TypeError(f"{name}: expected a varlen.JaggedTensor (or a torch.nested jagged tensor), "
                    f"got {type(x).__name__}")


def check_same_offsets(name: str, a: JaggedTensor, other_name: str, b: JaggedTensor) -> None:
    """Two jagged operands must describe the same sequences (same batch and lengths)."""
    if a.device != b.device:
        raise ValueError(f"{name}: on device {a.device}, but {other_name} is on {b.device}")
    if a.offsets is b.offsets:
        return
    if a.batch_size != b.batch_size:
        raise ValueError(f"{name}: batch size {a.batch_size} differs from {other_name}'s {b.batch_size}")
    if a.total != b.total:
        raise ValueError(f"{name}: lengths differ from {other_name}'s (total {a.total} vs {b.total})")
    # Operands derived from one another share the offsets tensor and return above. Separately built
    # ones are compared on the host copies when both have them, else on the device (one sync).
    if a._host_offsets is not None and b._host_offsets is not None:
        same = torch.equal(a._host_offsets, b._host_offsets)
    else:
        same = torch.equal(a.offsets.to(torch.int64), b.offsets.to(torch.int64))
    if not same:
        raise ValueError(f"{name}: lengths differ from {other_name}'s")
