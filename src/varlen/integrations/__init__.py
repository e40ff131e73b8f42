"""Integrations with other libraries, each imported on demand (``import varlen`` imports none of them).

- ``varlen.integrations.transformers``: ``attn_implementation="varlen"`` for Hugging Face transformers.
"""
