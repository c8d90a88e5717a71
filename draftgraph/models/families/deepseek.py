"""DeepSeek-V3 and V3.2: MLA (latent KV cache: one latent and RoPE key per token) with MoE layers past
`first_k_dense_replace` (models/deepseek.py); V3.2 adds the lightning indexer and attends sparsely to its top-k
tokens (models/deepseek_v32.py, whose index keys share the paged cache's slots). Both split MLA heads and every
expert's intermediate dimension over tensor-parallel ranks (models/parallel/mla.py), and carry their MTP layer
as `model.layers.{num_hidden_layers}`, a layer of the target's own shape (drafters/mtp.py)."""

from __future__ import annotations

from torch import nn

from draftgraph.models.config import ModelConfig
from draftgraph.models.deepseek import DeepseekLayer, convert_deepseek_layer
from draftgraph.models.deepseek_v32 import convert_deepseek_v32_layer, make_v32_layer
from draftgraph.models.families.registry import AttentionForm, Family, MTPHead, TensorParallelShare
from draftgraph.models.parallel.mla import deepseek_cut, mla_sizes, scale_mla_config
from draftgraph.models.parallel.shard_cut import Cut
from draftgraph.ops.choices import OpChoices
from draftgraph.ops.collectives.op import ParallelGroup


def make_layer(cfg: ModelConfig, layer: int, attn_impl: str, tp: ParallelGroup, ops: OpChoices) -> nn.Module:
    return DeepseekLayer(cfg, layer, attn_impl, tp=tp, ops=ops)


def mla_cut(name: str, shape: tuple[int, ...], rank: int, w: int, cfg: ModelConfig) -> Cut | None:
    return deepseek_cut(name, shape, rank, w)


SHARE = TensorParallelShare(sizes=mla_sizes, scale=scale_mla_config, cut=mla_cut)

DEEPSEEK_V3 = Family(
    name="deepseek_v3",
    model_types=("deepseek_v3",),
    parts=("mla",),
    attention=AttentionForm.MLA,
    make_layer=make_layer,
    convert_layer=convert_deepseek_layer,
    share=SHARE,
    mtp=MTPHead.TARGET_LAYER,
    experts=lambda cfg: cfg.moe,
)

DEEPSEEK_V32 = Family(
    name="deepseek_v32",
    model_types=("deepseek_v32",),
    parts=("mla", "indexer"),
    attention=AttentionForm.SPARSE_MLA,
    make_layer=make_v32_layer,
    convert_layer=convert_deepseek_v32_layer,
    share=SHARE,  # the indexer is replicated (parallel/mla.py)
    mtp=MTPHead.TARGET_LAYER,
    experts=lambda cfg: cfg.moe,
)
