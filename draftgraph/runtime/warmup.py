"""The compile-and-capture lifecycle of an engine, in one ordered place.

1. Register what graphs read in place (weights, KV caches, the metadata builders' buffers) with the
   engine's graph owner (compiler/cuda_graphs.py).
2. Compile: run each compiled function once on padding-only inputs; the first call traces it and compiles
   each unique piece once (the token count symbolic).
3. Capture (CUDA only): every FULL graph, then every piece graph, each largest size first, into the one
   shared pool; free memory is logged before and after. With capture="lazy" this step is skipped and
   capture stays allowed: each graph is captured by the first step that needs it.
"""

from __future__ import annotations

import functools
import logging
import time

import torch
from tqdm import tqdm

from draftgraph import timeline
from draftgraph.ops.kernel_variants import compiled_variants

log = logging.getLogger("draftgraph")


def register_in_place(engine) -> None:
    graphs, runner = engine.compiled.ctx, engine.runner
    static = [*engine.target.parameters(), *engine.target.buffers()]
    static += [t for kv in runner.target_cache.layers for t in kv]
    if engine.drafter is not None:
        static += [*engine.drafter.parameters(), *engine.drafter.buffers()]
        static += [t for kv in runner.draft_cache.layers for t in kv]
        static += [p for m in getattr(engine.drafter, "_target", []) for p in m.parameters()]
        static.append(runner.proposer.draft_probs)
    graphs.register_static(static)
    builders = [runner.target_meta] + ([runner.draft_meta] if hasattr(runner, "draft_meta") else [])
    fields = ("slot_mapping", "token_req", "token_kv_len", "positions", "block_tables", "seq_lens", "query_start_loc")
    graphs.register_persistent(getattr(b, f) for b in builders for f in fields)
    if runner.uniform is not None:  # the one-graph step's named buffers and per-slot block tables
        graphs.register_persistent([*runner.uniform.buffers.device_tensors(), runner.uniform.tables.tables])


def step_sampling_calls(engine) -> list[dict]:
    """The calls of our token-choice ops that the one-graph step makes outside any traced graph, for every
    FULL capture size B: its acceptance (greedy argmax, then the sampled variant's probabilities, over
    B x (K + 1) verify rows of the target's logits) and, when the draft loop runs unfused inside the step
    (fuse_draft_loop auto), the drafter's token choice (the same two over B rows of draft logits) and, on
    CUDA, the metadata advance between its steps (one kernel variant for every row count), and on CUDA the step's
    own metadata (ops/attention/uniform_metadata.py, a variant per rows-per-request). Compiled ahead in
    threads while the forwards are traced, instead of one after another at the step's first run (3-4 s of the
    built-in pair's cold start on an H100, docs/history/benchmarks-2026-11.md, 2026-11-23). The argmax's kernels
    specialise on the row count (its chunk)."""
    from draftgraph.compiler.pool.kernels_ahead import op_call, tensor_arg

    rc, target, q = engine.config, engine.target, engine.runner.shapes.verify
    shapes = {(b * q, target.cfg.vocab_size, target.cfg.dtype) for b in rc.full_capture_sizes}
    unfused = engine.drafter is not None and rc.num_speculative_tokens and engine.compiled.loops is None
    if unfused:
        vocab, dtype = engine.drafter.draft_vocab_size, engine.drafter.cfg.dtype
        shapes |= {(b, vocab, dtype) for b in rc.full_capture_sizes}
    calls = []
    if engine.runner.uniform is not None and rc.device.type == "cuda":  # the step's metadata (elsewhere: torch ops)
        import draftgraph.ops.attention.uniform_metadata  # noqa: F401  registers the op

        tables = engine.runner.uniform.tables.tables
        rows = {q, engine.runner.shapes.first_draft}
        ints = tensor_arg((max(rc.full_capture_sizes),), torch.int64)
        for width in sorted(rows):  # the verify's rows per request, and a draft model's first step's
            calls.append(op_call("draftgraph::uniform_metadata", tensor_arg(tuple(tables.shape), torch.int32), ints,
                                 ints, ints, width, rc.block_size))  # fmt: skip
    if unfused and rc.num_speculative_tokens > 1 and rc.device.type == "cuda":  # (elsewhere: torch ops)
        import draftgraph.ops.attention.triton_advance  # noqa: F401  registers the op

        width = engine.runner.shape.max_blocks_per_req
        b = max(rc.full_capture_sizes)
        tables, pos, valid = (
            tensor_arg((b, width), torch.int32),
            tensor_arg((b,), torch.int64),
            tensor_arg((b,), torch.bool),
        )
        calls.append(op_call("draftgraph::advance_next", tables, pos, valid, rc.block_size))
    for rows, vocab, dtype in sorted(shapes, key=lambda s: (s[0], s[1], str(s[2]))):
        logits = tensor_arg((rows, vocab), dtype)
        calls.append(op_call("draftgraph::argmax_rows", logits))
        params = [tensor_arg((rows,), d) for d in (torch.float32, torch.int64, torch.float32)]
        calls.append(op_call("draftgraph::sampling_probs", logits, *params))  # temperature, top_k, top_p
    if rc.ops.race_sampler:  # the draws (the Triton race on CUDA unless OpChoices.race_sampler is off): a row a request
        vocabs = {target.cfg.vocab_size} | ({engine.drafter.draft_vocab_size} if unfused else set())
        for b, vocab in sorted((b, v) for b in rc.full_capture_sizes for v in vocabs):
            ints = tensor_arg((b,), torch.int64)
            calls.append(op_call("draftgraph::race_sample", tensor_arg((b, vocab), torch.float32), ints, ints, 0))
    return calls


