"""varlen: variable-length batches without padding.

Jagged tensors with fused, sync-free backward passes, and fused attention (forward and backward)
for dense and jagged batches.
"""

from ._backend import use_backend
from .jagged import JaggedTensor, jagged

__all__ = ["JaggedTensor", "jagged", "use_backend"]
__version__ = "0.1.0"
