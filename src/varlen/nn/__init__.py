"""Modules for jagged batches: ``torch.nn``'s attention and encoder layer without padding."""

from .attention import MultiheadAttention
from .transformer import TransformerEncoderLayer

__all__ = ["MultiheadAttention", "TransformerEncoderLayer"]
