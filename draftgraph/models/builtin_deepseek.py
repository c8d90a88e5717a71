"""A built-in tiny DeepSeek-V3.2 target (random, seeded weights) for the inspection goldens and smoke runs:
sparse MLA with the lightning indexer (16 heads, top-8), yarn RoPE, a dense first layer and grouped MoE.
Its MTP drafter comes from `builtin_drafter("mtp", target)` (a V3.2 layer past the decoder's layers)."""

from __future__ import annotations

import torch
import transformers


def builtin_deepseek_v32_hf(seed: int = 0, index_topk: int = 8):
    """transformers' DeepseekV32ForCausalLM at a tiny size (vocabulary 128, hidden 64, 3 layers)."""
    cfg = transformers.DeepseekV32Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        index_topk=index_topk,
        index_n_heads=16,
        index_head_dim=16,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return transformers.DeepseekV32ForCausalLM(cfg).eval()
