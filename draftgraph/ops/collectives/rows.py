"""Expert-parallel collectives as custom ops: `torch.ops.draftgraph.all_gather_rows` and `reduce_scatter_rows`.

all_gather_rows(x, group_name): the ranks' x [T, ...] stacked along dim 0 in rank order -> [W*T, ...]
(every rank must pass the same T: the lock-step, runtime/lockstep.py, pads each step's batch to one shape).
reduce_scatter_rows(x, group_name): x [W*T, ...] summed over the ranks, rank r keeping rows [r*T, (r+1)*T).

Like ops/collectives/op.py's pair they are functional, allocate only by shape, never read anything back to the
host and run on the current stream's device (NCCL inside CUDA graphs, gloo on the CPU), so each sits inside a
compiled piece as one opaque node; the group is found by its registered name. The empty name means one
process: a copy. Registering the two ops is this module's one import-time action.
"""

from __future__ import annotations

import torch

from draftgraph.ops.collectives.op import get_group, group_size
from draftgraph.ops.registry import custom_op


@custom_op("draftgraph::all_gather_rows", mutates_args=())
def all_gather_rows(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """[T, ...] on each rank -> [W*T, ...]: rank r's rows at [r*T, (r+1)*T)."""
    if not group_name:
        return x.contiguous().clone()
    import torch.distributed as dist

    group = get_group(group_name)
    src = x.contiguous()
    out = torch.empty((group.size() * src.shape[0], *src.shape[1:]), dtype=src.dtype, device=src.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.13 renamed it
    gather(out, src, group=group)
    return out


@all_gather_rows.register_fake
def _(x, group_name):
    return x.new_empty((x.shape[0] * group_size(group_name), *x.shape[1:]))


@custom_op("draftgraph::reduce_scatter_rows", mutates_args=())
def reduce_scatter_rows(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """[W*T, ...] on each rank -> the sum over ranks of rows [r*T, (r+1)*T) on rank r."""
    if not group_name:
        return x.contiguous().clone()
    import torch.distributed as dist

    group = get_group(group_name)
    ws = group.size()
    src = x.contiguous()
    out = torch.empty((src.shape[0] // ws, *src.shape[1:]), dtype=src.dtype, device=src.device)
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # renamed in torch 2.13
    scatter(out, src, group=group)
    return out


@reduce_scatter_rows.register_fake
def _(x, group_name):
    return x.new_empty((x.shape[0] // group_size(group_name), *x.shape[1:]))
