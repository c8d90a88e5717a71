"""How a tensor-parallel rank's share of a stored tensor is cut: ONE description, used both to slice a whole
tensor in memory (a transformers object, a .bin checkpoint) and to read only the share from safetensors
(models/parallel/sharded_read.py), so the two always agree bit for bit.

A `Cut` is a dim and ranges along it; the share is those ranges concatenated in order. Most split tensors
take one range (rank r's 1/W of the rows or columns). A fused projection stored as parts stacked along one
dim (Qwen3.5's in_proj_qkv [q | k | v] rows, a fused expert gate_up [gate | up]) takes this rank's piece of
each part: several ranges, read one by one (`get_slice`) and concatenated, never the whole tensor.

The family rules return a Cut, or None for a tensor every rank holds whole: `parallel.tensor_cut` (the Llama
family's, then DeepSeek's `parallel_mla.deepseek_cut` and Qwen3.5's `parallel_hybrid.hybrid_cut`) and
`drafters/parallel_heads.head_cut` (a head's own vocabulary rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Cut:
    """The share: `ranges` [start, stop) along `dim`, concatenated in order."""

    dim: int
    ranges: tuple[tuple[int, int], ...]

    def index(self, start: int, stop: int) -> tuple[slice, ...]:
        return (slice(None),) * self.dim + (slice(start, stop),)

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        """The share of a whole tensor in memory, as a contiguous copy (so the whole one can be freed)."""
        parts = [t[self.index(a, b)] for a, b in self.ranges]
        if len(parts) == 1:
            return parts[0].clone(memory_format=torch.contiguous_format)
        return torch.cat(parts, dim=self.dim)

    def views(self, stored: Any) -> list[torch.Tensor]:
        """The share's ranges from a safetensors slice handle (`safe_open(...).get_slice(name)`), in order, each
        as the handle gives it (sharded_read.StoredTensor concatenates them, on its device)."""
        return [stored[self.index(a, b)] for a, b in self.ranges]


def split_cut(
    name: str,
    shape: tuple[int, ...] | list[int],
    dim: int,
    rank: int,
    world_size: int,
    parts: tuple[int, ...] | None = None,
    fix: str = "use a tensor-parallel size that divides it",
) -> Cut:
    """Rank `rank` of `world_size`'s share of a tensor of `shape` split evenly along `dim`. `parts`: the sizes
    of the parts a fused tensor stacks along `dim` (each split evenly, this rank taking its piece of each)."""
    size = shape[dim]
    parts = parts or (size,)
    if sum(parts) != size:
        raise ValueError(
            f"{name} has {size} entries along dim {dim}, but its parts should hold {list(parts)} (sum "
            f"{sum(parts)}); the checkpoint does not match its config.json: re-save it"
        )
    ranges, start = [], 0
    for n in parts:
        if n % world_size:
            part = f" (a part of {n} of its {size})" if len(parts) > 1 else ""
            raise ValueError(
                f"{name} has {size} entries along dim {dim}{part}, not divisible by tensor_parallel_size="
                f"{world_size}; {fix}"
            )
        share = n // world_size
        ranges.append((start + rank * share, start + (rank + 1) * share))
        start += n
    return Cut(dim, tuple(ranges))


def take(t: Any, cut: Cut | None) -> torch.Tensor:
    """The share `cut` (None: all of it) of `t`: a tensor in memory, or a stored one not read yet
    (sharded_read.StoredTensor), which then reads only that share."""
    if isinstance(t, torch.Tensor):
        return t if cut is None else cut.apply(t)
    return t.read(cut)
