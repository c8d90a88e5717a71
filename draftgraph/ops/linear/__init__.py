"""Linear layers as an op: `torch.ops.draftgraph.linear`, a Triton GEMV on CUDA for a few rows, cuBLAS otherwise."""