def reset_runtime_counters(engine) -> None:
    """Runtime counters start after warm-up: from here they count serving steps only."""
    counters = engine.compiled.counters
    counters.graph_replays.clear()
    counters.compiled_runs.clear()
    counters.dynamic_runs.clear()
    engine.runner.forwards.reset()


def warm_up_and_capture(engine, lazy: bool | None = None, largest_only: bool = False) -> str:
    """Compile (first call of each function) and capture; returns the report line. `lazy`: leave capture to
    the steps (None: as configured). `largest_only`: capture only the largest FULL request count and the largest
    piece size (KV sizing with lazy capture: every later graph is captured into the same pool, largest first, so
    these bound its memory; the steps capture the rest)."""
    compiled = engine.compiled
    if compiled is None:
        return "mode NONE: nothing to compile"
    rc, runner, counters, graphs = engine.config, engine.runner, compiled.counters, compiled.ctx
    lazy = rc.lazy_capture if lazy is None else lazy
    register_in_place(engine)
    if compiled.ahead is not None and runner.uniform is not None:
        compiled.ahead.submit(step_sampling_calls(engine))
    t0 = time.perf_counter()
    compiles_before = counters.inductor_compiles
    variants_before = compiled_variants()
    phases = counters.warmup_seconds
    detail = ""
    with tqdm(total=1, desc="tracing and compiling", disable=not graphs.progress, leave=False) as bar:
        runner.dummy_run(rc.warmup_tokens)  # the first call traces and compiles every unique piece once
        phases["forwards"] = time.perf_counter() - t0
        detail = f"forwards {phases['forwards']:.1f} s"
        if compiled.loops is not None and rc.full_capture_sizes:
            runner.dummy_run_full(max(rc.full_capture_sizes))  # traces the fused loops (no capture yet)
            phases["draft_loops"] = time.perf_counter() - t0 - phases["forwards"]
            detail += f", draft loops {phases['draft_loops']:.1f} s"
        bar.update(1)
    timeline.mark("tracing", detail)
    t_wait = time.perf_counter()
    had_pool = compiled.pool is not None  # a later warm-up (after KV sizing) has no workers left to wait for
    compiled.finish_compiles()  # the compile workers' pieces: loaded before any graph is captured
    phases["compile_workers_wait"] = time.perf_counter() - t_wait
    timeline.mark("compiles", f"waited {phases['compile_workers_wait']:.1f} s for compile workers" if had_pool else "")
    compile_s = time.perf_counter() - t0
    capture_s, graph_bytes = 0.0, 0
    if rc.graphs_enabled and lazy:
        graphs.allow_capture = True  # from now on, the first step at a capture size captures its graph
    elif rc.graphs_enabled:
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        reserved_before = torch.cuda.memory_reserved()
        t1 = time.perf_counter()
        full_sizes = sorted(rc.full_capture_sizes, reverse=True) if compiled.full else []
        piece_sizes = sorted(rc.capture_sizes, reverse=True) if graphs.piece_graphs else []
        if largest_only:
            full_sizes, piece_sizes = full_sizes[:1], piece_sizes[:1]
        with graphs.capturing(), tqdm(
            total=len(full_sizes) + len(piece_sizes), desc="capturing CUDA graphs", unit="size",
            disable=not graphs.progress, leave=False,
        ) as bar:  # fmt: skip
            # FULL graphs first, then piece graphs, each largest first, all into the one shared pool.
            for reqs in full_sizes:
                for view in engine.runners.values():  # every K a step may run at (adaptive speculation)
                    view.dummy_run_full(reqs)
                bar.update(1)
            for size in piece_sizes:
                runner.dummy_run(size)
                bar.update(1)
        torch.cuda.synchronize()
        capture_s = time.perf_counter() - t1
        free_after = torch.cuda.mem_get_info()[0]
        graph_bytes = graphs.memory_bytes()
        if graph_bytes is None:  # no allocator snapshot: fall back to what the device lost
            graph_bytes = max(0, free_before - free_after, torch.cuda.memory_reserved() - reserved_before)
        log.info("free GPU memory %.0f MiB before capture, %.0f MiB after", free_before / 2**20, free_after / 2**20)
    if not rc.graphs_enabled:
        timeline.mark("capture", "CUDA graphs off")
    else:
        done = f"{counters.graphs_captured} graphs" + (
            " (the largest sizes; the rest at their first step)" if largest_only else ""
        )
        timeline.mark("capture", "lazy: each graph at its first step" if lazy else done)
    reset_runtime_counters(engine)
    counters.graph_memory_bytes = graph_bytes
    if rc.graphs_enabled and lazy:
        graphs_line = "CUDA graphs captured lazily, each at the first step that needs it"
    elif rc.graphs_enabled:
        graphs_line = (
            f"captured {counters.graphs_captured} CUDA graphs in {capture_s:.1f} s, graph memory "
            f"{graph_bytes / 2**20:.0f} MiB"
        )
    elif rc.device.type != "cuda":
        graphs_line = "CUDA graphs off (no CUDA device)"
    else:
        graphs_line = "CUDA graphs off (use_cuda_graphs=False)"
    compiles = counters.inductor_compiles - compiles_before
    variants = {k: n - variants_before.get(k, 0) for k, n in compiled_variants().items()}
    counters.kernel_variants = {k: n for k, n in variants.items() if n}
    kernels = f", {sum(variants.values())} variants of draftgraph's Triton kernels" if counters.kernel_variants else ""
    if counters.kernels_ahead.get("kernels"):
        kernels += f" ({counters.kernels_ahead['kernels']} compiled ahead in threads)"
    waited = ""
    if had_pool:
        waited = (
            f" ({compile_s - phases['compile_workers_wait']:.1f} s tracing and first runs, then "
            f"{phases['compile_workers_wait']:.1f} s waiting for {counters.compile_workers} compile workers)"
        )
    reused = f", {counters.pieces_reused} compiled by an earlier engine" if counters.pieces_reused else ""
    line = (
        f"compiled {counters.pieces} pieces ({counters.unique_pieces} unique{reused}, {compiles} Inductor compiles, "
        f"token count symbolic{kernels}) in {compile_s:.1f} s{waited}; {graphs_line}"
    )
    log.info(line)
    return line


