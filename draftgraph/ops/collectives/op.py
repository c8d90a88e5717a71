"""Tensor-parallel collectives as custom ops: `torch.ops.draftgraph.all_reduce` and `all_gather_last`.

A `ParallelGroup` says which rank of how many this process is and names the torch.distributed process group
it talks over; whoever initialises torch.distributed registers that group here (`register_group`), and the
ops look it up by name, so compiled graphs carry a string, never a process-group object.

all_reduce(x, group_name) -> sum of x over the group's ranks (a new tensor: the op is functional).
all_gather_last(x, group_name) -> the ranks' x concatenated along the last dim in rank order (vocab-parallel
logits: [N, V/tp] on each rank -> [N, V] on every rank).

Both run the collective on a fresh copy of the input on the current stream's device, never read anything
back to the host and allocate only by shape, so they sit inside torch.compile'd code as one opaque node
(they are not splitting ops: a piece keeps them) and inside CUDA graphs with NCCL (c10d enqueues NCCL
collectives on a side stream joined to the capturing stream by events; no host wait without
TORCH_NCCL_BLOCKING_WAIT). On CUDA, a group set up for peer memory (peer.py) sums the small messages its
measured rule takes over peer memory instead (our lamport / push kernels, torch's one-shot / two-shot), NCCL the
rest. Gloo runs
them on the CPU for the tests. The empty group name means one process: the ops return a copy and touch no
torch.distributed. Registering the two ops is this module's one import-time action.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from draftgraph.ops.collectives.peer import peer_for
from draftgraph.ops.registry import custom_op

_GROUPS: dict[str, Any] = {}
# group name -> size: what the ops' fakes need to shape their outputs, also where no process group exists (a
# compile worker compiling a piece for the engine's process: compiler/pool/ sends these with each job).
_SIZES: dict[str, int] = {}


def register_group(name: str, group: Any) -> None:
    """Make torch.distributed process group `group` reachable by the ops as `name` (not the empty name)."""
    if not name:
        raise ValueError('group name "" means no parallelism; register the process group under a non-empty name')
    _GROUPS[name] = group
    _SIZES[name] = group.size()


def unregister_group(name: str) -> None:
    _GROUPS.pop(name, None)
    _SIZES.pop(name, None)


def group_sizes() -> dict[str, int]:
    """Every registered group's size by name (for compile workers: `register_group_sizes`)."""
    return dict(_SIZES)


def register_group_sizes(sizes: dict[str, int]) -> None:
    """Group sizes without their process groups, so the ops' fakes can shape outputs in a process that runs no
    collective (a compile worker); calling an op there still needs the group."""
    _SIZES.update(sizes)


def get_group(name: str) -> Any:
    """The process group registered as `name`."""
    try:
        return _GROUPS[name]
    except KeyError:
        raise KeyError(
            f"no process group registered as {name!r} (registered: {sorted(_GROUPS)}); call "
            "draftgraph.ops.collectives.op.register_group(name, group) after torch.distributed.init_process_group"
        ) from None


def group_size(name: str) -> int:
    if not name:
        return 1
    return _SIZES[name] if name in _SIZES else get_group(name).size()


@dataclass(frozen=True)
class ParallelGroup:
    """This process's place in a tensor-parallel group: `rank` of `world_size`, talking over the process
    group registered as `group_name`. The default (`single()`) is one process and no collectives."""

    rank: int = 0
    world_size: int = 1
    group_name: str = ""

    def __post_init__(self):
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"ParallelGroup(rank={self.rank}, world_size={self.world_size}): need world_size >= 1 and "
                "0 <= rank < world_size"
            )
        if self.world_size > 1 and not self.group_name:
            raise ValueError(
                f"ParallelGroup(world_size={self.world_size}) needs the group_name of a registered process group"
            )

    @classmethod
    def single(cls) -> ParallelGroup:
        return cls()

    @classmethod
    def registered(cls, name: str) -> ParallelGroup:
        """This process's place in the process group registered as `name`."""
        import torch.distributed as dist

        group = get_group(name)
        return cls(dist.get_rank(group), group.size(), name)

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group (x itself for one process)."""
        return x if self.is_single else torch.ops.draftgraph.all_reduce(x, self.group_name)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the ranks' x along the last dim (x itself for one process)."""
        return x if self.is_single else torch.ops.draftgraph.all_gather_last(x, self.group_name)


@custom_op("draftgraph::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum of x over the ranks of the group registered as `group_name` ("" = one process: a copy)."""
    if group_name and (peer := peer_for(group_name)) is not None:
        out = peer.all_reduce(x)  # peer memory for the messages its measured rule takes (peer.py)
        if out is not None:
            return out
    out = x.contiguous().clone()
    if group_name:
        import torch.distributed as dist

        dist.all_reduce(out, group=get_group(group_name))
    return out


@all_reduce.register_fake
def _(x, group_name):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@custom_op("draftgraph::all_gather_last", mutates_args=())
def all_gather_last(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The ranks' x [..., n] concatenated along the last dim in rank order -> [..., n * world_size]."""
    if not group_name:
        return x.contiguous().clone()
    import torch.distributed as dist

    group = get_group(group_name)
    ws = group.size()
    src = x.contiguous()
    flat = torch.empty(ws * src.numel(), dtype=src.dtype, device=src.device)  # rank r's x at [r * numel, ...)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.13 renamed it
    gather(flat, src.view(-1), group=group)
    parts = flat.view(ws, *src.shape)  # [ws, ..., n]
    return parts.movedim(0, -2).reshape(*src.shape[:-1], ws * src.shape[-1])


@all_gather_last.register_fake
def _(x, group_name):
    return x.new_empty((*x.shape[:-1], x.shape[-1] * group_size(group_name)))


SINGLE = ParallelGroup()  # one process, no collectives: the default of every `tp` argument


@dataclass(frozen=True)
class ExpertGroups:
    """This rank's place in expert parallelism over EP = tensor_parallel_size x data_parallel_size ranks (what
    vLLM and SGLang call the EP group): `tp`, its replica's tensor-parallel group (the experts' all_reduce), and
    `replicas`, its peers of the same tensor-parallel rank in the other data-parallel replicas (the tokens'
    all_gather_rows / reduce_scatter_rows; single with one replica). Its EP rank is replicas.rank x tp size +
    tp.rank, the global rank of workers/worker.py's layout (rank r: tp rank r % tp of replica r // tp)."""

    replicas: ParallelGroup = SINGLE
    tp: ParallelGroup = SINGLE

    @property
    def rank(self) -> int:
        return self.replicas.rank * self.tp.world_size + self.tp.rank

    @property
    def size(self) -> int:
        return self.replicas.world_size * self.tp.world_size
