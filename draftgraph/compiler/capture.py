"""Compile-and-capture lifecycle, in one ordered place.

1. Build the compiled forwards (one torch.compile per model function, piecewise backend).
2. Warm up: run each capture size once with padding-only batches; the first run traces and compiles.
3. Capture (CUDA only): the same runs again, largest size first, with capture allowed, into one pool
   shared by target and drafter; free memory is logged before and after. With capture="lazy" this step
   is skipped and capture stays allowed: each graph is captured by the first step that needs it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from draftgraph.compiler.compiled_forward import CompiledDrafter, CompiledLoop, CompiledTarget
from draftgraph.compiler.config import FULL_MODES, PIECEWISE_MODES, ResolvedConfig
from draftgraph.compiler.counters import CompileCounters
from draftgraph.compiler.full_graph import FullGraphs
from draftgraph.compiler.piece_runner import GraphContext
from draftgraph.compiler.piecewise import PiecewiseBackend
from draftgraph.passes.manager import PassManager
from draftgraph.runtime.drafting import Chooser, fused_loop_fn

log = logging.getLogger("draftgraph")


@dataclass
class CompiledModels:
    counters: CompileCounters
    ctx: GraphContext
    target: CompiledTarget
    drafter: CompiledDrafter | None
    full_target: FullGraphs | None = None  # FULL-mode whole-forward graphs (CUDA only)
    full_drafter: FullGraphs | None = None
    loop_backend: PiecewiseBackend | None = None  # the fused draft loop's backend (FULL modes with a drafter)
    loops: tuple | None = None  # the fused loop's CompiledLoops: (greedy, sampled)


def build_compiled(
    target,
    drafter,
    rc: ResolvedConfig,
    compile_backend: str,
    cache_dir: str,
    check_addresses: bool,
    dump_dir: str,
    progress: bool,
) -> CompiledModels:
    counters = CompileCounters()
    piece_graphs = rc.graphs_enabled and rc.mode in PIECEWISE_MODES
    ctx = GraphContext(counters, piece_graphs, rc.capture_sizes, check_addresses, progress)
    passes = PassManager(dump_dir=dump_dir or None)

    def backend(name):
        return PiecewiseBackend(name, rc.capture_sizes, ctx, passes, compile_backend, cache_dir or None)

    ct = CompiledTarget(target, backend("target"))
    cd = CompiledDrafter(drafter, backend("drafter")) if drafter is not None else None
    full = rc.graphs_enabled and rc.mode in FULL_MODES
    ft = FullGraphs("target", ctx) if full else None
    fd = FullGraphs("drafter", ctx) if full and drafter is not None else None
    backend_l, loops = None, None
    if rc.fuse_draft_loop:  # traced once per engine build, whatever cache the runner allocates
        backend_l = PiecewiseBackend("draft_loop", (), ctx, passes, compile_backend, cache_dir or None)
        choose = Chooser(drafter, target.cfg.vocab_size)
        fns = fused_loop_fn(drafter, choose, rc.num_speculative_tokens, rc.block_size)
        loops = tuple(CompiledLoop(fn, f"draft_loop_{v}", backend_l) for fn, v in zip(fns, ("greedy", "sample")))
    return CompiledModels(counters, ctx, ct, cd, ft, fd, backend_l, loops)


def warm_up_and_capture(engine) -> str:
    compiled: CompiledModels = engine.compiled
    if compiled is None:
        return "mode NONE: nothing to compile"
    rc, runner, counters, ctx = engine.config, engine.runner, compiled.counters, compiled.ctx
    sizes = sorted(rc.capture_sizes, reverse=True)
    static = [*engine.target.parameters(), *engine.target.buffers()]
    static += [t for kv in runner.target_cache.layers for t in kv]
    if engine.drafter is not None:
        static += [*engine.drafter.parameters(), *engine.drafter.buffers()]
        static += [t for kv in runner.draft_cache.layers for t in kv]
        static += [p for m in getattr(engine.drafter, "_target", []) for p in m.parameters()]
        static.append(runner.proposer.draft_probs)
    ctx.register_static(static)
    builders = [runner.target_meta] + ([runner.draft_meta] if hasattr(runner, "draft_meta") else [])
    ctx.register_persistent(
        t
        for b in builders
        for t in (
            b.slot_mapping,
            b.token_req,
            b.token_kv_len,
            b.positions,
            b.block_tables,
            b.seq_lens,
            b.query_start_loc,
        )
    )
    t0 = time.perf_counter()
    for size in tqdm(sizes[:1], desc="tracing and compiling", disable=not ctx.progress, leave=False):
        runner.dummy_run(size)  # the first call traces and compiles every piece for every size
    if compiled.loop_backend is not None and rc.full_capture_sizes:
        runner.dummy_run_full(max(rc.full_capture_sizes))  # traces the fused loops (capture is not allowed yet)
    compile_s = time.perf_counter() - t0
    capture_s, graph_bytes = 0.0, 0
    if rc.graphs_enabled and rc.lazy_capture:
        ctx.allow_capture = True  # from now on, the first step at a capture size captures its graph
    elif rc.graphs_enabled:
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        reserved_before = torch.cuda.memory_reserved()
        t1 = time.perf_counter()
        ctx.allow_capture = True
        try:
            # FULL graphs first, then piece graphs, each largest first, all into the one shared pool.
            for reqs in tqdm(
                sorted(rc.full_capture_sizes, reverse=True) if compiled.full_target else [],
                desc="capturing FULL graphs",
                unit="size",
                disable=not ctx.progress,
                leave=False,
            ):
                runner.dummy_run_full(reqs)
            for size in tqdm(
                sizes if ctx.graphs_enabled else [],
                desc="capturing piece graphs",
                unit="size",
                disable=not ctx.progress,
                leave=False,
            ):
                runner.dummy_run(size)
        finally:
            ctx.allow_capture = False
        torch.cuda.synchronize()
        capture_s = time.perf_counter() - t1
        free_after = torch.cuda.mem_get_info()[0]
        graph_bytes = pool_bytes(ctx.pool)
        if graph_bytes is None:  # no allocator snapshot: fall back to what the device lost
            graph_bytes = max(0, free_before - free_after, torch.cuda.memory_reserved() - reserved_before)
        log.info("free GPU memory %.0f MiB before capture, %.0f MiB after", free_before / 2**20, free_after / 2**20)
    # Runtime counters start after warm-up: from here they count serving steps only.
    counters.graph_replays.clear()
    counters.compiled_runs.clear()
    counters.dynamic_runs.clear()
    runner.forwards.reset()
    counters.graph_memory_bytes = graph_bytes
    graphs = (
        "CUDA graphs captured lazily, each at the first step that needs it"
        if rc.lazy_capture
        else f"captured {counters.graphs_captured} CUDA graphs in {capture_s:.1f} s, graph memory "
        f"{graph_bytes / 2**20:.0f} MiB"
        if rc.graphs_enabled
        else (
            "CUDA graphs off (no CUDA device)"
            if rc.device.type != "cuda"
            else "CUDA graphs off (use_cuda_graphs=False)"
        )
    )
    line = (
        f"compiled {counters.pieces} pieces ({counters.unique_pieces} unique) x {len(sizes)} sizes "
        f"({counters.inductor_compiles} Inductor compiles) in {compile_s:.1f} s; {graphs}"
    )
    log.info(line)
    return line


def pool_bytes(pool) -> int | None:
    """Bytes held by the segments of the graphs' shared memory pool (from the allocator's snapshot), or
    None when it cannot be read. Free-memory deltas undercount: the caching allocator may already hold
    the memory a pool takes."""
    if pool is None:
        return 0
    try:
        segments = torch.cuda.memory._snapshot()["segments"]
    except Exception:  # an allocator without snapshots
        return None
    want = tuple(pool)
    return sum(seg["total_size"] for seg in segments if tuple(seg.get("segment_pool_id", ())) == want)
