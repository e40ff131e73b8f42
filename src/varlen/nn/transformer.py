"""``varlen.nn.TransformerEncoderLayer`` and ``TransformerEncoder``: torch's encoder layer and stack for jagged
batches."""

from __future__ import annotations

import copy
import math
import numbers

from torch import nn

from .._checks import check_bool, check_choice, check_int, check_probability
from . import _layout
from .attention import MultiheadAttention, check_batch_first

NORMS = ("layer", "rms")


class TransformerEncoderLayer(nn.Module):
    """Self-attention and a feed-forward block, as ``torch.nn.TransformerEncoderLayer``, on jagged batches.

    Same arguments, submodules (``self_attn``, ``linear1``, ``linear2``, ``norm1``, ``norm2``, ``dropout``,
    ``dropout1``, ``dropout2``), parameter names and math as torch's layer with ``batch_first=True``, so
    a ``state_dict`` moves between the two (with ``num_kv_heads``, ``norm``, ``rotary_base`` and
    ``activation`` at torch's choices). Instead of ``src_mask`` / ``src_key_padding_mask`` / ``is_causal``:
    jagged inputs (each sequence its own length), ``causal``, ``window`` and ``forward``'s ``attn_bias``.
    Beyond torch's layer, the pieces of a Llama block: ``norm="rms"``, ``activation="swiglu"`` and
    ``rotary_base`` (with ``norm_first=True``, ``bias=False``, ``dropout=0.0`` and ``causal=True``).

    Args:
        d_model: E, the features of a token.
        nhead: attention heads (a divisor of ``d_model``).
        dim_feedforward: hidden features of the feed-forward block.
        dropout: probability used by every dropout (attention weights, feed-forward hidden units, both
            residual branches), in training mode only; in [0, 1) (a real number).
        activation: ``"relu"``, ``"gelu"`` (exact) or ``"swiglu"`` (``silu(gate) * up``: ``linear1`` makes
            both, ``2 * dim_feedforward`` features, the gate first).
        layer_norm_eps: the norms' epsilon.
        norm: ``"layer"`` (``torch.nn.LayerNorm``) or ``"rms"`` (``torch.nn.RMSNorm``, no bias).
        norm_first: pre-norm (``x + sa(norm1(x))``...) instead of post-norm (``norm1(x + sa(x))``...).
        bias: learn biases in the linear layers and the layer norms.
        causal, window, num_kv_heads, rotary_base: passed to :class:`MultiheadAttention`.
        batch_first: True (the default, and the only layout taken), as :class:`MultiheadAttention`.
        device, dtype: of the parameters.

    Raises ValueError / TypeError naming the argument for a bad one.
    """

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str = "relu", layer_norm_eps: float = 1e-5, *, norm_first: bool = False,
                 bias: bool = True, causal: bool = False, window: tuple[int | None, int | None] | None = None,
                 num_kv_heads: int | None = None, norm: str = "layer", rotary_base: float | None = None,
                 batch_first: bool = True, device=None, dtype=None):
        super().__init__()
        check_batch_first(batch_first)
        # (Checked here too, under this module's names: the attention would name its own, embed_dim and num_heads.)
        d_model = check_int("d_model", d_model, minimum=1)
        nhead = check_int("nhead", nhead, minimum=1)
        if d_model % nhead != 0:
            raise ValueError(f"d_model: {d_model} is not a multiple of nhead = {nhead}")
        dim_feedforward = check_int("dim_feedforward", dim_feedforward, minimum=1)
        dropout = check_probability("dropout", dropout)
        if not isinstance(activation, str):
            raise TypeError(f"activation: expected a name ({', '.join(map(repr, _layout.ACTIVATIONS))}), got "
                            f"{type(activation).__name__}")
        check_choice("activation", activation, _layout.ACTIVATIONS)
        if (isinstance(layer_norm_eps, bool) or not isinstance(layer_norm_eps, numbers.Real)
                or not 0 <= layer_norm_eps < math.inf):
            raise ValueError(f"layer_norm_eps: expected a finite real number >= 0, got {layer_norm_eps!r}")
        check_bool("norm_first", norm_first)
        check_choice("norm", norm, NORMS)
        factory = dict(device=device, dtype=dtype)
        self.self_attn = MultiheadAttention(d_model, nhead, num_kv_heads=num_kv_heads, bias=bias, dropout=dropout,
                                            causal=causal, window=window, rotary_base=rotary_base, **factory)
        hidden = dim_feedforward * _layout.ACTIVATIONS[activation][1]
        self.linear1 = nn.Linear(d_model, hidden, bias=bias, **factory)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias, **factory)
        self.norm_first = norm_first
        self.norm1, self.norm2 = (nn.RMSNorm(d_model, eps=layer_norm_eps, **factory) if norm == "rms"
                                  else nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory)
                                  for _ in range(2))
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.activation = activation

    def forward(self, src, src_mask=None, src_key_padding_mask=None, is_causal: bool = False, *, attn_bias=None):
        """``src``: jagged ``(B, j, d_model)`` (or dense ``(B, S, d_model)``); returns the same layout (a JaggedTensor
        for a ``torch.nested`` jagged input, as :meth:`MultiheadAttention.forward` says).

        ``attn_bias`` is passed to the attention (see :class:`MultiheadAttention`). torch's ``src_mask``,
        ``src_key_padding_mask`` and ``is_causal`` are taken so that ``torch.nn.TransformerEncoder`` stacks these
        layers: None, None, and ``is_causal`` equal to the layer's ``causal`` (or False); anything else raises a
        ValueError saying what to pass instead.
        """
        _check_torch_masks(src_mask, "src_mask", src_key_padding_mask, is_causal, self.self_attn.causal)
        x = _layout.as_input(src, "src", self.self_attn.embed_dim, self.linear1.weight.dtype)
        if self.norm_first:
            x = _layout.add(x, self._sa_block(_layout.norm(x, self.norm1), attn_bias))
            return _layout.add(x, self._ff_block(_layout.norm(x, self.norm2)))
        x = _layout.norm(_layout.add(x, self._sa_block(x, attn_bias)), self.norm1)
        return _layout.norm(_layout.add(x, self._ff_block(x)), self.norm2)

    def _sa_block(self, x, attn_bias):
        return _layout.rowwise(self.self_attn(x, attn_bias=attn_bias), self.dropout1)

    def _ff_block(self, x):
        h = _layout.activation(_layout.linear(x, self.linear1), self.activation)
        h = _layout.linear(_layout.rowwise(h, self.dropout), self.linear2)
        return _layout.rowwise(h, self.dropout2)

    def extra_repr(self) -> str:
        norm = "rms" if isinstance(self.norm1, nn.RMSNorm) else "layer"
        return f"activation={self.activation!r}, norm={norm!r}, norm_first={self.norm_first}"


