"""Reading one tensor-parallel rank's share of a safetensors checkpoint, and only that share.

`open_checkpoint(path, tp, what)` opens a checkpoint directory's safetensors files (headers only) and gives its
tensors by stored name as `StoredTensor`s: a shape, and `read(cut)`, which reads the whole tensor (cut None)
or only the rank's share (`shard_cut.Cut`: one range, or several ranges of one dim for fused projections,
each read with `safe_open(...).get_slice(name)[...]` and concatenated). Files are memory-mapped: the bytes of
other ranks' slices, and of tensors nobody reads, are never copied. Leaving the context logs the megabytes
this rank read against the checkpoint's size.

The cut of each tensor comes from the same rules that slice a whole tensor in memory (parallel.tensor_cut,
drafters/parallel_heads.head_cut), so a read share equals the whole checkpoint read and sliced, bit for bit:
- targets and draft models (`read_target_share`, `model_share`): every family's split (Llama, DeepSeek-V3 /
  V3.2, Qwen3.5); tensors the model does not hold (DeepSeek's MTP layer past the decoder, Qwen3.5's `mtp.*`
  head and vision tower) are not read;
- EAGLE / EAGLE-3 / MTP heads (drafters/loader.py): the head's checks see the stored shapes, then
  `head_share` reads each tensor it keeps as its share, so a head inside the target's checkpoint (DeepSeek's
  MTP layer, Qwen3.5's `mtp.*`) reads that layer only.

A `pytorch_model.bin` checkpoint cannot be read in part: it is read whole (its tensors in memory, then sliced).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from draftgraph.models.config import ModelConfig
from draftgraph.models.families import family_of
from draftgraph.models.mapped_read import DeviceLoader, MappedSafetensors
from draftgraph.models.parallel.dense import tensor_cut
from draftgraph.models.parallel.shard_cut import Cut, take
from draftgraph.models.weights import CheckpointError, check_weight_files, read_checkpoint
from draftgraph.ops.collectives.op import ParallelGroup

log = logging.getLogger("draftgraph")


def safe_open(file: str):
    """The reader of one safetensors file: its tensors as views of a memory map (models/mapped_read.py; a function
    of its own, so tests can count what goes through it)."""
    return MappedSafetensors(file)


class StoredTensor:
    """A tensor of an open safetensors checkpoint, not read yet: its whole `shape`; `read` reads it."""

    def __init__(self, reader: _Reader, handle: Any, file: str, name: str):
        self._reader, self._handle, self.file, self.name = reader, handle, file, name
        self.shape = torch.Size(self._call(lambda: handle.get_slice(name).get_shape()))

    def read(self, cut: Cut | None = None) -> torch.Tensor:
        """The whole tensor (cut None) or this rank's share (only its ranges' bytes are read): on the reader's
        device (through its DeviceLoader), else in CPU memory (a view of the file's map where the share is one
        contiguous range, as safetensors' own tensors are; a copy otherwise)."""
        if self._reader.closed:
            raise RuntimeError(f"{self.name} was read after its checkpoint was closed")
        h, name = self._handle, self.name
        parts = self._call(lambda: cut.views(h.get_slice(name)) if cut else [h.get_tensor(name)])
        dim = cut.dim if cut else 0
        loader = self._reader.loader
        if loader is not None:
            t = loader.load(parts, dim)
        else:
            t = parts[0].contiguous() if len(parts) == 1 else torch.cat(parts, dim)  # (safetensors' slices alike)
        self._reader.read_bytes += t.numel() * t.element_size()
        return t

    def _call(self, fn):
        try:
            return fn()
        except ValueError:  # a size tp cannot split (named by shard_cut)
            raise
        except Exception as e:  # safetensors raises its own SafetensorError (and OSError)
            raise CheckpointError(f"{self.file} could not be read ({e}); download or save the checkpoint again") from e


class _Reader:
    def __init__(self, loader: DeviceLoader | None):
        self.read_bytes, self.closed, self.loader = 0, False, loader


@contextmanager
def open_checkpoint(
    path: str, tp: ParallelGroup, what: str, device: torch.device | str | None = None
) -> Iterator[dict[str, Any]]:
    """A checkpoint directory's tensors by stored name: `StoredTensor`s (safetensors; the files stay open
    until the context ends), or tensors in memory (pytorch_model.bin, read whole). With a CUDA `device`, stored
    tensors read straight onto it (mapped_read.DeviceLoader). On a clean exit, logs how many MB of the
    checkpoint rank `tp.rank` read for `what`."""
    files = check_weight_files(path)
    if not files:
        yield read_checkpoint(path)
        log.info("%s: pytorch_model.bin read whole by rank %d of %d (it cannot be read in part)",
                 what, tp.rank, tp.world_size)  # fmt: skip
        return
    device = torch.device(device) if device is not None else None
    loader = DeviceLoader(device) if device is not None and device.type == "cuda" else None
    reader, handles, state = _Reader(loader), [], {}
    try:
        for file in files:
            try:
                opened = safe_open(file)
                handle = opened.__enter__()
            except Exception as e:
                raise CheckpointError(f"{file} could not be read ({e}); download or save the checkpoint again") from e
            handles.append(opened)
            for name in handle.keys():  # noqa: SIM118 - a safetensors handle is not iterable
                state[name] = StoredTensor(reader, handle, file, name)
        yield state
    finally:
        reader.closed = True
        for opened in handles:
            opened.__exit__(None, None, None)
        if loader is not None:
            loader.close()
    total = sum(os.path.getsize(f) for f in files)
    log.info(
        "%s: tensor-parallel rank %d of %d read %.1f MB of the checkpoint's %.1f MB (its shares of split "
        "tensors, replicated ones whole, nothing it does not hold)",
        what, tp.rank, tp.world_size, reader.read_bytes / 2**20, total / 2**20,
    )  # fmt: skip


_LAYER = re.compile(r"model\.(?:language_model\.)?layers\.(\d+)\.")


def target_keeps(name: str, cfg: ModelConfig) -> bool:
    """Whether a stored tensor is part of the model `cfg` (CausalLM.from_state_dict drops the others: layers
    past the decoder, DeepSeek's MTP layer; Qwen3.5's MTP head and vision tower)."""
    if name.startswith(family_of(cfg).foreign_prefixes):
        return False
    m = _LAYER.match(name)
    return m is None or int(m.group(1)) < cfg.num_layers


def model_share(state: dict[str, Any], cfg: ModelConfig, tp: ParallelGroup) -> dict[str, torch.Tensor]:
    """Rank `tp.rank`'s share of a target or draft model (whole config `cfg`) from its stored or in-memory
    transformers-named tensors: each cut by `parallel.tensor_cut`, what the model does not hold skipped."""
    return {
        name: take(t, tensor_cut(name, tuple(t.shape), tp, cfg)) for name, t in state.items() if target_keeps(name, cfg)
    }


def read_target_share(
    path: str, cfg: ModelConfig, tp: ParallelGroup, what: str = "target", device: torch.device | str | None = None
) -> dict[str, torch.Tensor]:
    """A checkpoint directory's share for rank `tp.rank` of the model whose whole config is `cfg`: what
    `parallel.shard_state` cuts from the whole checkpoint (`CausalLM.from_state_dict(..., sharded=True)`); on
    `device` when it is a CUDA device (read straight there), else in CPU memory."""
    with open_checkpoint(path, tp, what, device) as state:
        return model_share(state, cfg, tp)
