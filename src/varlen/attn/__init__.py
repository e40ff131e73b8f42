"""Fused attention for dense and jagged batches."""

from .api import attention

__all__ = ["attention"]
