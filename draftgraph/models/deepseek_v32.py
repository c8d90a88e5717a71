"""DeepSeek-V3.2 decoder layer: DeepSeek Sparse Attention (MLA over the tokens its lightning indexer picks)
and V3's MoE / dense MLP (per `mlp_layer_types`, else `first_k_dense_replace`). `CausalLM` (llama.py) and the
MTP drafter build these when the config has an indexer.

The indexer per token (transformers' DeepseekV32Indexer): queries q = wq_b(r) [Hi, Di] from the MLA query
latent r = q_a_norm(q_a(x)), one key k = LayerNorm(wk(x)) [Di] shared by its heads, non-interleaved RoPE on
the first qk_rope_head_dim dims of both (MLA's own RoPE is interleaved), head weights
w = weights_proj(x) * Hi^-0.5 in float32. ops/sparse_mla: `indexer_topk` writes k into the index-key cache
(kv[2], beside the latent kv[0] and RoPE key kv[1]) and returns each token's top `index_topk` visible
positions; `sparse_mla_attention` writes the latent and attends over those positions only.

Tensor parallelism (`tp`; models/parallel/mla.py): MLA's query heads split as V3's; the indexer is replicated
(whole on every rank), so every rank picks the same positions and keeps the whole index-key cache.
"""

from __future__ import annotations

import torch
from torch import nn

import draftgraph.ops.sparse_mla.op  # noqa: F401  (registers the sparse MLA and indexer ops)
from draftgraph.models.config import ModelConfig
from draftgraph.models.deepseek import DeepseekLayer, MLAttention, convert_deepseek_layer
from draftgraph.models.rope import apply_rope
from draftgraph.ops.attention.metadata import AttentionMetadata
from draftgraph.ops.choices import DEFAULT_OPS, OpChoices
from draftgraph.ops.collectives.op import SINGLE, ParallelGroup


class Indexer(nn.Module):
    """The lightning indexer's projections; the scoring and top-k run in the `indexer_topk` op."""

    keep_fp32_params = ("weights_proj.weight",)  # transformers keeps indexer.weights_proj in float32

    def __init__(self, cfg: ModelConfig, attn_impl: str):
        super().__init__()
        i = cfg.indexer
        self.i = i
        self.wq_b = nn.Linear(cfg.mla.q_lora_rank, i.num_heads * i.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, i.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(i.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, i.num_heads, bias=False)
        self.attn_impl = attn_impl

    def forward(self, x, q_resid, cos, sin, meta: AttentionMetadata, index_cache: torch.Tensor) -> torch.Tensor:
        i, t = self.i, x.shape[0]
        q = self.wq_b(q_resid).view(t, i.num_heads, i.head_dim)  # [T, Hi, Di]
        k = self.k_norm(self.wk(x))  # [T, Di]
        q_rot, q_pass = q.split([i.rope_dim, i.head_dim - i.rope_dim], dim=-1)
        k_rot, k_pass = k.split([i.rope_dim, i.head_dim - i.rope_dim], dim=-1)
        q = torch.cat([apply_rope(q_rot, cos, sin), q_pass], dim=-1)
        k = torch.cat([apply_rope(k_rot.view(t, 1, i.rope_dim), cos, sin).view(t, i.rope_dim), k_pass], dim=-1)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * i.num_heads**-0.5  # [T, Hi] fp32
        return torch.ops.draftgraph.indexer_topk(
            q.contiguous(),
            k.contiguous(),
            w,
            index_cache,
            meta.slot_mapping,
            meta.block_tables,
            meta.token_req,
            meta.token_kv_len,
            i.head_dim**-0.5,
            i.topk,
            self.attn_impl,
        )  # [T, topk] int32


class SparseMLAttention(MLAttention):
    """V3's MLA projections (same weights, same names) plus the indexer; attention over its picks only."""

    def __init__(self, cfg: ModelConfig, attn_impl: str, tp: ParallelGroup = SINGLE, ops: OpChoices = DEFAULT_OPS):
        super().__init__(cfg, attn_impl, tp, ops)
        self.indexer = Indexer(cfg, attn_impl)  # replicated under tensor parallelism

    def forward(self, x, cos, sin, meta: AttentionMetadata, kv: tuple[torch.Tensor, ...]):
        a, t, h = self.a, x.shape[0], self.num_heads
        q_nope, q_pe, c, k_pe, q_resid = self.project(x, cos, sin)
        topk = self.indexer(x, q_resid, cos, sin, meta, kv[2])
        out = torch.ops.draftgraph.sparse_mla_attention(
            q_nope,
            q_pe.contiguous(),
            c.contiguous(),
            k_pe.contiguous(),
            kv[0],
            kv[1],
            self.kv_b.weight,
            topk,
            meta.slot_mapping,
            meta.block_tables,
            meta.token_req,
            meta.token_kv_len,
            a.softmax_scale,
            self.attn_impl,
        )  # [T, H, dv]
        return self.o(out.reshape(t, h * a.v_head_dim))


def make_v32_layer(
    cfg: ModelConfig, layer: int, attn_impl: str, tp: ParallelGroup = SINGLE, ops: OpChoices = DEFAULT_OPS
) -> DeepseekLayer:
    """A V3.2 layer: sparse MLA, then a MoE or a dense MLP as cfg.is_moe_layer(layer) says."""
    return DeepseekLayer(cfg, layer, attn_impl, attention=SparseMLAttention, tp=tp, ops=ops)


_INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


def convert_deepseek_v32_layer(state: dict[str, torch.Tensor], src: str, dst: str) -> dict[str, torch.Tensor]:
    """One transformers DeepSeek-V3.2 layer at prefix `src` -> ours at `dst` (pops from state): V3's names
    plus the indexer's (`self_attn.indexer.*` -> `attn.indexer.*`)."""
    out = convert_deepseek_layer(state, src, dst)
    for name in _INDEXER:
        if f"{src}self_attn.indexer.{name}" in state:
            out[f"{dst}attn.indexer.{name}"] = state.pop(f"{src}self_attn.indexer.{name}")
    return out
