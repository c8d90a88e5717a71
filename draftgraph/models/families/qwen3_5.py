"""Qwen3.5 hybrids (dense and MoE): Gated DeltaNet layers, whose recurrent state lives in runtime/state_cache.py
instead of the paged KV cache, between gated full-attention layers with partial RoPE (models/qwen3_5.py); a
zero-centred final norm; checkpoints in the multimodal layout, read for their text model
(models/qwen3_5_weights.py); linear-attention heads and experts split over tensor-parallel ranks
(models/parallel/hybrid.py); the `mtp.*` head as drafter (drafters/qwen3_5_mtp.py)."""

from __future__ import annotations

from draftgraph.models.config import ModelConfig
from draftgraph.models.families.registry import AttentionForm, Family, MTPHead, TensorParallelShare
from draftgraph.models.parallel.hybrid import hybrid_cut, hybrid_sizes, scale_hybrid_config
from draftgraph.models.parallel.mla import deepseek_cut
from draftgraph.models.parallel.shard_cut import Cut
from draftgraph.models.qwen3_5 import Qwen3_5Layer
from draftgraph.models.qwen3_5_weights import NOT_TEXT_MODEL, convert_qwen3_5_layer, normalize_keys


def cut(name: str, shape: tuple[int, ...], rank: int, w: int, cfg: ModelConfig) -> Cut | None:
    """Fused experts by the rule DeepSeek's share too (parallel/mla.py), then the names only Qwen3.5 has."""
    own = deepseek_cut(name, shape, rank, w)
    return own if own is not None else hybrid_cut(name, shape, rank, w, cfg.hybrid.linear)


QWEN3_5 = Family(
    name="qwen3_5",
    model_types=("qwen3_5_text", "qwen3_5_moe_text"),
    parts=("hybrid",),
    attention=AttentionForm.HYBRID,
    make_layer=Qwen3_5Layer,
    convert_layer=convert_qwen3_5_layer,
    share=TensorParallelShare(sizes=hybrid_sizes, scale=scale_hybrid_config, cut=cut),
    mtp=MTPHead.QWEN3_5,
    zero_centered_norm=True,
    normalize_keys=normalize_keys,
    foreign_prefixes=NOT_TEXT_MODEL,
    state_layers=lambda cfg: cfg.hybrid.linear_layers,
    experts=lambda cfg: cfg.hybrid.moe,
)
