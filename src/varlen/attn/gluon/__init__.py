"""Kernels written in Gluon (Triton 3.6+, sm_90): hot paths whose schedule plain Triton can't express."""
