"""Custom ops and their kernels, one folder per op family.

Each family holds its op's schema and fake implementation, its PyTorch reference (the oracle), its Triton
kernels and what it supports inside CUDA graphs (backends.py). `splitting.py` holds the one list of ops the
compiler splits graphs at. Imports flow one way: ops <- models <- passes <- compiler <- runtime <- cli.
"""
