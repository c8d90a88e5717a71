"""A built-in tiny Qwen3.5 target (random, seeded weights) for the inspection goldens and smoke runs: three
Gated DeltaNet layers and one gated full-attention layer (Qwen3.5's 3 : 1 pattern), dense MLP or Qwen MoE.
Its MTP drafter comes from `builtin_drafter("mtp", target)` (the `mtp.*` checkpoint layout, random)."""

from __future__ import annotations

import torch
import transformers

LAYER_TYPES = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def builtin_qwen3_5_hf(seed: int = 0, moe: bool = False):
    """transformers' Qwen3_5(Moe)ForCausalLM at a tiny size (vocabulary 128, hidden 64, 4 layers); norms and
    the decay bias get random offsets too, so no layer is the identity its initialisation would make it."""
    torch.manual_seed(seed)
    shape = dict(
        vocab_size=128,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=8,
        max_position_embeddings=256,
        layer_types=LAYER_TYPES,
    )
    if moe:
        config = transformers.Qwen3_5MoeTextConfig(
            **shape, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40
        )
        model = transformers.Qwen3_5MoeForCausalLM(config)
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**shape, intermediate_size=96))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()
