"""Gated DeltaNet linear attention (Qwen3.5): the custom op with its PyTorch reference."""
