"""Paged attention: the custom op (op.py), the metadata it reads, its reference, SDPA and Triton kernels."""
