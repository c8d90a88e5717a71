"""Built-in model pairs with random (seeded) weights, for demos, tests and benchmarks without a hub.

The target is a transformers Llama-family model from a config. Its layers past `draft_layers` get small
residual branches (o_proj and down_proj scaled by `late_scale`), so the built-in drafter, the target's
own first `draft_layers` layers with its embedding, norm and head (truncated_draft_model), agrees with
it often: real acceptance, measured rather than assumed (see docs/history/benchmarks-2026-11.md). `acceptance_pair`
builds such a pair at Llama-3.2-1B's shape (LLAMA_1B_ACCEPTANCE, about 2.5 of K = 4 drafts accepted) or a tiny one of
the same structure (TINY_ACCEPTANCE), on the device directly.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, replace

import torch

from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.drafters.loader import truncated_draft_model
from draftgraph.models.families import AttentionForm, MTPHead, family_of
from draftgraph.ops.choices import DEFAULT_OPS, OpChoices

# transformers' config class of each family, imported at first use: `import draftgraph.models.builtin` loads no
# transformers (seconds), so a start that reads the built-in pair from a checkpoint does not pay for it
HF_CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "mistral": "MistralConfig"}


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
    tie_word_embeddings: bool = False
    rope_theta: float | None = None  # None: the family's default
    late_from: int | None = None  # the first layer whose residual branches are scaled; None: draft_layers
    # The LM head is the embedding with its rows permuted (seeded): the logit of token y peaks where the final
    # hidden state is y's predecessor's embedding. With every residual branch small (late_from=0, late_scale
    # small) the hidden state stays near the last token's embedding, so the greedy next token is that token's
    # fixed successor: the target continues a text as it did before (successor_target; untied embeddings only).
    successor_head: bool = False

    def __post_init__(self):
        if self.family not in HF_CONFIGS:
            raise ValueError(f"family={self.family!r} is unknown; choose one of {sorted(HF_CONFIGS)}")
        if not 1 <= self.draft_layers <= self.num_layers:
            raise ValueError(f"draft_layers={self.draft_layers} must lie in [1, num_layers={self.num_layers}]")
        if self.late_from not in (None, 0) and not self.draft_layers <= self.late_from <= self.num_layers:
            raise ValueError(
                f"late_from={self.late_from} must lie in [draft_layers={self.draft_layers}, "
                f"num_layers={self.num_layers}] (layers the drafter runs are never scaled), or be 0 (every layer "
                "scaled: a target run without the truncated drafter)"
            )
        if self.successor_head and self.tie_word_embeddings:
            raise ValueError(
                "successor_head=True needs tie_word_embeddings=False (its LM head is a permuted copy of the "
                "embedding, a separate tensor)"
            )

    @property
    def first_late_layer(self) -> int:
        return self.draft_layers if self.late_from is None else self.late_from


def builtin_hf_target(spec: BuiltinSpec = BuiltinSpec(), device=None, dtype=None):
    """The transformers model object of the built-in target (random weights, seeded), initialised on
    `device` (default: the current default device) in `dtype` (default: torch's default dtype) directly."""
    extra = {} if spec.rope_theta is None else {"rope_theta": spec.rope_theta}
    import transformers

    cfg = getattr(transformers, HF_CONFIGS[spec.family])(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        initializer_range=spec.init_std,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        **extra,
    )
    torch.manual_seed(spec.seed)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = transformers.AutoModelForCausalLM.from_config(cfg, **({"dtype": dtype} if dtype else {})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            parts = name.split(".")
            if name.endswith(("o_proj.weight", "down_proj.weight")) and int(parts[2]) >= spec.first_late_layer:
                p.mul_(spec.late_scale)
        if spec.successor_head:
            embed = model.get_input_embeddings().weight
            model.get_output_embeddings().weight.copy_(embed[_head_permutation(spec).to(embed.device)])
    return model


def _head_permutation(spec: BuiltinSpec) -> torch.Tensor:
    """A successor_head spec's LM head row y is embedding row perm[y] (seeded, CPU)."""
    return torch.randperm(spec.vocab_size, generator=torch.Generator().manual_seed(spec.seed))


def builtin_hf_pair(spec: BuiltinSpec = BuiltinSpec()):
    """The built-in pair as transformers objects (for worker processes, which load their shares from
    save_pretrained directories): the target, and a model of its first `draft_layers` layers holding the same
    weights (embedding, those layers, final norm, LM head)."""
    import transformers

    target = builtin_hf_target(spec)
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = spec.draft_layers
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = cfg.layer_types[: spec.draft_layers]
    draft = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    missing, _ = draft.load_state_dict(target.state_dict(), strict=False)  # the upper layers' keys are unexpected
    if missing:
        raise RuntimeError(f"the truncated draft model lacks weights for {missing}")
    return target, draft


def builtin_pair(
    spec: BuiltinSpec = BuiltinSpec(), dtype=None, device="cpu", attn_impl="reference", ops: OpChoices = DEFAULT_OPS
):
    """(target CausalLM, drafter) for the built-in pair, their layers using the kernels `ops` names."""
    target = CausalLM.from_hf(builtin_hf_target(spec), dtype=dtype, device=device, attn_impl=attn_impl, ops=ops)
    return target, truncated_draft_model(target, spec.draft_layers)


# Llama-3.2-1B's shape (tied embedding, vocabulary 128256) with a drafter of its first 2 layers. The 14
# upper layers' residual branches scaled by 0.0275 make the 2-layer prefix agree with the full model's greedy
# token about 82 % of the time, so K = 4 accepts about 2.5 drafts per step. Measured on CPU (greedy runs of
# 256 tokens after 128 random tokens, 8 prompts) at hidden 512 with init_std * sqrt(hidden) held (each
# projection's output scale as at 2048): 2.50 accepted in float32, 2.57 in bf16, per prompt 2.2-2.8; the
# agreement at a given scale is the same at hidden 512, 1024 and 2048 (0.81 at scale 0.03); scale 0.025
# gives 2.7-2.8, 0.05 gives 1.85, 0.1 gives 0.85.
LLAMA_1B_ACCEPTANCE = BuiltinSpec(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    draft_layers=2,
    late_scale=0.0275,
    init_std=0.02,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
    rope_theta=500000.0,
)
# The same structure, small enough for CPU tests and smoke runs (about 2.5 accepted at K = 4 too).
TINY_ACCEPTANCE = replace(
    LLAMA_1B_ACCEPTANCE,
    vocab_size=512,
    hidden_size=128,
    intermediate_size=512,
    num_layers=4,
    num_heads=2,
    num_kv_heads=1,
    late_scale=0.15,  # 2 late layers of a 512-token vocabulary: measured 2.3 accepted at K = 4
    init_std=0.08,  # 0.02 * sqrt(2048 / 128): each projection's output scale as at hidden 2048
)


def acceptance_pair(spec: BuiltinSpec = LLAMA_1B_ACCEPTANCE, dtype=torch.bfloat16, device="cpu", attn_impl="reference"):
    """(transformers model, target CausalLM, drafter) of a pair with real acceptance: the target built from
    the transformers model's weights on `device` (random, seeded, initialised there directly), the drafter
    its first `spec.draft_layers` layers sharing the embedding, norm and head. The transformers model is
    returned for comparisons (same weights; our target holds fused copies of its projections)."""
    hf = builtin_hf_target(spec, device=device, dtype=dtype)
    target = CausalLM.from_hf(hf, attn_impl=attn_impl)
    return hf, target, truncated_draft_model(target, spec.draft_layers)


# A target that repeats itself, for prompt lookup (the n-gram drafter, scripts/bench_e2e.py --ngram): Llama-3.2-1B's
# shape and step cost, bf16, random seeded weights, but every layer's residual branches scaled by 0.01 and an LM head
# that is the embedding with its rows permuted (successor_head), untied (the same bytes read per step as the tied
# head; 0.5 GB more memory). The final hidden state stays near the last token's embedding, so the greedy next token
# is that token's successor under a fixed random permutation (a bigram model computed by the whole 16-layer stack):
# text the target produced once, placed in its prompt, is what it produces again. The attention and MLP branches
# still move the hidden state (by about a fifth of its size at 0.01), but not the argmax: measured on the CPU, bf16,
# the next token was the last one's successor at every position (scaling 0.05 at 4 layers of hidden 512 still
# holds; 0.1 breaks it: 63 %).
LLAMA_1B_SUCCESSOR = replace(
    LLAMA_1B_ACCEPTANCE, tie_word_embeddings=False, successor_head=True, late_from=0, late_scale=0.01
)
# The same construction at the tiny shape, for CPU tests (float32: the successor at every position up to 0.05).
TINY_SUCCESSOR = replace(TINY_ACCEPTANCE, tie_word_embeddings=False, successor_head=True, late_from=0, late_scale=0.03)


def successor_target(spec: BuiltinSpec = LLAMA_1B_SUCCESSOR, dtype=torch.bfloat16, device="cpu", attn_impl="reference"):
    """(transformers model, target CausalLM, successor) of a successor_head spec, built on `device` directly;
    `successor` [vocab] (int64, CPU) maps token x to its greedy next token (while the residual branches are small
    enough to leave the argmax alone, as in LLAMA_1B_SUCCESSOR and TINY_SUCCESSOR)."""
    if not spec.successor_head:
        raise ValueError("successor_target needs a spec with successor_head=True, e.g. LLAMA_1B_SUCCESSOR")
    hf = builtin_hf_target(spec, device=device, dtype=dtype)
    perm = _head_permutation(spec)
    successor = torch.empty_like(perm)
    successor[perm] = torch.arange(spec.vocab_size)  # head row y is embedding row perm[y]: x's logit peaks at y
    return hf, CausalLM.from_hf(hf, attn_impl=attn_impl), successor


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
    elif kind == "mtp" and family_of(cfg).mtp is MTPHead.QWEN3_5:  # Qwen3.5's head in its checkpoint layout
        from draftgraph.models.drafters.qwen3_5_mtp import random_mtp_weights

        w = random_mtp_weights(cfg, gen)
    elif kind == "mtp":
        p = f"model.layers.{cfg.num_layers}."
        own_shape = family_of(cfg).mtp is MTPHead.TARGET_LAYER  # DeepSeek: a layer of the target's shape
        w = deepseek_layer_weights(p, cfg, gen) if own_shape else _random_layer(p, cfg, gen)
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
    """A random DeepSeek-V3 layer (MLA, and MoE with one module per expert, the hub's layout; V3.2: with its
    indexer) under its transformers names at `prefix`. `quiet`: the attention and expert outputs are zero, so
    the layer passes its input through (a drafter that repeats the target's prediction)."""
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
    if family_of(cfg).attention is AttentionForm.SPARSE_MLA:  # V3.2: the lightning indexer (models/deepseek_v32.py)
        i, ix = cfg.indexer, sa + "indexer."
        w[ix + "wq_b.weight"] = r(i.num_heads * i.head_dim, a.q_lora_rank)
        w[ix + "wk.weight"] = r(i.head_dim, h)
        w[ix + "k_norm.weight"] = torch.ones(i.head_dim)
        w[ix + "k_norm.bias"] = torch.zeros(i.head_dim)
        w[ix + "weights_proj.weight"] = r(i.num_heads, h)
    experts = [(f"mlp.experts.{e}.", m.moe_intermediate_size) for e in range(m.num_experts)]
    if m.n_shared_experts:
        experts.append(("mlp.shared_experts.", m.moe_intermediate_size * m.n_shared_experts))
    for name, inter in experts:
        w[prefix + name + "gate_proj.weight"] = r(inter, h)
        w[prefix + name + "up_proj.weight"] = r(inter, h)
        w[prefix + name + "down_proj.weight"] = r(h, inter) * (0 if quiet else 1)
    return w
