"""``varlen.nn.MultiheadAttention``: multi-head (and grouped-query) attention over jagged batches."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from .._checks import check_bool, check_int, check_probability
from ..attn.api import attention, parse_window
from ..ops.rotary import check_rotary_base
from . import _layout


def check_batch_first(batch_first) -> None:
    """``batch_first``: accepted as True (the only layout these modules take), so that torch's
    ``batch_first=True`` modules swap in unchanged; False is refused rather than misread."""
    if batch_first is not True:
        raise ValueError(f"batch_first: varlen.nn modules take batch-first inputs only (jagged (B, j, E) or dense "
                         f"(B, S, E)); got {batch_first!r}. Transpose (S, B, E) inputs to (B, S, E), or leave "
                         "batch_first out")


class MultiheadAttention(nn.Module):
    """Multi-head attention on jagged ``(B, j, E)`` (or dense ``(B, S, E)``) batches, without padding.

    The parameters are those of ``torch.nn.MultiheadAttention`` (``in_proj_weight``, ``in_proj_bias``,
    ``out_proj``), so its ``state_dict`` loads here (and the reverse) when ``num_kv_heads`` is
    ``num_heads``. With fewer key/value heads (GQA/MQA), ``in_proj_weight`` is
    ``(E + 2 * num_kv_heads * E / num_heads, E)``: the q, k and v rows one after another.

    Args (the first four in ``torch.nn.MultiheadAttention``'s order):
        embed_dim: E, the features of a token; a multiple of ``num_heads``.
        num_heads: H, query heads.
        dropout: probability of dropping an attention weight, in training mode only; in [0, 1) (a real number).
        bias: learn biases in the input and output projections.
        num_kv_heads: key/value heads; ``num_heads`` (default) or a divisor of it.
        causal, window: masks, as in :func:`varlen.attention` (positions count within each sequence).
        rotary_base: None (default), or rotary position embeddings on q and k with this wavelength scale
            (``rope_theta`` in transformers' configs; :func:`varlen.rotary`), positions counted within each
            sequence; ``head_dim`` must be even.
        batch_first: True (the default, and the only layout taken: torch's ``batch_first=True`` modules swap in
            unchanged); False raises a ValueError.
        device, dtype: of the parameters.

    Differences from ``torch.nn.MultiheadAttention``: inputs are batch-first and may be jagged (no
    ``key_padding_mask``: sequences simply have their own lengths); no ``attn_mask`` but ``causal``,
    ``window`` and ``attn_bias``; ``forward`` returns the output alone (no attention weights).
    """

    def __init__(self, embed_dim: int, num_heads: int, dropout: float = 0.0, bias: bool = True, *,
                 num_kv_heads: int | None = None, causal: bool = False,
                 window: tuple[int | None, int | None] | None = None, rotary_base: float | None = None,
                 batch_first: bool = True, device=None, dtype=None):
        super().__init__()
        check_batch_first(batch_first)
        embed_dim = check_int("embed_dim", embed_dim, minimum=1)
        num_heads = check_int("num_heads", num_heads, minimum=1)
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim: {embed_dim} is not a multiple of num_heads = {num_heads}")
        num_kv_heads = num_heads if num_kv_heads is None else check_int("num_kv_heads", num_kv_heads, minimum=1)
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_kv_heads: {num_kv_heads} does not divide num_heads = {num_heads}")
        check_bool("bias", bias)
        check_bool("causal", causal)
        parse_window(window)
        if window is not None:  # (numpy's ints as Python's: a compiled forward reads them)
            window = tuple(None if side is None else int(side) for side in window)
        self.embed_dim, self.num_heads, self.num_kv_heads = embed_dim, num_heads, num_kv_heads
        self.batch_first = True  # (torch.nn.TransformerEncoder reads its layers' self_attn.batch_first)
        self.head_dim = embed_dim // num_heads
        if rotary_base is not None:
            rotary_base = check_rotary_base(rotary_base, "rotary_base")
            if self.head_dim % 2:
                raise ValueError(f"rotary_base: rotary embeddings need an even head_dim; embed_dim {embed_dim} / "
                                 f"num_heads {num_heads} = {self.head_dim}")
        self.rotary_base = rotary_base
        self.kv_dim = num_kv_heads * self.head_dim
        self.dropout = check_probability("dropout", dropout)
        self.causal, self.window = causal, window
        factory = dict(device=device, dtype=dtype)
        self.in_proj_weight = nn.Parameter(torch.empty(embed_dim + 2 * self.kv_dim, embed_dim, **factory))
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(embed_dim + 2 * self.kv_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """torch.nn.MultiheadAttention's initialization: Xavier-uniform input projection, zero biases."""
        nn.init.xavier_uniform_(self.in_proj_weight)
        self.out_proj.reset_parameters()
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    def forward(self, query, key=None, value=None, *, attn_bias: torch.Tensor | None = None):
        """Attention of ``query`` over ``key``/``value``; self-attention when both are None.

        Args:
            query: jagged ``(B, j, E)`` or dense ``(B, Sq, E)``. A ``torch.nested`` jagged tensor is taken as a
                JaggedTensor, and the result is a JaggedTensor
                (``torch.nested.nested_tensor_from_jagged(out.values, out.offsets)`` makes it nested again).
            key: None (self-attention, one fused q/k/v projection), or the same layout with query's batch
                size (jagged lengths may differ from query's).
            value: None (``value = key``; k and v are then projected together), or like ``key`` (jagged:
                with key's lengths).
            attn_bias: additive (float) or keep (bool) bias broadcastable to ``(B, H, Sq, Sk)`` (jagged:
                ``(B, H, max_q, max_k)``), as ``varlen.attention``'s ``bias``.

        Returns ``(B, j, E)`` jagged with query's offsets (dense input: ``(B, Sq, E)``).

        Raises TypeError for a non-tensor input, mixed layouts or a dtype other than the parameters';
        ValueError for shapes (the last dim must be ``embed_dim``, the batch sizes query's);
        ``varlen.attention``'s errors for the rest (key and value lengths, ``attn_bias``).
        """
        dtype = self.in_proj_weight.dtype
        query = _layout.as_input(query, "query", self.embed_dim, dtype)
        if key is None and value is not None:
            raise ValueError("key: is None but value is given; pass key too (value=None means value = key)")
        E, kv, rotary = self.embed_dim, self.kv_dim, self.rotary_base
        if key is None:
            # q's and k's heads lie side by side in each row: one rotation turns both.
            qk, v = self._heads(self._project(query, 0, E + 2 * kv), (E + kv, kv))
            if rotary is not None:
                qk = _layout.rotary(qk, rotary)
            q, k = _layout.split(qk, (self.num_heads, self.num_kv_heads), dim=-2)
        else:
            key = _layout.as_input(key, "key", E, dtype)
            if _layout.is_jagged(key) != _layout.is_jagged(query):
                raise TypeError("key: its layout (jagged or dense) differs from query's; pass both jagged or "
                                "both dense")
            batch = _layout.batch_size(query)
            if _layout.batch_size(key) != batch:
                raise ValueError(f"key: batch size {_layout.batch_size(key)} differs from query's {batch}")
            (q,) = self._heads(self._project(query, 0, E), (E,))
            if value is None or value is key:
                k, v = self._heads(self._project(key, E, E + 2 * kv), (kv, kv))
            else:
                value = _layout.as_input(value, "value", E, dtype)
                if _layout.is_jagged(value) != _layout.is_jagged(key):
                    raise TypeError("value: its layout (jagged or dense) differs from key's")
                if _layout.batch_size(value) != batch:
                    raise ValueError(f"value: batch size {_layout.batch_size(value)} differs from key's {batch}")
                (k,) = self._heads(self._project(key, E, E + kv), (kv,))
                (v,) = self._heads(self._project(value, E + kv, E + 2 * kv), (kv,))
            if rotary is not None:
                q, k = _layout.rotary(q, rotary), _layout.rotary(k, rotary)
        out = attention(q, k, v, causal=self.causal, window=self.window, bias=attn_bias,
                        dropout_p=self.dropout if self.training else 0.0)
        out = _layout.rowwise(out, lambda rows: rows.flatten(-2))
        return _layout.linear(out, self.out_proj)

    def _project(self, x, lo: int, hi: int):
        """Rows ``[lo, hi)`` of the input projection applied to x's tokens (one product)."""
        w = self.in_proj_weight[lo:hi]
        b = None if self.in_proj_bias is None else self.in_proj_bias[lo:hi]
        return ops.linear(x, w, b) if _layout.is_jagged(x) else F.linear(x, w, b)

    def _heads(self, x, widths: tuple[int, ...]):
        """Projected tokens cut into consecutive parts of ``widths`` features, each as ``(..., heads, head_dim)``:
        views, no copy (:func:`_layout.split`)."""
        return [_layout.rowwise(part, lambda rows: rows.unflatten(-1, (-1, self.head_dim)))
                for part in _layout.split(x, widths, dim=-1)]

    def extra_repr(self) -> str:
        window = "" if self.window is None else f", window={self.window}"
        rotary = "" if self.rotary_base is None else f", rotary_base={self.rotary_base}"
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"dropout={self.dropout}, causal={self.causal}{window}{rotary}, "
                f"bias={self.in_proj_bias is not None}")
