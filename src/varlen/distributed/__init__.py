"""Context parallelism over ``torch.distributed``: one packed batch of sequences split across ranks, with
attention exact in the forward and the backward (:class:`ContextParallel`)."""

from .context_parallel import ContextParallel
from .plan import Piece, Plan, make_plan

__all__ = ["ContextParallel", "Piece", "Plan", "make_plan"]
