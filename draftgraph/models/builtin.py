"""Built-in model pairs with random (seeded) weights, for demos, tests and benchmarks without a hub.

The target is a transformers Llama-family model from a config. Its layers past `draft_layers` get small
residual branches (o_proj and down_proj scaled by `late_scale`), so the built-in drafter, the target's
own first `draft_layers` layers with its embedding, norm and head (truncated_draft_model), agrees with
it often: real acceptance, measured rather than assumed (see docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers

from draftgraph.models.drafters.loader import truncated_draft_model
from draftgraph.models.llama import CausalLM

HF_CONFIGS = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "mistral": transformers.MistralConfig,
}


@dataclass(frozen=True)
class BuiltinSpec:
    family: str = "llama"
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    draft_layers: int = 2
    late_scale: float = 0.1
    init_std: float = 0.05
    max_position_embeddings: int = 2048
    seed: int = 0

    def __post_init__(self):
        if self.family not in HF_CONFIGS:
            raise ValueError(f"family={self.family!r} is unknown; choose one of {sorted(HF_CONFIGS)}")
        if not 1 <= self.draft_layers <= self.num_layers:
            raise ValueError(f"draft_layers={self.draft_layers} must lie in [1, num_layers={self.num_layers}]")


def builtin_hf_target(spec: BuiltinSpec = BuiltinSpec()):
    """The transformers model object of the built-in target (random weights, seeded)."""
    cfg = HF_CONFIGS[spec.family](
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        initializer_range=spec.init_std,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(spec.seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            parts = name.split(".")
            if name.endswith(("o_proj.weight", "down_proj.weight")) and int(parts[2]) >= spec.draft_layers:
                p.mul_(spec.late_scale)
    return model


def builtin_pair(spec: BuiltinSpec = BuiltinSpec(), dtype=None, device="cpu", attn_impl="reference"):
    """(target CausalLM, drafter) for the built-in pair."""
    target = CausalLM.from_hf(builtin_hf_target(spec), dtype=dtype, device=device, attn_impl=attn_impl)
    return target, truncated_draft_model(target, spec.draft_layers)
