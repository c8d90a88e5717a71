"""RMSNorm ops: `torch.ops.draftgraph.rms_norm` and `add_rms_norm` (the residual add and the norm), one Triton
kernel each on CUDA."""
