"""Triton kernels for attention: forward, backward, and their launchers."""
