"""Routed experts (mixture of experts): the custom op, its reference and the Triton grouped matmul."""
