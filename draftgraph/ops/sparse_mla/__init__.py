"""DeepSeek Sparse Attention (V3.2): the lightning indexer's top-k and MLA over the selected tokens (custom
ops in op.py, their contracts and PyTorch references in reference.py)."""
