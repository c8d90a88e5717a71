"""The Llama family: Llama 2/3, Qwen2, Qwen3 (q/k norms), Mistral (sliding windows). Paged MHA / GQA over K and
V heads (models/layers.py), heads and MLP columns split over tensor-parallel ranks (models/parallel/dense.py)."""

from __future__ import annotations

from torch import nn

from draftgraph.models.config import ModelConfig
from draftgraph.models.families.registry import AttentionForm, Family, MTPHead, TensorParallelShare
from draftgraph.models.layers import DecoderLayer
from draftgraph.models.parallel.dense import dense_sizes, scale_dense_config
from draftgraph.models.weights import convert_layer
from draftgraph.ops.choices import OpChoices
from draftgraph.ops.collectives.op import ParallelGroup


def make_layer(cfg: ModelConfig, layer: int, attn_impl: str, tp: ParallelGroup, ops: OpChoices) -> nn.Module:
    return DecoderLayer(cfg, layer, attn_impl, tp=tp, ops=ops)


LLAMA = Family(
    name="llama",
    model_types=("llama", "qwen2", "qwen3", "mistral"),
    parts=(),
    attention=AttentionForm.PAGED_GQA,
    make_layer=make_layer,
    convert_layer=convert_layer,
    share=TensorParallelShare(sizes=dense_sizes, scale=scale_dense_config),
    mtp=MTPHead.OWN_CONFIG,
)
