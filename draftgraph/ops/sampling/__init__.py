"""Token choice ops: `torch.ops.draftgraph.argmax_rows` (greedy argmax over the vocabulary) and its Triton kernel."""
