"""Expert parallelism for the MoE families (DeepSeek-V3's `MoE`, Qwen3.5-MoE's `QwenMoE`): each of W ranks
holds E/W whole experts.

Rank r holds experts [r*E/W, (r+1)*E/W); the router (DeepSeek: grouped sigmoid top-k with its correction
bias; Qwen: softmax top-k renormalised) and the shared experts (Qwen: with their sigmoid gate) are
replicated. Dispatch and combine have shapes fixed by the token count T, which every rank has equal (the
lock-step, runtime/lockstep.py, pads each step's batch to one agreed shape), so the layer sits in compiled
pieces and CUDA graphs:

  x [T, H] --all_gather_rows--> x_all [W*T, H] (every rank's tokens)
  route(x_all) with the replicated router (the family's rule) -> ids, weights [W*T, k] (global expert ids)
  pairs on other ranks' experts get weight 0 (and local id 0); moe_experts over the local experts
      -> partial [W*T, H] (only this rank's experts' contributions)
  --reduce_scatter_rows--> [T, H] (every rank's contributions to this rank's tokens, summed) + shared(x)

Cost per layer and rank: the gather receives (W-1)*T*H values and the reduce-scatter sends as many; routing
runs on W*T rows; the experts run on all W*T gathered tokens. With the reference implementation that is
(E/W) * W*T = E*T expert rows, as without EP; with the Triton grouped matmul the masked pairs still run (on
local expert 0, weight 0), so W*T*k pairs instead of the ~T*k a rank would own. An all-to-all version would
send each (token, expert) pair only to the rank owning the expert: ~k*T*H values per rank each way and ~T*k
pairs of work, but the per-peer counts vary by step, so it needs either a host read of the counts (no CUDA
graph) or fixed worst-case buffers per peer (capacity T*k rows, DeepEP's low-latency layout) and an
all_to_all_single op with those fixed splits; routing would then run once per token, at its source.
"""

from __future__ import annotations

import torch
from torch import nn

import draftgraph.ops.collectives.rows  # noqa: F401  (registers all_gather_rows / reduce_scatter_rows)
import draftgraph.ops.moe.op  # noqa: F401  (registers draftgraph::moe_experts)
from draftgraph.models.moe import MoE, route_tokens
from draftgraph.models.qwen3_5 import QwenMoE, qwen_route
from draftgraph.ops.collectives.op import ParallelGroup


def check_expert_parallel(num_experts: int, ep: ParallelGroup, model_type: str) -> None:
    if num_experts % ep.world_size:
        fits = [w for w in range(1, num_experts + 1) if num_experts % w == 0]
        raise ValueError(
            f"expert parallelism over {ep.world_size} ranks needs whole experts per rank, but {model_type} has "
            f"{num_experts} routed experts; use a data_parallel_size that divides {num_experts} (one of {fits})"
        )


class ExpertParallelMoE(nn.Module):
    """A MoE layer (DeepSeek's `MoE` or Qwen3.5's `QwenMoE`) of which this rank holds experts
    [rank*E/W, (rank+1)*E/W); see the module docstring."""

    def __init__(self, moe: MoE | QwenMoE, ep: ParallelGroup):
        super().__init__()
        self.qwen = isinstance(moe, QwenMoE)
        num_experts = moe.gate_up.shape[0]
        check_expert_parallel(num_experts, ep, "this model")
        self.ep, self.attn_impl, self.num_experts = ep, moe.attn_impl, num_experts
        self.num_local = num_experts // ep.world_size
        self.first = ep.rank * self.num_local
        self.gate = moe.gate  # the router: replicated
        if self.qwen:
            self.top_k, self.shared_gate = moe.top_k, moe.shared_gate
        else:
            self.m = moe.m
            self.register_buffer("e_score_correction_bias", moe.e_score_correction_bias)
        local = slice(self.first, self.first + self.num_local)
        self.gate_up = nn.Parameter(moe.gate_up.data[local].clone(), requires_grad=False)  # [E/W, 2I, H]
        self.down = nn.Parameter(moe.down.data[local].clone(), requires_grad=False)  # [E/W, H, I]
        self.shared = moe.shared

    def _route(self, x_all):
        """(weights, global expert ids) [W*T, k], by the family's rule, as its whole layer routes."""
        if self.qwen:
            return qwen_route(x_all, self.gate, self.top_k)
        return route_tokens(x_all, self.gate, self.e_score_correction_bias, self.m)

    def forward(self, x):  # x [T, H]: T equal on every rank
        group = self.ep.group_name
        x_all = torch.ops.draftgraph.all_gather_rows(x, group)  # [W*T, H]
        weights, ids = self._route(x_all)
        local = ids - self.first
        mine = (local >= 0) & (local < self.num_local)
        ids_local = torch.where(mine, local, torch.zeros_like(local))
        weights_local = torch.where(mine, weights, torch.zeros_like(weights))
        partial = torch.ops.draftgraph.moe_experts(x_all, self.gate_up, self.down, ids_local, weights_local,
                                                   self.attn_impl)  # fmt: skip
        out = torch.ops.draftgraph.reduce_scatter_rows(partial, group)  # [T, H]
        if self.shared is None:
            return out
        shared = self.shared(x)
        return out + (torch.sigmoid(self.shared_gate(x)) * shared if self.qwen else shared)


def shard_experts(model: nn.Module, ep: ParallelGroup) -> str:
    """Replace every MoE layer of `model` by this rank's ExpertParallelMoE share (the full experts are dropped);
    returns what this rank holds, in words. Refuses a model with no DeepSeek-style MoE layer, naming it."""
    if ep.is_single:
        return ""
    found = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, (MoE, QwenMoE))]
    if not found:
        cfg = getattr(model, "cfg", None)
        kind = getattr(cfg, "model_type", type(model).__name__)
        raise ValueError(
            f"expert_parallel=True, but the target ({kind}) has no MoE layer to split (DeepSeek-V3 or Qwen3.5-MoE); "
            "turn expert_parallel off (the replicas then each hold the whole model)"
        )
    for name, moe in found:
        parent_name, _, attr = name.rpartition(".")
        split = ExpertParallelMoE(moe, ep)
        setattr(model.get_submodule(parent_name), attr, split)
    first, n, total = split.first, split.num_local, split.num_experts
    return (
        f"expert parallel: experts {first}-{first + n - 1} of {total} in each of {len(found)} MoE layers on rank "
        f"{ep.rank} of {ep.world_size}"
    )
