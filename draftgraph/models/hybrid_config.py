"""HybridConfig: what a Qwen3.5 hybrid (Gated DeltaNet linear attention + gated full attention) adds to
ModelConfig, read from transformers' `qwen3_5_text` / `qwen3_5_moe_text` configs (models/config.py calls
`hybrid_from_hf`; the multimodal `qwen3_5` / `qwen3_5_moe` configs hold these in `text_config`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

LAYER_TYPES = ("linear_attention", "full_attention")
HYBRID_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
WRAPPER_TYPES = ("qwen3_5", "qwen3_5_moe")  # multimodal configs: the text model sits in text_config


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet shape: k heads of head_k_dim for q and k, v heads of head_v_dim, a depthwise causal
    conv of conv_kernel taps over [q | k | v]."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    def __post_init__(self):
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads={self.num_v_heads} is not a multiple of linear_num_key_heads="
                f"{self.num_k_heads}; each k head must serve whole groups of v heads"
            )
        if self.conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim={self.conv_kernel} must be at least 2")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


@dataclass(frozen=True)
class QwenMoEConfig:
    """Qwen-MoE block: softmax router, top-k renormalised, plus a sigmoid-gated shared expert."""

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int

    def __post_init__(self):
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must lie in [1, num_experts={self.num_experts}]")


@dataclass(frozen=True)
class HybridConfig:
    layer_types: tuple[str, ...]  # per layer: "linear_attention" (Gated DeltaNet) or "full_attention"
    linear: LinearAttentionConfig
    rotary_dim: int  # RoPE on the first rotary_dim dims of each head (partial_rotary_factor * head_dim)
    attn_output_gate: bool = True  # q_proj also yields a per-head gate: out * sigmoid(gate) before o_proj
    moe: QwenMoEConfig | None = None  # every layer's MLP is this MoE (qwen3_5_moe), else dense

    def __post_init__(self):
        bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if bad:
            raise ValueError(f"layer_types holds {bad}; supported: {list(LAYER_TYPES)}")

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == "linear_attention"

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    def first_layers(self, n: int) -> HybridConfig:
        return dataclasses.replace(self, layer_types=self.layer_types[:n])


def hybrid_from_hf(get, head_dim: int, num_layers: int) -> HybridConfig:
    """From a `qwen3_5_text` / `qwen3_5_moe_text` config (`get` reads one key with a default)."""
    layer_types = get("layer_types", None)
    if not layer_types:
        interval = get("full_attention_interval", 4)
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for num_hidden_layers={num_layers}")
    params = dict(get("rope_parameters", None) or {})
    factor = params.get("partial_rotary_factor", get("partial_rotary_factor", 0.25))
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(
            f"partial_rotary_factor={factor} gives {rotary_dim} rotary dims of head_dim={head_dim}; it must give an "
            "even count in [2, head_dim]"
        )
    linear = LinearAttentionConfig(
        num_k_heads=get("linear_num_key_heads", 16),
        num_v_heads=get("linear_num_value_heads", 32),
        head_k_dim=get("linear_key_head_dim", 128),
        head_v_dim=get("linear_value_head_dim", 128),
        conv_kernel=get("linear_conv_kernel_dim", 4),
    )
    moe = None
    if get("num_experts", None):
        moe = QwenMoEConfig(
            num_experts=get("num_experts"),
            top_k=get("num_experts_per_tok"),
            moe_intermediate_size=get("moe_intermediate_size"),
            shared_expert_intermediate_size=get("shared_expert_intermediate_size"),
        )
    return HybridConfig(tuple(layer_types), linear, rotary_dim, bool(get("attn_output_gate", True)), moe)
