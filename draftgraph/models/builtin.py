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


def module_from_state_dict(state: dict) -> torch.nn.Module:
    """An nn.Module whose state_dict is `state` (dotted names become nested modules), as a drafter held
    in memory under its upstream key names would be."""
    root = torch.nn.Module()
    for name, t in state.items():
        *parents, leaf = name.split(".")
        mod = root
        for p in parents:
            if not hasattr(mod, p):
                mod.add_module(p, torch.nn.Module())
            mod = getattr(mod, p)
        if t.is_floating_point():
            mod.register_parameter(leaf, torch.nn.Parameter(t, requires_grad=False))
        else:
            mod.register_buffer(leaf, t)
    return root


def _random_layer(prefix: str, cfg, gen, in_features: int | None = None, input_norm: bool = True) -> dict:
    h, std = cfg.hidden_size, 0.05
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim

    def r(*shape):
        return torch.randn(*shape, generator=gen) * std

    w = {
        prefix + "self_attn.q_proj.weight": r(q, in_features or h),
        prefix + "self_attn.k_proj.weight": r(kv, in_features or h),
        prefix + "self_attn.v_proj.weight": r(kv, in_features or h),
        prefix + "self_attn.o_proj.weight": r(h, q),
        prefix + "mlp.gate_proj.weight": r(cfg.intermediate_size, h),
        prefix + "mlp.up_proj.weight": r(cfg.intermediate_size, h),
        prefix + "mlp.down_proj.weight": r(h, cfg.intermediate_size),
        prefix + "post_attention_layernorm.weight": torch.ones(h),
    }
    if input_norm:
        w[prefix + "input_layernorm.weight"] = torch.ones(h)
    return w


def builtin_drafter(kind: str, target: CausalLM, seed: int = 0, draft_layers: int = 2):
    """A drafter of `kind` for `target`: the truncated draft model, or an EAGLE / EAGLE-3 / MTP head with
    random weights written under its upstream key names and loaded like a checkpoint (no real acceptance:
    for structure, tests and inspection)."""
    from draftgraph.models.drafters.loader import load_drafter

    if kind == "draft_model":
        return truncated_draft_model(target, min(draft_layers, target.cfg.num_layers))
    cfg, h, vocab = target.cfg, target.cfg.hidden_size, target.cfg.vocab_size
    gen = torch.Generator().manual_seed(seed)
    if kind == "eagle":
        w = _random_layer("layers.0.", cfg, gen, input_norm=False)
        w["fc.weight"] = torch.randn(h, 2 * h, generator=gen) * 0.05
        w["fc.bias"] = torch.zeros(h)
    elif kind == "eagle3":
        draft_vocab = vocab // 2
        w = _random_layer("midlayer.", cfg, gen, in_features=2 * h)
        w["midlayer.hidden_norm.weight"] = torch.ones(h)
        w["fc.weight"] = torch.randn(h, 3 * h, generator=gen) * 0.05
        w["norm.weight"] = torch.ones(h)
        w["lm_head.weight"] = torch.randn(draft_vocab, h, generator=gen) * 0.05
        w["d2t"] = torch.arange(draft_vocab) * 2 - torch.arange(draft_vocab)  # draft id i -> target id 2i
        w["t2d"] = torch.arange(vocab) % 2 == 0
    elif kind == "mtp":
        p = f"model.layers.{cfg.num_layers}."
        w = deepseek_layer_weights(p, cfg, gen) if cfg.mla is not None else _random_layer(p, cfg, gen)
        w.update(
            {
                p + "enorm.weight": torch.ones(h),
                p + "hnorm.weight": torch.ones(h),
                p + "eh_proj.weight": torch.randn(h, 2 * h, generator=gen) * 0.05,
                p + "shared_head.norm.weight": torch.ones(h),
            }
        )
    else:
        raise ValueError(f"drafter kind {kind!r} is unknown; choose one of eagle, eagle3, mtp, draft_model")
    return load_drafter(module_from_state_dict(w), target, kind=kind)


def deepseek_layer_weights(prefix: str, cfg, gen, quiet: bool = False, std: float = 0.05) -> dict:
    """A random DeepSeek-V3 layer (MLA, and MoE with one module per expert, the hub's layout) under its
    transformers names at `prefix`. `quiet`: the attention and expert outputs are zero, so the layer passes
    its input through (a drafter that repeats the target's prediction)."""
    a, m, h = cfg.mla, cfg.moe, cfg.hidden_size

    def r(*shape):
        return torch.randn(*shape, generator=gen) * std

    sa = prefix + "self_attn."
    w = {
        sa + "kv_a_proj_with_mqa.weight": r(a.kv_lora_rank + a.qk_rope_head_dim, h),
        sa + "kv_a_layernorm.weight": torch.ones(a.kv_lora_rank),
        sa + "kv_b_proj.weight": r(cfg.num_heads * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank),
        sa + "o_proj.weight": r(h, cfg.num_heads * a.v_head_dim) * (0 if quiet else 1),
        prefix + "input_layernorm.weight": torch.ones(h),
        prefix + "post_attention_layernorm.weight": torch.ones(h),
        prefix + "mlp.gate.weight": r(m.num_experts, h),
        prefix + "mlp.gate.e_score_correction_bias": torch.zeros(m.num_experts),
    }
    if a.q_lora_rank:
        w[sa + "q_a_proj.weight"] = r(a.q_lora_rank, h)
        w[sa + "q_a_layernorm.weight"] = torch.ones(a.q_lora_rank)
        w[sa + "q_b_proj.weight"] = r(cfg.num_heads * a.qk_head_dim, a.q_lora_rank)
    else:
        w[sa + "q_proj.weight"] = r(cfg.num_heads * a.qk_head_dim, h)
    experts = [(f"mlp.experts.{e}.", m.moe_intermediate_size) for e in range(m.num_experts)]
    if m.n_shared_experts:
        experts.append(("mlp.shared_experts.", m.moe_intermediate_size * m.n_shared_experts))
    for name, inter in experts:
        w[prefix + name + "gate_proj.weight"] = r(inter, h)
        w[prefix + name + "up_proj.weight"] = r(inter, h)
        w[prefix + name + "down_proj.weight"] = r(h, inter) * (0 if quiet else 1)
    return w