def _check_torch_masks(mask, mask_name: str, key_padding_mask, is_causal, causal: bool) -> None:
    """torch's mask arguments, as varlen's layers take them: no masks (jagged inputs and the layer's own ``causal``,
    ``window`` and ``attn_bias`` say the same), and ``is_causal`` None, False, or True on a causal layer."""
    if mask is not None:
        raise ValueError(f"{mask_name}: not taken by varlen.nn layers; build the layer with causal=True or window=, or "
                         "pass an additive attn_bias=")
    if key_padding_mask is not None:
        raise ValueError("src_key_padding_mask: not taken by varlen.nn layers; pass the batch as a JaggedTensor "
                         "instead (varlen.JaggedTensor.from_padded(src, lengths)): each sequence keeps its length")
    check_bool("is_causal", is_causal, allow_none=True)
    if is_causal and not causal:
        raise ValueError("is_causal: True, but the layer was built with causal=False; build it with causal=True")


class TransformerEncoder(nn.Module):
    """A stack of ``num_layers`` copies of a :class:`TransformerEncoderLayer`, as ``torch.nn.TransformerEncoder``, on
    jagged batches: the same submodules and parameter names (``layers.0...``, ``norm``), so a ``state_dict`` moves
    between the two. (``torch.nn.TransformerEncoder`` also stacks varlen's layers, on dense inputs only: it reads
    tensor attributes a JaggedTensor doesn't have.)

    Args:
        encoder_layer: the layer to copy (deep copies: the layers don't share parameters, as torch's).
        num_layers: layers, at least 1.
        norm: a final norm module (``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm``), or None.
        enable_nested_tensor, mask_check: torch's flags, taken for its signature; jagged inputs need neither
            (a bool each).
    """

    def __init__(self, encoder_layer: TransformerEncoderLayer, num_layers: int, norm: nn.Module | None = None,
                 enable_nested_tensor: bool = True, mask_check: bool = True):
        super().__init__()
        if not isinstance(encoder_layer, TransformerEncoderLayer):
            raise TypeError(f"encoder_layer: expected a varlen.nn.TransformerEncoderLayer, got "
                            f"{type(encoder_layer).__name__}")
        num_layers = check_int("num_layers", num_layers, minimum=1)
        if norm is not None and not isinstance(norm, (nn.LayerNorm, nn.RMSNorm)):
            raise TypeError(f"norm: expected a torch.nn.LayerNorm, a torch.nn.RMSNorm or None, got "
                            f"{type(norm).__name__}")
        check_bool("enable_nested_tensor", enable_nested_tensor)
        check_bool("mask_check", mask_check)
        self.layers = nn.ModuleList(copy.deepcopy(encoder_layer) for _ in range(num_layers))
        self.num_layers = num_layers
        self.norm = norm

    def forward(self, src, mask=None, src_key_padding_mask=None, is_causal: bool | None = None, *, attn_bias=None):
        """``src``: jagged ``(B, j, d_model)`` (or dense ``(B, S, d_model)``) through every layer, then ``norm``;
        returns the same layout. ``mask``, ``src_key_padding_mask`` and ``is_causal`` as the layers take them
        (:meth:`TransformerEncoderLayer.forward`); ``attn_bias`` goes to every layer."""
        _check_torch_masks(mask, "mask", src_key_padding_mask, is_causal, all(layer.self_attn.causal
                                                                            for layer in self.layers))
        x = src
        for layer in self.layers:
            x = layer(x, attn_bias=attn_bias)
        return x if self.norm is None else _layout.norm(x, self.norm)
