"""ModelConfig: the one description of a decoder (Llama family, DeepSeek-V3 / V3.2) that our modules are built from.

Built from a transformers config object (or a config.json dict) by `ModelConfig.from_hf`, so the rest
of the package never reads transformers attributes directly. Frozen: derived values are properties.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from draftgraph.models.hybrid_config import HYBRID_TYPES, WRAPPER_TYPES, HybridConfig, hybrid_from_hf

# model_type -> the behaviour switches it implies (transformers' own defaults); each is claimed by one family in
# models/families/ (tests/test_families.py checks they agree).
MODEL_TYPES = {
    "llama": {"qk_norm": False, "qkv_bias": None},
    "qwen2": {"qk_norm": False, "qkv_bias": True},
    "qwen3": {"qk_norm": True, "qkv_bias": None},
    "mistral": {"qk_norm": False, "qkv_bias": False},
    "deepseek_v3": {"qk_norm": False, "qkv_bias": None},  # MLA + MoE: see MLAConfig, MoEConfig
    "deepseek_v32": {"qk_norm": False, "qkv_bias": None},  # V3 + the sparse attention indexer: IndexerConfig
    "qwen3_5_text": {"qk_norm": True, "qkv_bias": None},  # Gated DeltaNet + gated attention: see HybridConfig
    "qwen3_5_moe_text": {"qk_norm": True, "qkv_bias": None},
}

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters (transformers' `rope_parameters` / legacy `rope_scaling`)."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn (DeepSeek): ramp bounds and the magnitude scales (cos/sin and the softmax scale)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float = 0.0  # 0 = derived from factor / mscale / mscale_all_dim
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_type={self.rope_type!r} is not supported; supported: {ROPE_TYPES}. "
                "Use a checkpoint with one of these RoPE variants."
            )


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3): queries through an optional low-rank q_a/q_b pair, keys
    and values from one latent of kv_lora_rank plus a shared RoPE key of qk_rope_head_dim per token."""

    q_lora_rank: int  # 0 = a full q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # RoPE pairs (x0, x1), (x2, x3), ... (DeepSeek's layout)
    softmax_scale: float = 0.0  # set by ModelConfig.from_hf (qk_head_dim ** -0.5, times yarn's mscale^2)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """DeepSeek-V3 mixture of experts: sigmoid scores, grouped top-k routing, shared experts."""

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int  # layers below this index keep a dense MLP
    mlp_layer_types: tuple[str, ...] = ()  # V3.2: "dense" / "sparse" per layer (overrides first_k_dense_replace)

    def __post_init__(self):
        bad = sorted(set(self.mlp_layer_types) - {"dense", "sparse"})
        if bad:
            raise ValueError(f"mlp_layer_types holds {bad}; allowed: 'dense', 'sparse' (one per layer)")
        if self.num_experts % self.n_group:
            raise ValueError(
                f"n_routed_experts={self.num_experts} is not a multiple of n_group={self.n_group}; "
                "grouped routing needs equal groups"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"topk_group={self.topk_group} must lie in [1, n_group={self.n_group}]")
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(
                f"num_experts_per_tok={self.top_k} exceeds the experts in the {self.topk_group} chosen groups"
            )


@dataclass(frozen=True)
class IndexerConfig:
    """DeepSeek-V3.2's lightning indexer (DeepSeek Sparse Attention): per token, `num_heads` queries of
    `head_dim` from the MLA query latent, one key of `head_dim` (LayerNorm), non-interleaved RoPE on the first
    `rope_dim` dims; MLA then attends to the `topk` best-scoring visible tokens only."""

    num_heads: int  # index_n_heads
    head_dim: int  # index_head_dim
    topk: int  # index_topk
    rope_dim: int  # qk_rope_head_dim: the RoPE part of each indexer query and key

    def __post_init__(self):
        sizes = (("index_n_heads", self.num_heads), ("index_head_dim", self.head_dim), ("index_topk", self.topk))
        for key, value in sizes:
            if value < 1:
                raise ValueError(f"{key}={value} must be at least 1; fix it in the checkpoint's config.json")
        if self.rope_dim > self.head_dim:
            raise ValueError(
                f"index_head_dim={self.head_dim} is smaller than qk_rope_head_dim={self.rope_dim}; the indexer "
                "applies RoPE to its first qk_rope_head_dim dims, so index_head_dim must be at least that"
            )


