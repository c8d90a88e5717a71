"""Sizing the KV cache after measuring what everything else takes: weights, the activations of the largest
batch, and the CUDA graphs (`CompileConfig.gpu_memory_utilization`).

Graph memory is only known once the graphs exist, and graphs read the KV cache in place, so sizing is a
measured probe followed by the real build:

1. Build the engine with a small probe cache (room for one request of max_model_len), compile, and capture
   every graph; the pool's segments give the graph memory, the allocator's peak the activations.
2. Release the probe's graphs and cache; size the cache from the budget left:
   blocks = (utilization x device memory - memory held before the engine - weights and buffers -
             activation peak - graph memory) / bytes per block (target and drafter together).
3. Build the engine again with that cache and capture again. The compiled code is re-used (no trace, no
   Inductor compile: the block count is a dynamic dimension), only capture repeats.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, replace

import torch

from draftgraph.compiler.piece_runner import PieceRunner

log = logging.getLogger("draftgraph")


@dataclass(frozen=True)
class MemoryPlan:
    """What the probe measured and the cache size it leaves room for (bytes)."""

    device_total: int
    utilization: float
    outside: int  # held outside this process's allocator: the CUDA context, other processes
    peak_without_kv: int  # the probe's allocation peak less its KV cache: weights, buffers, activations
    graph_memory: int  # the CUDA graph pool's segments
    bytes_per_block: int  # target and drafter KV of one block
    num_blocks: int

    def as_dict(self) -> dict:
        return dict(self.__dict__)

    def describe(self) -> str:
        mib = 2**20
        kv = self.num_blocks * self.bytes_per_block / mib
        return (
            f"KV cache sized after capture: {self.num_blocks} blocks ({kv:.0f} MiB) = {self.utilization:.2f} x "
            f"{self.device_total / mib:.0f} MiB - {self.outside / mib:.0f} outside "
            f"the allocator - {self.peak_without_kv / mib:.0f} weights, buffers and activations - "
            f"{self.graph_memory / mib:.0f} CUDA graphs"
        )


def plan_blocks(
    device_total: int,
    utilization: float,
    outside: int,
    peak_without_kv: int,
    graph_memory: int,
    bytes_per_block: int,
    min_blocks: int,
) -> MemoryPlan:
    budget = int(utilization * device_total) - outside - peak_without_kv - graph_memory
    blocks = max(0, budget // bytes_per_block)
    plan = MemoryPlan(device_total, utilization, outside, peak_without_kv, graph_memory, bytes_per_block, blocks)
    if blocks < min_blocks:
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves room for {blocks} KV blocks, but one request of "
            f"max_model_len needs {min_blocks} ({plan.describe()}); raise gpu_memory_utilization, lower "
            "max_model_len, or set num_kv_blocks instead"
        )
    return plan


def measure_and_plan(build_engine, rc, utilization: float):
    """Steps 1 and 2 of the module docstring: returns the plan; the probe engine is gone afterwards."""
    free_cuda()
    free, total = torch.cuda.mem_get_info()
    outside = total - free - torch.cuda.memory_reserved()
    # The probe captures every graph, also with capture="lazy": the cache is sized for all of them.
    probe_rc = replace(rc, num_kv_blocks=rc.max_blocks_per_req + 1, lazy_capture=False)
    torch.cuda.reset_peak_memory_stats()
    probe = build_engine(probe_rc)
    probe.warm_up()
    # The largest batch a step can hold, on whatever path it takes (past the capture sizes: no graph).
    probe.runner.dummy_run(rc.max_num_batched_tokens)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    bpb = kv_bytes_per_block(probe.runner)
    graphs = probe.compiled.counters.graph_memory_bytes if probe.compiled is not None else 0
    plan = plan_blocks(total, utilization, outside, peak - probe_rc.num_kv_blocks * bpb, graphs, bpb,
                       rc.max_blocks_per_req)  # fmt: skip
    release_graphs(probe.compiled)
    del probe
    free_cuda()
    log.info(plan.describe())
    return plan


def kv_bytes_per_block(runner) -> int:
    total = runner.target_cache.spec.bytes_per_block
    if runner.drafter is not None:
        total += runner.draft_cache.spec.bytes_per_block
    return total


def release_graphs(compiled) -> None:
    """Drop every captured graph (FULL and piece graphs) and their pool, so the memory goes back."""
    if compiled is None:
        return
    for fg in (compiled.full_target, compiled.full_drafter):
        if fg is not None:
            fg.graphs.clear()
    for fn in (compiled.target, compiled.drafter, *(compiled.loops or ())):
        if fn is None:
            continue
        # Compiled here: the backend's split modules; loaded from artifacts: each stored trace's module.
        splits = [rec["split"].module for rec in fn.backend.records] + [t.module for t in getattr(fn, "traces", [])]
        for split in splits:
            for module in split.modules():
                if isinstance(module, PieceRunner):
                    module.graphs.clear()
    ctx = compiled.ctx
    ctx.pool = None
    ctx.static_ptrs.clear()
    ctx.persistent_ptrs.clear()
    compiled.counters.graphs_captured = 0
    compiled.counters.static_buffer_bytes = 0
    compiled.counters.capture_seconds = 0.0


def free_cuda() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
