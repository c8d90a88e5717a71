"""The routed-experts custom op: `torch.ops.draftgraph.moe_experts`, and its reference.

Shapes are fixed by the token count and no implementation reads a count back to the host, so the op sits
inside compiled pieces and FULL CUDA graphs. reference: every expert over every token, weighted by the
routing (zero for unchosen experts): E times the work, for checking and the CPU. triton: only the chosen
experts' weights are read (triton_moe.py). Registering the op is this module's one import-time action.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from draftgraph.ops.backends import check_device
from draftgraph.ops.registry import custom_op


@custom_op("draftgraph::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, impl: str
) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H]; down [E, H, I]; ids [T, k] int64; weights [T, k] float32 -> [T, H]."""
    check_device(impl, x.device.type)
    if impl == "triton":
        from draftgraph.ops.moe.triton_moe import moe_experts_triton

        return moe_experts_triton(x, gate_up, down, ids, weights)
    return moe_experts_reference(x, gate_up, down, ids, weights)


@moe_experts.register_fake
def _(x, gate_up, down, ids, weights, impl):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def moe_experts_reference(x, gate_up, down, ids, weights) -> torch.Tensor:
    num_experts, inter = gate_up.shape[0], down.shape[2]
    combine = torch.zeros(x.shape[0], num_experts, dtype=torch.float32, device=x.device)
    combine.scatter_add_(1, ids, weights.float())  # [T, E]: each token's weight per expert, 0 if unchosen
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(num_experts):
        gate, up = F.linear(x, gate_up[e]).split([inter, inter], dim=-1)
        y = F.linear(F.silu(gate) * up, down[e])
        out += combine[:, e : e + 1] * y.float()
    return out.to(x.dtype)
