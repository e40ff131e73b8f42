"""varlen: variable-length batches without padding.

Jagged tensors with fused, sync-free backward passes, and fused attention (forward and backward)
for dense and jagged batches.
"""

from . import distributed, nn
from ._backend import use_backend
from ._checks import checks_enabled, set_checks
from .attn import attention
from .attn.dropout import attention_dropout_mask, dropout_keep_mask
from .attn.reference import attention_reference
from .jagged import JaggedTensor, jagged
from .ops import (
    cross_entropy,
    gelu,
    layer_norm,
    linear,
    matmul,
    mean,
    relu,
    rms_norm,
    rotary,
    select,
    silu,
    softmax,
    sum,
    swiglu,
    threshold,
    transposed_matmul,
)
from .sdpa import scaled_dot_product_attention

__all__ = [
    "JaggedTensor",
    "attention",
    "attention_dropout_mask",
    "attention_reference",
    "checks_enabled",
    "cross_entropy",
    "dropout_keep_mask",
    "gelu",
    "jagged",
    "layer_norm",
    "linear",
    "matmul",
    "mean",
    "distributed",
    "nn",
    "relu",
    "rms_norm",
    "rotary",
    "scaled_dot_product_attention",
    "select",
    "set_checks",
    "silu",
    "softmax",
    "sum",
    "swiglu",
    "threshold",
    "transposed_matmul",
    "use_backend",
]
__version__ = "0.1.0"
