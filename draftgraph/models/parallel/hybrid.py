"""Tensor parallelism for Qwen3.5 hybrids: Gated DeltaNet heads, gated attention heads and experts over ranks.

With a `ParallelGroup` of world size W, rank r holds:
- Gated DeltaNet: k heads [r*HK/W, (r+1)*HK/W) and v heads [r*HV/W, (r+1)*HV/W) (whole groups: v head j reads
  k head j // (HV/HK), so a rank's v heads read only its own k heads). in_proj_qkv and the conv weight are cut
  per part (q, k by k heads, v by v heads), in_proj_z / b / a, A_log and dt_bias by v heads; the gated
  RMSNorm is per head (whole), out_proj row-parallel. The state rings (conv and recurrent states) then hold
  the local heads only: they shrink with TP, like GQA's KV cache.
- gated attention: q heads (each head's [q | gate] rows together) and KV heads as the Llama family's, q/k
  norms per head (whole), o_proj row-parallel.
- the MoE: every routed expert's and the shared expert's intermediate slice; the router and the shared
  expert's sigmoid gate replicated (the gate scales this rank's partial, so the sum is the gated whole);
  one all_reduce per layer. A dense MLP as the Llama family's.

`scale_hybrid_config` divides heads and intermediate sizes by W (or multiplies them back); `hybrid_cut` says
how a rank cuts the transformers-named tensors only Qwen3.5 has (models/parallel/shard_cut.py: in memory or read).
"""

from __future__ import annotations

import dataclasses

from draftgraph.models.config import ModelConfig
from draftgraph.models.hybrid_config import LinearAttentionConfig
from draftgraph.models.parallel.shard_cut import Cut, split_cut


def hybrid_sizes(cfg: ModelConfig) -> tuple[tuple[str, int], ...]:
    """The sizes a Qwen3.5 tensor-parallel size must divide."""
    la, moe = cfg.hybrid.linear, cfg.hybrid.moe
    sizes = (
        ("num_attention_heads", cfg.num_heads),
        ("num_key_value_heads", cfg.num_kv_heads),
        ("intermediate_size", cfg.intermediate_size),
        ("vocab_size", cfg.vocab_size),
        ("linear_num_key_heads", la.num_k_heads),
        ("linear_num_value_heads", la.num_v_heads),
    )
    if moe is not None:
        sizes += (
            ("moe_intermediate_size", moe.moe_intermediate_size),
            ("shared_expert_intermediate_size", moe.shared_expert_intermediate_size),
        )
    return sizes


def scale_hybrid_config(cfg: ModelConfig, w: int, up: bool) -> ModelConfig:
    """Heads (attention and linear attention) and intermediate sizes divided by `w`, or multiplied back."""

    def f(n: int) -> int:
        return n * w if up else n // w

    la = cfg.hybrid.linear
    linear = dataclasses.replace(la, num_k_heads=f(la.num_k_heads), num_v_heads=f(la.num_v_heads))
    moe = cfg.hybrid.moe
    if moe is not None:
        moe = dataclasses.replace(
            moe,
            moe_intermediate_size=f(moe.moe_intermediate_size),
            shared_expert_intermediate_size=f(moe.shared_expert_intermediate_size),
        )
    return cfg.replace(
        num_heads=f(cfg.num_heads),
        num_kv_heads=f(cfg.num_kv_heads),
        intermediate_size=f(cfg.intermediate_size),
        hybrid=dataclasses.replace(cfg.hybrid, linear=linear, moe=moe),
        tp_size=1 if up else w,
    )


_V_HEAD_ROWS = ("linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight",
                "linear_attn.A_log", "linear_attn.dt_bias")  # fmt: skip
_SHARED = ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight")


def hybrid_cut(name: str, shape: tuple[int, ...], rank: int, w: int, la: LinearAttentionConfig) -> Cut | None:
    """How rank `rank` of `w` cuts a Qwen3.5-only tensor name (None for names other rules cover). `la` is the
    whole model's linear-attention shape (the part sizes of the fused qkv rows)."""
    if name.endswith(("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight")):  # [q | k | v] rows
        return split_cut(name, shape, 0, rank, w, parts=(la.key_dim, la.key_dim, la.value_dim))
    if name.endswith(_V_HEAD_ROWS) or name.endswith(_SHARED):
        return split_cut(name, shape, 0, rank, w)
    if name.endswith(("linear_attn.out_proj.weight", "mlp.shared_expert.down_proj.weight")):
        return split_cut(name, shape, 1, rank, w)
    return None
