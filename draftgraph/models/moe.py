"""DeepSeek-V3 mixture of experts: grouped top-k routing, routed experts, shared experts.

Everything has a shape fixed by the token count: routing is top-k over fixed-size score tensors, and the
experts run as one custom op, `torch.ops.draftgraph.moe_experts`, whose implementations never read a count
back to the host. So the layer can sit inside compiled pieces and FULL CUDA graphs.
- reference: every expert over every token, weighted by the routing (zero for unchosen experts): plain
  tensor code, E times the work, for checking and the CPU.
- triton: the (token, expert) pairs are sorted by expert into blocks padded to the tile height (on the
  device; the grid is sized for the worst case and surplus tiles exit at once), then one grouped matmul
  per projection reads only the chosen experts' weights (ops/moe/triton_moe.py).
Under tensor parallelism (`tp`, models/parallel/mla.py) every expert and the shared experts hold this rank's
slice of their intermediate dimension; the router is whole; routed + shared partials, one all_reduce.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import draftgraph.ops.moe.op  # noqa: F401  (registers draftgraph::moe_experts)
from draftgraph.models.config import ModelConfig
from draftgraph.models.layers import MLP
from draftgraph.ops.choices import DEFAULT_OPS, OpChoices
from draftgraph.ops.collectives.op import SINGLE, ParallelGroup


def route(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int, norm: bool, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing from router logits [T, E] (float32): sigmoid scores; the bias-corrected scores
    pick topk_group groups (each scored by its best two experts), then top_k experts inside them; the
    weights are the uncorrected scores of those experts, normalized when asked, times the scaling factor.
    Returns (weights [T, k] float32, ids [T, k] int64)."""
    scores = logits.sigmoid()
    choice = scores + bias
    t, e = choice.shape
    groups = choice.view(t, n_group, e // n_group)
    group_scores = groups.topk(min(2, e // n_group), dim=-1)[0].sum(dim=-1)  # [T, n_group]
    group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0)
    expert_mask = group_mask[:, :, None].expand(t, n_group, e // n_group).reshape(t, e)
    choice = choice.masked_fill(expert_mask == 0, float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def route_tokens(x, gate, e_score_correction_bias, m) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids) [T, k] of tokens x [T, H] by DeepSeek-V3's router (float32 logits, `route`)."""
    logits = F.linear(x.float(), gate.float())
    return route(
        logits, e_score_correction_bias, m.top_k, m.n_group, m.topk_group, m.norm_topk_prob, m.routed_scaling_factor
    )


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, attn_impl: str, tp: ParallelGroup = SINGLE, ops: OpChoices = DEFAULT_OPS):
        super().__init__()
        assert tp.is_single or not cfg.mlp_bias, "a split MoE sums partial outputs: no biases to add twice"
        m = cfg.moe
        self.m = m
        self.gate = nn.Parameter(torch.empty(m.num_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(m.num_experts, dtype=torch.float32))
        self.gate_up = nn.Parameter(torch.empty(m.num_experts, 2 * m.moe_intermediate_size, cfg.hidden_size))
        self.down = nn.Parameter(torch.empty(m.num_experts, cfg.hidden_size, m.moe_intermediate_size))
        shared = m.moe_intermediate_size * m.n_shared_experts
        self.shared = MLP(cfg, shared, ops=ops) if shared else None  # this rank's slice, summed with the routed partial
        self.tp = tp
        self.attn_impl = attn_impl  # the kernels' implementation: "triton", else the reference (as attention's)

    def forward(self, x):
        weights, ids = route_tokens(x, self.gate, self.e_score_correction_bias, self.m)
        out = torch.ops.draftgraph.moe_experts(x, self.gate_up, self.down, ids, weights, self.attn_impl)
        out = out + self.shared(x) if self.shared is not None else out
        return self.tp.all_reduce(out)  # partial sums over the intermediate slices (x itself for one process)
