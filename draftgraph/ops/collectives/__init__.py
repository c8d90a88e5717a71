"""Tensor-parallel collectives (all-reduce, all-gather along the last dim) as custom ops."""
