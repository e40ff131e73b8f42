"""What an attention call computes, validated once: the options and the problem's shapes.

Backends receive these two frozen objects plus the tensors; they never re-validate user input.

Tensor layouts seen by backends (``dense`` tells which):
- dense:  q ``(B, Sq, H, D)``, k ``(B, Sk, Hkv, D)``, v ``(B, Sk, Hkv, Dv)``; out like q with Dv;
  lse ``(B, H, Sq)`` float32.
- jagged: q ``(Tq, H, D)``, k ``(Tk, Hkv, D)``, v ``(Tk, Hkv, Dv)`` (the JaggedTensors' values), with
  ``cu_q``/``cu_k`` ``(B + 1,)`` int32 offsets; out ``(Tq, H, Dv)``; lse ``(H, Tq)`` float32.
- bias: ``None`` or a float tensor of 4 dims, each either 1 or the full size ``(B, H, Sq, Sk)``
  (jagged: ``(B, H, >= max_q, >= max_k)``, entry ``[b, h, i, j]`` is query i, key j of sequence b).
- alibi: ``None`` or float32 ``(B, H)`` (possibly a stride-0 expansion of ``(H,)``).
Only ``stride(-1) == 1`` is guaranteed for q, k, v.

Options that are tensors (``AttentionOptions.prefix_len``, ``.documents``) are validated and on q's device;
they are excluded from equality (``compare=False``).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """Masking and scoring options, per sequence with lengths Lq, Lk.

    ``shift`` is 0 for top-left alignment and ``Lk - Lq`` for bottom-right. Query i sees key j iff
    ``j <= i + shift`` (causal) and ``i + shift - window_left <= j <= i + shift + window_right``
    (each side unbounded when -1), or ``j < prefix_len[b]``; and, with ``documents``, only when i and j
    lie in the same document. Scores: ``s = scale * q.k``; ``softcap * tanh(s / softcap)`` when
    ``softcap > 0``; ``+ bias + alibi``; masking; softmax; dropout with keep probability ``1 - dropout_p``.

    ``prefix_len``: ``(B,)`` int32, keys visible to every query of their sequence. ``documents``: dense
    self-attention over packed rows, ``(2, B, S)`` int32: for each token, the first row of its document and
    one past its last (documents are runs of rows). ``query_offset``: ``(B,)`` int32, sequence b's query i
    sits at position ``query_offset[b] + i`` among its keys (``shift = query_offset[b]``, whatever
    ``bottom_right`` says), for the masks, ALiBi and the dropout mask's rows. ``dropout_sequences``: ``(B,)``
    int32, the sequence index each sequence's dropout mask is drawn for (the whole batch's, when this call
    computes a part of it: ``varlen.distributed``, with ``query_offset``, and the PyTorch backend's length
    buckets on the CPU); None: its own index. The Triton kernels read it only with ``query_offset``.
    """

    scale: float
    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    bottom_right: bool = False
    softcap: float = 0.0
    dropout_p: float = 0.0
    deterministic: bool = False
    prefix_len: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    documents: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    query_offset: torch.Tensor | None = dataclasses.field(default=None, compare=False)
    dropout_sequences: torch.Tensor | None = dataclasses.field(default=None, compare=False)

    @property
    def masked(self) -> bool:
        """True when some (query, key) pairs inside the sequences are hidden."""
        return self.causal or self.window_left >= 0 or self.window_right >= 0

    def visible_right(self) -> int:
        """Largest ``j - (i + shift)`` a query may see, or -1 for unbounded (merges causal and window)."""
        if self.causal:
            return 0 if self.window_right < 0 else min(0, self.window_right)
        return self.window_right


@dataclasses.dataclass(frozen=True)
class Problem:
    """Shapes and sequence metadata. ``max_q``/``max_k`` are host ints (grid sizes, no syncs)."""

    batch: int
    heads: int
    kv_heads: int
    head_dim: int
    head_dim_v: int
    max_q: int
    max_k: int
    dense: bool
    cu_q: torch.Tensor | None = None  # (B + 1,) int32, jagged only
    cu_k: torch.Tensor | None = None

    @property
    def group(self) -> int:
        """Query heads per key/value head (1 for MHA, H for MQA)."""
        return self.heads // self.kv_heads


@dataclasses.dataclass(frozen=True)
class DropoutSeed:
    """Philox key of one call: the kernels' mask for element (b, h, i, j) depends on these alone.

    ``seed`` is an int drawn on the host, or, where the call can't read one there (inside a captured CUDA graph, or
    a compiled graph on a GPU), a one-element int64 tensor drawn on the call's device, which the kernels load (each
    replay of the graph draws it anew); ``offset`` is then 0.

    ``kept``: where one forward and its backward share this object (an eager call that will have a backward,
    ``function._EagerAttention``), a memo the backend's forward may fill for its backward, which must give the same
    result without it (the PyTorch backend's CPU keep masks and softmax probabilities, ``torch_backend._remember``);
    None elsewhere. Not part of the key: equality and hashing ignore it."""

    seed: int | torch.Tensor
    offset: int
    kept: dict | None = dataclasses.field(default=None, compare=False, repr=False)
