"""Jagged-tensor ops, one module per family, each with a fused, sync-free backward."""

from .cross_entropy import cross_entropy
from .linear import linear, matmul, transposed_matmul
from .norm import layer_norm, rms_norm
from .pointwise import gelu, relu, silu, threshold
from .reduce import mean, sum
from .rotary import rotary
from .select import select
from .softmax import softmax
from .swiglu import swiglu

__all__ = ["cross_entropy", "gelu", "layer_norm", "linear", "matmul", "mean", "relu", "rms_norm", "rotary", "select",
           "silu", "softmax", "sum", "swiglu", "threshold", "transposed_matmul"]
