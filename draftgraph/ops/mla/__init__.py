"""Multi-head latent attention (DeepSeek): the custom op, its two forms, references and Triton kernels."""
