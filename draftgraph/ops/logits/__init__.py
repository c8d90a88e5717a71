"""Logits processing ops of the step: penalties / logit bias / min_tokens (penalties.py) and the logprobs gather
(logprobs.py), each a PyTorch reference (the oracle and the CPU path) and Triton kernels for CUDA."""
