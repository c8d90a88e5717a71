"""Sizing the KV cache after measuring what everything else takes: weights, the activations of the largest
batch, and the CUDA graphs (`CompileConfig.gpu_memory_utilization`).

Graph memory is only known once the graphs exist, and graphs read the KV cache in place, so sizing is a
measured probe on the engine itself:

1. The engine is built with a small probe cache (room for one request of max_model_len); it compiles and
   captures every graph; the pool's segments give the graph memory, the allocator's peak the activations.
2. The cache is sized from the budget left:
   blocks = (utilization x device memory - memory held before the engine - weights and buffers -
             activation peak - graph memory - mapping granularity) / bytes per block (target and drafter),
   the budget rounded down to 1/1024 of the device first (what the driver holds moves by fractions of a MiB
   as kernels load: engines built one after another in a process get the same size).
3. Where the caches grow in place (CUDA virtual memory, runtime/growable.py: each cache tensor reserved
   address space for the whole device), they grow to that size at the probe's addresses and the probe's
   graphs stay: every graph is captured once. Otherwise the graphs are released, the caches reallocated at
   that size (the same engine: no second build) and the graphs captured again; the compiled code is re-used
   (no trace, no Inductor compile: the block count is a dynamic dimension), only capture repeats.
With capture="lazy" the probe captures only the largest FULL request count and the largest piece size: all
graphs share one pool, captured largest first, so the smaller ones that steps capture later reuse what those
took, except their own outputs, which stay allocated for their replays (activations of a few tokens per piece:
within the 1 - utilization left over); the start does not wait for hundreds of captures.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, replace

import torch

from draftgraph.compiler.pool.compile_pool import wait_stopped

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
    mapping_slack: int = 0  # caches that grow in place: what mapping granularity may add, at most
    kept_graphs: bool = False  # the caches grew in place under the probe's graphs (captured once)

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
            + (f" - {self.mapping_slack / mib:.0f} mapping granularity" if self.mapping_slack else "")
            + ("; grown in place, graphs captured once" if self.kept_graphs else "; graphs captured again")
        )


def plan_blocks(
    device_total: int,
    utilization: float,
    outside: int,
    peak_without_kv: int,
    graph_memory: int,
    bytes_per_block: int,
    min_blocks: int,
    mapping_slack: int = 0,
) -> MemoryPlan:
    budget = int(utilization * device_total) - outside - peak_without_kv - graph_memory - mapping_slack
    step = budget_step(device_total)
    blocks = max(0, budget // step * step // bytes_per_block)
    plan = MemoryPlan(
        device_total, utilization, outside, peak_without_kv, graph_memory, bytes_per_block, blocks, mapping_slack
    )
    if blocks < min_blocks:
        raise ValueError(
            f"gpu_memory_utilization={utilization} leaves room for {blocks} KV blocks, but one request of "
            f"max_model_len needs {min_blocks} ({plan.describe()}); raise gpu_memory_utilization, lower "
            "max_model_len, or set num_kv_blocks instead"
        )
    return plan


def budget_step(device_total: int) -> int:
    """The KV budget is rounded down to this (1/1024 of the device, whole MiB): what the driver holds outside
    the allocator moves by a fraction of a MiB as kernels load, and every engine of one process gets the same
    cache size."""
    return max(2**20, device_total // 1024 // 2**20 * 2**20)


def measure_and_plan(engine, utilization: float) -> tuple[MemoryPlan, str]:
    """Steps 1 to 3 of the module docstring on `engine` (built with the probe cache; the Engine calls it while
    it is constructed): returns the plan and the probe's warm-up report. The engine then holds the sized
    cache and its graphs (`plan.kept_graphs`: the probe's, which the report describes), or none (warm it up
    again; the report is then "")."""
    from draftgraph.runtime.growable import granularity
    from draftgraph.runtime.warmup import reset_runtime_counters

    free_cuda()
    rc, runner = engine.config, engine.runner
    probe_blocks = rc.num_kv_blocks
    grows = runner.kv_grows_in_place
    torch.cuda.reset_peak_memory_stats()
    # The probe captures every graph; with capture="lazy" only the largest FULL request count and piece size: every
    # graph goes into one pool, largest first, so those bound what the rest will take (captured by their steps).
    report = engine.warm_up(lazy=False, largest_only=rc.lazy_capture)
    # The largest batch a step can hold, on whatever path it takes (past the capture sizes: no graph).
    runner.dummy_run(rc.max_num_batched_tokens)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    # What this process holds outside the allocator (its context, libraries), measured after warm-up and
    # after the compile workers (compiler/pool/compile_pool.py), stopped when compiling ended, have exited with
    # their CUDA contexts; other processes' memory counts.
    if (left := wait_stopped()) > 0:
        log.warning("%d compile worker processes are still exiting: their memory counts as used", left)
    free, total = torch.cuda.mem_get_info()
    mapped = runner.kv_mapped_bytes  # a cache that grows in place is mapped outside the allocator
    outside = total - free - torch.cuda.memory_reserved() - mapped
    bpb = kv_bytes_per_block(runner)
    graphs = engine.compiled.counters.graph_memory_bytes if engine.compiled is not None else 0
    kv_in_peak = 0 if grows else probe_blocks * bpb
    slack = runner.kv_num_tensors * granularity(rc.device) if grows else 0
    plan = plan_blocks(total, utilization, outside, peak - kv_in_peak, graphs, bpb, rc.max_blocks_per_req, slack)
    if grows:
        # The caches grow at the probe's addresses: its graphs stay (a count under the probe's keeps its memory).
        engine.resize_kv_cache(plan.num_blocks)
        plan = replace(plan, kept_graphs=True)
        if engine.compiled is not None:
            reset_runtime_counters(engine)  # the sizing run above is not a serving step
            # capture="lazy" keeps its promise: a graph the probe did not capture is captured when first needed
            engine.compiled.ctx.allow_capture = rc.graphs_enabled and rc.lazy_capture
    else:
        report = ""
        if engine.compiled is not None:
            engine.compiled.ctx.release()
        engine.resize_kv_cache(plan.num_blocks)  # the probe cache goes first, then the sized one is allocated
    free_cuda()
    log.info(plan.describe())
    return plan, report


def kv_bytes_per_block(runner) -> int:
    total = runner.target_cache.spec.bytes_per_block
    if runner.drafter is not None:
        total += runner.draft_cache.spec.bytes_per_block
    return total


def free_cuda() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