def measure_step_times(engine, runs: int = 5, max_context: int = 2048, timer=None, captured_only: bool = True) -> str:
    """Adaptive speculation's cost model (runtime/adaptive.py): the least time of each K's greedy one-graph step at
    every FULL request count, every row a request (real rows read and write KV; padding rows do neither, and made the
    larger K look cheaper than they are), at cached length 0 and at the longest that fits (up to `max_context`), into
    `engine.step_times` (`measured`, `per_token`); returns a report fragment. Run once the KV cache has its size and
    before any request: row i reads and writes blocks of its own (i * n ...), whose contents are zeroed first (the
    steps' tokens and drafts must stay in the vocabulary) and again after; the device block tables are restored from
    the host's. `timer(fn)`: seconds of one call (default: CUDA events); `captured_only`: time only the steps captured
    as graphs (False: also their code without graphs, as on the CPU)."""
    from draftgraph.compiler.cuda_graphs import GraphKey
    from draftgraph.runtime.dispatcher import BatchDescriptor

    rc, runner = engine.config, engine.runner
    graphs, times, slopes = engine.compiled.ctx, {}, {}
    timer = timer or _cuda_time
    num_blocks, bs = engine.allocator.num_blocks, rc.block_size
    # Hybrid models (runtime/state_cache.py) keep per-slot states too: their steps are timed on padding rows
    real = engine.states is None
    caches = [t for c in (runner.target_cache, getattr(runner, "draft_cache", None)) if c is not None
              for kv in c.layers for t in kv]  # fmt: skip
    for t in caches if real else ():
        t.zero_()
    for k, view in sorted(engine.runners.items()):
        if view.uniform is None:
            continue
        q = view.shapes.verify
        tables = view.uniform.tables
        dev = tables.tables.device
        width = tables.tables.shape[1]
        for b in engine.config.full_capture_sizes:
            d = view.dispatcher.dispatch(BatchDescriptor(b * q, b, q))
            key = GraphKey.step(q, d.num_reqs, "greedy")
            if not view.uniform.applies(d) or (captured_only and key not in graphs.graphs):
                continue
            b = d.num_reqs
            # the longest cached length whose rows (K + 2 of a draft model's first step past it) fit the table
            # width, the model length, and the cache (each row its own blocks)
            top = min(max_context, rc.max_model_len, width * bs, num_blocks // b * bs) - (k + 3)
            x = view.uniform.inputs([], d, False)
            fn = view.uniform.fns["greedy"]
            at = {}
            for ctx in (0, top) if real and top > 0 else (0,):
                if real:
                    n = -(-(ctx + k + 3) // bs)
                    slots = torch.arange(b, device=dev) % tables.scratch
                    rows = torch.arange(tables.scratch, device=dev, dtype=torch.int32)[:, None] * n
                    cols = torch.arange(n, device=dev, dtype=torch.int32)
                    tables.tables[: tables.scratch, :n] = (rows + cols) % num_blocks
                    x["slots"][:b] = slots
                    x["valid"][:b] = 1

                run = functools.partial(view.forwards.step, key, x, fn)
                at[ctx] = _least_time(run, x, b, ctx, runs, timer)
            times[(k, b)] = at[0]
            slopes[(k, b)] = max(0.0, (at[top] - at[0]) / top) if top in at and top > 0 else 0.0
            x["valid"][:b] = 0
            x["lengths"][:b] = 0
            x["slots"][:b] = tables.scratch
    for t in caches if real else ():
        t.zero_()
    for view in engine.runners.values():  # every view shares these tables: back to the host's rows
        if view.uniform is not None:
            view.uniform.tables.tables.copy_(view.uniform.tables._host)
            view.uniform.tables.invalidate()
    engine.step_times.measured.update(times)
    engine.step_times.per_token.update(slopes)
    if not times:
        return ""
    top = max(b for _, b in times)
    per_k = ", ".join(
        f"K={k} {times[(k, top)] * 1e3:.2f} ms + {slopes[(k, top)] * 1e6:.2f} us/token"
        for k in sorted(engine.runners)
        if (k, top) in times
    )
    return f"; adaptive speculation: step times of {len(times)} (K, batch) graphs measured ({per_k} at batch {top})"


def _least_time(run, x: dict, b: int, ctx: int, runs: int, timer) -> float:
    """The least seconds of `run` (a step of `b` rows at cached length `ctx`) over `runs` after one untimed call (a
    replay's time only grows with what else runs: the compile threads of start-up, the host); each call
    from the same inputs (the step advances its own lengths and tokens)."""
    samples = []
    for i in range(runs + 1):
        x["lengths"][:b] = ctx
        x["input_ids"].zero_()
        t = timer(run)
        if i:
            samples.append(t)
    return min(samples)


def _cuda_time(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3
