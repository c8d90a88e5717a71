"""RoPE as an op: `torch.ops.draftgraph.rope_qkv` (one Triton kernel on CUDA for the fused QKV output)."""
