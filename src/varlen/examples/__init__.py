"""Runnable examples: ``python -m varlen.examples.train``."""
