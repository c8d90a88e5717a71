"""Checks that run before any weights are loaded or anything is compiled, so that a bad setting fails in a
second with a message instead of after minutes of compiling (or an OOM kill):

- the checkpoint files: each config.json parses and each safetensors header is whole (no tensor data read);
- the KV cache against the device's memory: the bytes it needs (target, then target + drafter, per block)
  against CUDA's total memory (times gpu_memory_utilization when that sizes the cache) or the CPU's
  available RAM.

`resolve()` (compiler/config.py) checks the config itself: values, a missing CUDA, K with a drafter.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from draftgraph.compiler.config import CUDAGraphMode
from draftgraph.models.config import ModelConfig
from draftgraph.models.weights import check_weight_files, read_config, read_target_config
from draftgraph.runtime.kv_cache import KVCacheSpec


def check_checkpoints(target: Any, drafter: Any) -> None:
    """Parse the config.json and read the safetensors headers of every checkpoint directory given."""
    for source, is_target in ((target, True), (drafter, False)):
        if isinstance(source, str):
            read_target_config(source) if is_target else read_config(source)
            check_weight_files(source)


def target_config(source: Any, dtype: torch.dtype | None) -> ModelConfig | None:
    """The target's ModelConfig without loading its weights (None for a source load_target refuses)."""
    if isinstance(source, str):
        return ModelConfig.from_hf(read_target_config(source), dtype=dtype)
    cfg = getattr(source, "cfg", None)
    if isinstance(cfg, ModelConfig):
        return cfg.replace(dtype=dtype) if dtype is not None else cfg
    if isinstance(source, torch.nn.Module) and hasattr(source, "config"):
        param = next(source.parameters(), None)
        return ModelConfig.from_hf(source.config, dtype=dtype or (param.dtype if param is not None else None))
    return None


def artifact_mode(path: str) -> str:
    """The mode an artifact directory was built with (mode "auto" takes it); FULL_AND_PIECEWISE, `draftgraph
    build`'s default, when its manifest cannot be read (loading then says why)."""
    from draftgraph.artifacts.store import MANIFEST

    try:
        mode = json.loads((Path(path) / MANIFEST).read_text()).get("mode")
    except (OSError, ValueError, AttributeError):
        mode = None
    return mode if mode in [m.value for m in CUDAGraphMode] else CUDAGraphMode.FULL_AND_PIECEWISE.value


def device_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what they are): a CUDA device's total memory, or the CPU's available RAM."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return props.total_memory, f"the total memory of {props.name}"
    return available_ram(), "the available RAM"


def available_ram() -> int:
    """MemAvailable from /proc/meminfo (Linux), else the free physical pages os.sysconf reports."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_bytes_per_block(target_cfg: ModelConfig, drafter, block_size: int) -> int:
    """Bytes of one KV block of the target and (when given) the drafter, as the engine will allocate them."""
    total = KVCacheSpec.for_model(target_cfg, target_cfg.num_layers, 1, block_size).bytes_per_block
    if drafter is not None:
        total += KVCacheSpec.for_model(drafter.cfg, drafter.num_kv_layers, 1, block_size).bytes_per_block
    return total


def check_kv_memory(rc, target_cfg: ModelConfig, drafter=None, available: tuple[int, str] | None = None) -> None:
    """Refuse a KV cache that cannot fit on the device, naming the bytes needed and available and the fix.
    With gpu_memory_utilization the cache is sized later from measured memory; what must fit then is the
    smallest cache that works: one request of max_model_len."""
    bpb = kv_bytes_per_block(target_cfg, drafter, rc.block_size)
    what = "target + drafter" if drafter is not None else "target"
    total, where = available or device_memory(rc.device)
    if rc.gpu_memory_utilization:
        blocks = rc.max_blocks_per_req + 1
        budget = int(rc.gpu_memory_utilization * total)
        for_what = f"one request of max_model_len={rc.max_model_len}"
        limit = f"gpu_memory_utilization={rc.gpu_memory_utilization} x {where} ({_fmt(total)}) = {_fmt(budget)}"
        fix = "lower max_model_len (--max-model-len) or raise gpu_memory_utilization (--gpu-memory-utilization)"
    else:
        blocks, budget = rc.num_kv_blocks, total
        if blocks == rc.max_num_seqs * rc.max_blocks_per_req:
            for_what = f"max_num_seqs={rc.max_num_seqs} requests of max_model_len={rc.max_model_len}"
        else:
            for_what = f"num_kv_blocks={blocks}"
        limit = f"{where} is {_fmt(budget)} ({budget} bytes)"
        fix = (
            "lower max_model_len (--max-model-len) or max_num_seqs (--max-num-seqs), or set num_kv_blocks "
            f"(--num-kv-blocks) to at most {budget // bpb}"
        )
        if rc.device.type == "cuda":
            fix += ", or size the cache from memory with gpu_memory_utilization"
    need = blocks * bpb
    if need > budget:
        raise ValueError(
            f"the KV cache needs {_fmt(need)} ({need} bytes: {blocks} blocks x {bpb} bytes per block of "
            f"{rc.block_size} tokens, {what}) for {for_what}, but {limit}; {fix}"
        )


def _fmt(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
