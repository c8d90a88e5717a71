"""Expert parallelism for the MoE families (DeepSeek-V3's `MoE`, Qwen3.5-MoE's `QwenMoE`): the EP group is all
EP = tp x dp ranks (as in vLLM and SGLang), and each holds E/EP whole experts.

Rank r (global rank: tensor-parallel rank t = r % W of data-parallel replica d = r // W, W = tp, D = dp; the
groups are `ExpertGroups`, made by workers/worker.py) holds experts [r*E/EP, (r+1)*E/EP). The router (DeepSeek:
grouped sigmoid top-k with its correction bias; Qwen: softmax top-k renormalised) is replicated. The shared
experts (Qwen: with their sigmoid gate) stay as the target was loaded: whole with tp = 1, else this rank's
intermediate slice (models/parallel/mla.py, parallel/hybrid.py), a partial summed by the TP all-reduce. The W
ranks of a replica hold the same tokens x [T, H]; replicas hold different ones, but the same T (the lock-step,
runtime/lockstep.py, pads every replica's step to one agreed shape), so every shape is fixed by T and the
layer sits in compiled pieces and CUDA graphs (no host read of any count):

  x [T, H] --all_gather_rows over `replicas` (the D ranks of tp rank t)--> x_all [D*T, H] (D = 1: x itself)
  route(x_all) with the replicated router -> ids, weights [D*T, k] (global expert ids)
  pairs on other ranks' experts get weight 0 (and local id 0); moe_experts over the local experts
      -> partial [D*T, H] (this rank's experts' contributions to every replica's tokens)
  --reduce_scatter_rows over `replicas`--> [T, H] (this replica's tokens: the experts of the D ranks of tp rank t)
  + shared(x) (a TP slice's partial) --all_reduce over `tp`--> [T, H] (every expert, the whole shared experts)

dp = 1, tp = W: no gather or scatter; every TP rank runs its E/W whole experts on all T tokens and one all-reduce
sums them: the collective the TP MoE (every expert's intermediate dim sliced) pays already. tp = 1, dp = D:
no all-reduce. Cost per layer and rank: the gather receives (D-1)*T*H values and the reduce-scatter sends as
many; the all-reduce moves T*H as under plain TP; routing runs on D*T rows; the experts run on D*T tokens.
With the reference implementation that is (E/EP) * D*T = E*T/W full-width expert rows, the TP MoE's work
(E*T rows of width I/W). With the Triton grouped matmul the masked pairs still run (on local expert 0, weight
0): D*T*k full-width pairs where the TP MoE runs T*k pairs of width I/W, i.e. EP times the useful work; a
kernel that skips foreign pairs (an id past the local experts) would leave ~T*k/W. An all-to-all version
would send each (token, expert) pair only to the rank owning the expert: ~k*T*H values per rank each way, but
the per-peer counts vary by step, so it needs either a host read of the counts (no CUDA graph) or fixed
worst-case buffers per peer (capacity T*k rows, DeepEP's low-latency layout) and an all_to_all_single op with
those fixed splits; routing would then run once per token, at its source.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

import draftgraph.ops.collectives.rows  # noqa: F401  (registers all_gather_rows / reduce_scatter_rows)
import draftgraph.ops.moe.op  # noqa: F401  (registers draftgraph::moe_experts)
from draftgraph.models.config import ModelConfig
from draftgraph.models.families import family_of
from draftgraph.models.moe import MoE, route_tokens
from draftgraph.models.qwen3_5 import QwenMoE, qwen_route
from draftgraph.ops.collectives.op import ExpertGroups


def check_expert_parallel(num_experts: int, ep: ExpertGroups, model_type: str) -> None:
    """Refuse an EP size that does not divide the routed experts, naming both and the sizes that work."""
    if num_experts % ep.size:
        fits = [w for w in range(1, num_experts + 1) if num_experts % w == 0]
        tp, dp = ep.tp.world_size, ep.replicas.world_size
        raise ValueError(
            f"expert parallelism over {ep.size} ranks (tensor_parallel_size={tp} x data_parallel_size={dp}) needs "
            f"whole experts per rank, but {model_type} has {num_experts} routed experts; use tp x dp dividing "
            f"{num_experts} (one of {fits})"
        )


def check_expert_config(cfg: ModelConfig | None, ep: ExpertGroups) -> None:
    """Before any weight loads: the target has routed experts, and the EP size divides them (None: a source
    whose config is unknown here, checked when its layers are split)."""
    if cfg is None:
        return
    moe = family_of(cfg).experts(cfg)
    if moe is None:
        _no_moe(cfg.model_type)
    check_expert_parallel(moe.num_experts, ep, cfg.model_type)


def _no_moe(kind: str):
    raise ValueError(
        f"expert_parallel=True, but the target ({kind}) has no MoE layer to split (DeepSeek-V3 or Qwen3.5-MoE); "
        "turn expert_parallel off (tensor / data parallelism of a dense model works)"
    )


class ExpertParallelMoE(nn.Module):
    """A MoE layer (DeepSeek's `MoE` or Qwen3.5's `QwenMoE`) of which this rank holds experts
    [rank*E/EP, (rank+1)*E/EP) whole; see the module docstring. `experts` gives them (gate_up, down); None: cut
    from `moe` itself, which then holds every expert whole (loaded without tensor parallelism)."""

    def __init__(self, moe: MoE | QwenMoE, ep: ExpertGroups, experts: tuple[torch.Tensor, torch.Tensor] | None = None):
        super().__init__()
        self.qwen = isinstance(moe, QwenMoE)
        num_experts = moe.gate.shape[0]  # the router's rows
        check_expert_parallel(num_experts, ep, "this model")
        self.replicas, self.tp, self.attn_impl, self.num_experts = ep.replicas, ep.tp, moe.attn_impl, num_experts
        self.num_local = num_experts // ep.size
        self.first = ep.rank * self.num_local
        self.gate = moe.gate  # the router: replicated
        if self.qwen:
            self.top_k, self.shared_gate = moe.top_k, moe.shared_gate
        else:
            self.m = moe.m
            self.register_buffer("e_score_correction_bias", moe.e_score_correction_bias)
        if experts is None:
            assert ep.tp.is_single, "a tensor-parallel MoE holds expert slices: pass the whole local experts"
            local = slice(self.first, self.first + self.num_local)
            experts = (moe.gate_up.data[local].clone(), moe.down.data[local].clone())
        gate_up, down = (t.to(device=moe.gate_up.device, dtype=moe.gate_up.dtype) for t in experts)
        assert gate_up.shape[0] == down.shape[0] == self.num_local, (gate_up.shape, down.shape, self.num_local)
        self.gate_up = nn.Parameter(gate_up, requires_grad=False)  # [E/EP, 2I, H]
        self.down = nn.Parameter(down, requires_grad=False)  # [E/EP, H, I]
        self.shared = moe.shared  # whole (tp = 1) or this rank's TP slice

    def _route(self, x_all):
        """(weights, global expert ids) [D*T, k], by the family's rule, as its whole layer routes."""
        if self.qwen:
            return qwen_route(x_all, self.gate, self.top_k)
        return route_tokens(x_all, self.gate, self.e_score_correction_bias, self.m)

    def forward(self, x):  # x [T, H]: the same on a replica's TP ranks, T equal on every rank
        group = self.replicas.group_name
        x_all = x if self.replicas.is_single else torch.ops.draftgraph.all_gather_rows(x, group)  # [D*T, H]
        weights, ids = self._route(x_all)
        local = ids - self.first
        mine = (local >= 0) & (local < self.num_local)
        ids_local = torch.where(mine, local, torch.zeros_like(local))
        weights_local = torch.where(mine, weights, torch.zeros_like(weights))
        out = torch.ops.draftgraph.moe_experts(x_all, self.gate_up, self.down, ids_local, weights_local,
                                               self.attn_impl)  # fmt: skip
        if not self.replicas.is_single:
            out = torch.ops.draftgraph.reduce_scatter_rows(out, group)  # [T, H]
        if self.shared is not None:
            shared = self.shared(x)
            out = out + (torch.sigmoid(self.shared_gate(x)) * shared if self.qwen else shared)
        return self.tp.all_reduce(out)  # the other TP ranks' experts and shared slices (out itself for tp = 1)


