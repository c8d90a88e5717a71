"""Reading one tensor-parallel rank's share of a safetensors checkpoint, and only that share.

`read_rank_share(path, tp)` opens each safetensors file and, for every tensor the Llama-family split cuts
(`parallel.shard_dim`: q/k/v, gate/up and the vocabulary by rows, o/down by columns), reads only this rank's
rows or columns through `safe_open(...).get_slice(name)[...]`: the file is memory-mapped and the bytes of
the other ranks' slices are never copied. Tensors every rank holds whole (norms, row-parallel biases) are read
whole. The result is what `parallel.shard_state` would give from the whole checkpoint, so the model is built
from it unchanged (`CausalLM.from_state_dict(..., sharded=True)`).

A `pytorch_model.bin` checkpoint cannot be read in part: it is read whole, then sliced.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from draftgraph.models.parallel import shard_dim, shard_state
from draftgraph.models.weights import CheckpointError, check_weight_files, read_checkpoint
from draftgraph.ops.collectives.op import ParallelGroup

log = logging.getLogger("draftgraph")


def safe_open(file: str):
    """safetensors' reader of one file (a function of its own, so tests can count what goes through it)."""
    from safetensors import safe_open as open_file

    return open_file(file, framework="pt")


def rank_slice(name: str, shape: list[int], dim: int, tp: ParallelGroup) -> tuple[slice, ...]:
    """The index of rank `tp.rank`'s share of a tensor of `shape` split along `dim` (whole entries elsewhere)."""
    size = shape[dim]
    if size % tp.world_size:
        raise ValueError(
            f"{name} has {size} entries along dim {dim}, not divisible by tensor_parallel_size={tp.world_size}; "
            "use a tensor-parallel size that divides it"
        )
    n = size // tp.world_size
    return (slice(None),) * dim + (slice(tp.rank * n, (tp.rank + 1) * n),)


def read_rank_share(
    path: str, tp: ParallelGroup, dim_of: Callable[[str], int | None] = shard_dim
) -> dict[str, torch.Tensor]:
    """This rank's share of a checkpoint directory's tensors, by their stored names: split tensors (`dim_of`
    gives their dim) as this rank's slice only, the others whole."""
    files = check_weight_files(path)
    if not files:  # pytorch_model.bin: no partial reads
        return shard_state(read_checkpoint(path), tp)
    state: dict[str, torch.Tensor] = {}
    read = total = 0
    for file in files:
        try:
            with safe_open(file) as f:
                for name in f.keys():  # noqa: SIM118 - a safetensors handle is not iterable
                    dim = dim_of(name)
                    if dim is None or tp.is_single:
                        t = f.get_tensor(name)
                        total += t.numel() * t.element_size()
                    else:
                        part = f.get_slice(name)
                        shape = part.get_shape()
                        t = part[rank_slice(name, shape, dim, tp)]
                        total += t.element_size() * int(torch.Size(shape).numel())
                    state[name] = t
                    read += t.numel() * t.element_size()
        except ValueError:  # a size tp cannot split (CheckpointError is one too): named already
            raise
        except Exception as e:  # safetensors raises its own SafetensorError (and OSError)
            raise CheckpointError(f"{file} could not be read ({e}); download or save the checkpoint again") from e
    log.info(
        "tensor-parallel rank %d of %d read %.1f MB of the checkpoint's %.1f MB (its slices; replicated tensors whole)",
        tp.rank, tp.world_size, read / 2**20, total / 2**20,
    )  # fmt: skip
    return state