@dataclass(frozen=True)
class ModelConfig:
    """Shape and behaviour of a Llama-family decoder (Llama 2/3, Qwen2, Qwen3, Mistral)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    # Per-layer sliding window (0 = full causal attention).
    sliding_windows: tuple[int, ...] = ()
    hidden_act: str = "silu"
    dtype: torch.dtype = torch.float32
    eos_token_ids: tuple[int, ...] = ()
    mla: MLAConfig | None = None  # DeepSeek: latent attention (then head_dim is the RoPE part's width)
    moe: MoEConfig | None = None
    indexer: IndexerConfig | None = None  # DeepSeek-V3.2: sparse MLA over the indexer's top-k tokens
    hybrid: HybridConfig | None = None  # Qwen3.5: linear-attention layers, partial RoPE, output gate, Qwen MoE
    # Tensor-parallel ranks this config is one share of (models/parallel/dense.py's shard_config): then num_heads,
    # num_kv_heads and intermediate_size are per rank (the KV cache holds the local KV heads), vocab_size is full.
    tp_size: int = 1

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type={self.model_type!r} is not supported; supported: {sorted(MODEL_TYPES)}.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}; GQA needs whole groups."
            )
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; supported: silu.")
        if self.sliding_windows and len(self.sliding_windows) != self.num_layers:
            raise ValueError(f"sliding_windows has {len(self.sliding_windows)} entries for {self.num_layers} layers")

    def is_moe_layer(self, layer: int) -> bool:
        if self.moe is None:
            return False
        if layer < len(self.moe.mlp_layer_types):  # past them (an MTP layer): a MoE layer, as in V3
            return self.moe.mlp_layer_types[layer] == "sparse"
        return layer >= self.moe.first_k_dense_replace

    @property
    def kv_entry_shapes(self) -> tuple[tuple[int, ...], ...]:
        """What the paged cache holds per token and layer: K and V [Hkv, D] each, or MLA's latent [r] and
        RoPE key [d_rope], plus with the V3.2 indexer its key [index_head_dim] (one slot addresses all)."""
        if self.mla is not None:
            index = ((self.indexer.head_dim,),) if self.indexer is not None else ()
            return ((self.mla.kv_lora_rank,), (self.mla.qk_rope_head_dim,), *index)
        return ((self.num_kv_heads, self.head_dim), (self.num_kv_heads, self.head_dim))

    @property
    def rotary_dim(self) -> int:
        """Width of the RoPE table: the rotated dims of each head (all of head_dim unless partial)."""
        return self.hybrid.rotary_dim if self.hybrid is not None else self.head_dim

    def first_layers(self, n: int) -> ModelConfig:
        """This config cut to its first n layers (a truncated draft model)."""
        hybrid = self.hybrid.first_layers(n) if self.hybrid is not None else None
        return self.replace(num_layers=n, sliding_windows=self.sliding_windows[:n], hybrid=hybrid)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def window(self, layer: int) -> int:
        return self.sliding_windows[layer] if self.sliding_windows else 0

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(cls, hf_config: Any, dtype: torch.dtype | None = None) -> ModelConfig:
        """Build from a transformers PretrainedConfig or a config.json dict."""
        get = _getter(hf_config)
        model_type = get("model_type", "llama")
        if model_type in WRAPPER_TYPES and get("text_config", None) is not None:  # the text part of Qwen3.5
            text = get("text_config")
            if isinstance(text, dict):  # config.json: the wrapper's eos and the text model_type when absent
                text = {"model_type": f"{model_type}_text", "eos_token_id": get("eos_token_id", None), **text}
            if dtype is None:
                dtype = _parse_dtype(get("torch_dtype", None) or get("dtype", None))
            return cls.from_hf(text, dtype=dtype)
        if model_type not in MODEL_TYPES:
            raise ValueError(
                f"model_type={model_type!r} is not supported; supported: {sorted(MODEL_TYPES)}. "
                "draftgraph builds Llama-family targets from their transformers config."
            )
        family = MODEL_TYPES[model_type]
        num_heads = get("num_attention_heads")
        hidden = get("hidden_size")
        head_dim = get("head_dim") or hidden // num_heads
        num_layers = get("num_hidden_layers")
        qkv_bias = family["qkv_bias"]
        if qkv_bias is None:
            qkv_bias = bool(get("attention_bias", False))
        o_bias = bool(get("attention_bias", False)) if model_type in ("llama", "qwen3", *HYBRID_TYPES) else False
        if dtype is None:
            dtype = _parse_dtype(get("torch_dtype", None) or get("dtype", None))
        rope = rope_from_hf(get)
        mla = moe = indexer = hybrid = None
        intermediate = get("intermediate_size")
        if model_type in HYBRID_TYPES:
            hybrid = hybrid_from_hf(get, head_dim, num_layers)
            if hybrid.moe is not None and intermediate is None:  # every layer is MoE: no dense MLP
                intermediate = hybrid.moe.shared_expert_intermediate_size
        if model_type in ("deepseek_v3", "deepseek_v32"):
            mla, moe = _deepseek_parts(get, rope)
            head_dim = mla.qk_rope_head_dim  # the RoPE table's width
        if model_type == "deepseek_v32":
            indexer = _indexer_part(get, mla)
        return cls(
            model_type=model_type,
            vocab_size=get("vocab_size"),
            hidden_size=hidden,
            intermediate_size=intermediate,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=get("rms_norm_eps", 1e-6),
            rope=rope,
            max_position_embeddings=get("max_position_embeddings", 4096),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(get("mlp_bias", False)),
            qk_norm=family["qk_norm"],
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            sliding_windows=_sliding_windows(get, model_type, num_layers),
            hidden_act=get("hidden_act", "silu"),
            dtype=dtype,
            eos_token_ids=_as_tuple(get("eos_token_id", None)),
            mla=mla,
            moe=moe,
            indexer=indexer,
            hybrid=hybrid,
        )

    @classmethod
    def from_dir(cls, path: str, dtype: torch.dtype | None = None) -> ModelConfig:
        with open(os.path.join(path, "config.json")) as f:
            return cls.from_hf(json.load(f), dtype=dtype)


def _getter(hf_config: Any):
    if isinstance(hf_config, dict):
        return lambda k, d=None: hf_config.get(k, d) if hf_config.get(k) is not None else d
    return lambda k, d=None: getattr(hf_config, k, d) if getattr(hf_config, k, None) is not None else d


def _deepseek_parts(get, rope: RopeConfig) -> tuple[MLAConfig, MoEConfig]:
    nope, rope_dim = get("qk_nope_head_dim"), get("qk_rope_head_dim")
    scale = (nope + rope_dim) ** -0.5
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale *= m * m
    mla = MLAConfig(
        q_lora_rank=get("q_lora_rank", 0) or 0,
        kv_lora_rank=get("kv_lora_rank"),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=get("v_head_dim"),
        rope_interleave=bool(get("rope_interleave", True)),
        softmax_scale=scale,
    )
    moe = MoEConfig(
        num_experts=get("n_routed_experts"),
        top_k=get("num_experts_per_tok"),
        moe_intermediate_size=get("moe_intermediate_size"),
        n_shared_experts=get("n_shared_experts", 0) or 0,
        n_group=get("n_group", 1) or 1,
        topk_group=get("topk_group", 1) or 1,
        routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
        norm_topk_prob=bool(get("norm_topk_prob", True)),
        first_k_dense_replace=get("first_k_dense_replace", 0) or 0,
        mlp_layer_types=tuple(get("mlp_layer_types", ()) or ()),
    )
    return mla, moe


def _indexer_part(get, mla: MLAConfig) -> IndexerConfig:
    if not mla.q_lora_rank:
        raise ValueError(
            "q_lora_rank=0 with model_type 'deepseek_v32': the indexer's queries come from the MLA query latent "
            "(q_a_proj), so DeepSeek-V3.2 needs q_lora_rank > 0"
        )
    return IndexerConfig(
        num_heads=get("index_n_heads", 64),
        head_dim=get("index_head_dim", 128),
        topk=get("index_topk", 2048),
        rope_dim=mla.qk_rope_head_dim,
    )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_from_hf(get) -> RopeConfig:
    """transformers 5 keeps RoPE in `rope_parameters` (theta inside); 4.x in rope_theta + rope_scaling."""
    params = dict(get("rope_parameters", None) or get("rope_scaling", None) or {})
    theta = params.get("rope_theta", get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    keys = ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
    kw = {k: float(params[k]) for k in keys if params.get(k) is not None}
    if params.get("attention_factor") is not None:
        kw["attention_factor"] = float(params["attention_factor"])
    if "truncate" in params:
        kw["truncate"] = bool(params["truncate"])
    if "original_max_position_embeddings" in params:
        kw["original_max_position_embeddings"] = params["original_max_position_embeddings"]
    return RopeConfig(theta=float(theta), rope_type=rope_type, **kw)


def _sliding_windows(get, model_type: str, num_layers: int) -> tuple[int, ...]:
    window = get("sliding_window", None)
    if not window:
        return ()
    layer_types = get("layer_types", None)
    if layer_types:
        ws = tuple(window if t == "sliding_attention" else 0 for t in layer_types)
        return ws if any(ws) else ()
    if model_type == "qwen2" and not get("use_sliding_window", False):
        return ()
    return (int(window),) * num_layers


def _parse_dtype(value) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and hasattr(torch, value):
        return getattr(torch, value)
    return torch.float32


def _as_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)
