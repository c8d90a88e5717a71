"""Tensor parallelism for DeepSeek-V3 / V3.2: MLA heads and every expert's intermediate dimension split over ranks.

With a `ParallelGroup` of world size W, rank r holds:
- MLA: query heads [r*H/W, (r+1)*H/W). q_b (or q_proj without q LoRA) and kv_b are column-parallel by heads
  (their output rows are head-major), o_proj row-parallel (`all_reduce`, its bias once). q_a / kv_a and their
  norms are replicated: every rank computes the whole latent c [r] and RoPE key k_pe [dr] of each token and
  keeps the WHOLE latent cache. The latent is shared by all heads (each head reads it through its own rows of
  kv_b), so it cannot be cut by heads: every rank holds the same copy, and unlike GQA's KV heads the cache's
  bytes per rank do not shrink with TP (what vLLM and SGLang do for MLA under TP too).
- MoE: rows [r*I/W, (r+1)*I/W) of gate and up and the matching columns of down, of EVERY routed expert and of
  the shared experts; the router (gate weight, score-correction bias) is replicated, so every rank picks the
  same experts with the same weights. Routed and shared partial outputs are summed, then one `all_reduce` per
  MoE layer. (Whole experts per rank are expert parallelism, another module's business.)
- the dense MLP of the first layers, the embedding and the LM head: as the Llama family's (parallel.py).
- DeepSeek-V3.2's lightning indexer: replicated (its wq_b / wk / weights_proj whole on every rank, names no
  rule cuts), so every rank scores the same keys and picks the same positions, and keeps the whole index-key
  cache beside the whole latent. Its heads are summed inside the top-k op, so splitting them would need the
  scores all-reduced before the selection: not done.

`scale_mla_config` divides num_heads, num_kv_heads, intermediate_size and moe_intermediate_size by W;
`deepseek_cut` says how a rank cuts the transformers-named tensors the Llama rules do not cover (q_b / kv_b,
experts in the hub's per-expert layout or transformers' fused one, shared experts): models/parallel/shard_cut.py
applies it to a whole tensor or reads only that share from safetensors.
"""

from __future__ import annotations

import dataclasses
import re

from draftgraph.models.config import ModelConfig
from draftgraph.models.parallel.shard_cut import Cut, split_cut

_EXPERT = re.compile(r"mlp\.(experts\.\d+|shared_experts)\.(gate_proj|up_proj|down_proj)\.weight$")
_HEAD_ROWS = ("self_attn.q_b_proj.weight", "self_attn.kv_b_proj.weight")


def mla_sizes(cfg: ModelConfig) -> tuple[tuple[str, int], ...]:
    """The sizes a DeepSeek-V3 tensor-parallel size must divide."""
    return (
        ("num_attention_heads", cfg.num_heads),
        ("num_key_value_heads", cfg.num_kv_heads),  # no KV heads under MLA: kept consistent with the heads
        ("intermediate_size", cfg.intermediate_size),
        ("moe_intermediate_size", cfg.moe.moe_intermediate_size),
        ("vocab_size", cfg.vocab_size),
    )


def scale_mla_config(cfg: ModelConfig, w: int, up: bool) -> ModelConfig:
    """Heads, intermediate sizes (dense and per expert) divided by `w` (one rank's share) or multiplied back."""

    def f(n: int) -> int:
        return n * w if up else n // w

    moe = dataclasses.replace(cfg.moe, moe_intermediate_size=f(cfg.moe.moe_intermediate_size))
    return cfg.replace(
        num_heads=f(cfg.num_heads),
        num_kv_heads=f(cfg.num_kv_heads),
        intermediate_size=f(cfg.intermediate_size),
        moe=moe,
        tp_size=1 if up else w,
    )


def deepseek_cut(name: str, shape: tuple[int, ...], rank: int, w: int) -> Cut | None:
    """How rank `rank` of `w` cuts a DeepSeek-V3-only tensor name (None for names the Llama rules cover)."""
    if name.endswith(_HEAD_ROWS):  # [H * (per-head width), in]: whole heads
        return split_cut(name, shape, 0, rank, w)
    if name.endswith("mlp.experts.gate_up_proj"):  # fused [E, 2I, H]: this rank's gate rows, then its up rows
        gate = -(-shape[1] // 2)  # torch.chunk's first part
        return split_cut(name, shape, 1, rank, w, parts=(gate, shape[1] - gate))
    if name.endswith("mlp.experts.down_proj"):  # fused [E, H, I]
        return split_cut(name, shape, 2, rank, w)
    m = _EXPERT.search(name)
    if m is not None:  # per-expert or shared-expert gate / up rows, down columns
        return split_cut(name, shape, 1 if m.group(2) == "down_proj" else 0, rank, w)
    return None