def shard_experts(model: nn.Module, ep: ExpertGroups, source: Any = None) -> str:
    """Replace every MoE layer of `model` by this rank's ExpertParallelMoE share; returns what this rank holds,
    in words. With tensor parallelism (`ep.tp`) `model` is a TP share, so the whole local experts are read from
    `source` (the target's checkpoint directory or transformers object: models/parallel/expert_weights.py) and the
    loaded slices dropped (the TP load still reads them first: transient, a TP share's worth of experts).
    Refuses a model with no MoE layer, naming it."""
    found = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, (MoE, QwenMoE))]
    if not found:
        cfg = getattr(model, "cfg", None)
        _no_moe(getattr(cfg, "model_type", type(model).__name__))
    num_experts = found[0][1].gate.shape[0]
    check_expert_parallel(num_experts, ep, getattr(getattr(model, "cfg", None), "model_type", "this model"))
    n = num_experts // ep.size
    first = ep.rank * n
    whole = None
    if not ep.tp.is_single:
        from draftgraph.models.parallel.expert_weights import local_experts

        layer_of = {name: int(m.group(1)) for name, _ in found if (m := re.search(r"layers\.(\d+)\.mlp$", name))}
        assert len(layer_of) == len(found), [name for name, _ in found]
        whole = local_experts(source, set(layer_of.values()), first, n)
    for name, moe in found:
        parent_name, _, attr = name.rpartition(".")
        split = ExpertParallelMoE(moe, ep, None if whole is None else whole[layer_of[name]])
        setattr(model.get_submodule(parent_name), attr, split)
    return (
        f"expert parallel: experts {first}-{first + n - 1} of {num_experts} in each of {len(found)} MoE layers on "
        f"rank {ep.rank} of {ep.size} (tp {ep.tp.world_size} x dp {ep.replicas.world_size})"
    )
