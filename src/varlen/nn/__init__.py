"""Modules for jagged batches: ``torch.nn``'s attention, encoder layer and encoder stack without padding."""

from .attention import MultiheadAttention
from .transformer import TransformerEncoder, TransformerEncoderLayer

__all__ = ["MultiheadAttention", "TransformerEncoder", "TransformerEncoderLayer"]
