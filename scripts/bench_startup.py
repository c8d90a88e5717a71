"""Startup: cold (trace, compile every piece for every capture size, capture) against warm (load the
artifacts, capture), each in a fresh process, for a 1B-shaped pair (--pair: the realistic-acceptance pair of
models/builtin.py by default, or bench_piecewise.py's with a random EAGLE head) in FULL_AND_PIECEWISE with auto
capture sizes. Every process starts from empty Inductor and Triton caches.
The cold one compiles and writes the artifacts; the warm ones load them with strict checking and capture
every graph at start (warm) or each at the first step that needs it (warm_lazy). Both generate the same prompts,
and their tokens are compared.

Each phase prints its process's start-up timeline (draftgraph/timeline.py; --timeline: every line), in
seconds since that process started: engine ready, first token, and the whole process as the parent saw it.

Usage: python scripts/bench_startup.py [--k 4] [--max-num-seqs 32] [--compile-workers N] [--phases cold,warm]
       [--sample warm_lazy,...]   those phases' engine build under the wall-clock sampling profiler (printed)

A phase that runs past --timeout is stopped with SIGABRT; Python's faulthandler then prints every thread's stack.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time


def config(args, **kw):
    import draftgraph as dg

    return dg.CompileConfig(
        speculation="fixed",
        mode="FULL_AND_PIECEWISE",
        num_speculative_tokens=args.k,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max(512, args.max_num_seqs * (args.k + 1)),
        max_model_len=1024,
        device="cuda",
        gpu_memory_utilization=0.0,  # a KV cache of max_num_seqs requests, not sized from memory
        progress=False,
        compile_workers=args.compile_workers,
        **kw,
    )


def phase(args) -> None:
    import torch

    import draftgraph as dg
    from draftgraph import timeline
    from draftgraph.artifacts.store import CACHE, build_artifacts
    from scripts.bench_piecewise import build_pair

    timeline.mark("imports")
    t_start = time.perf_counter()
    if args.pair == "acceptance":  # Llama-3.2-1B's shape, its first 2 layers as the draft model (~2.5 of 4 accepted)
        from draftgraph.models.builtin import LLAMA_1B_ACCEPTANCE, acceptance_pair

        _, target, drafter = acceptance_pair(LLAMA_1B_ACCEPTANCE, torch.bfloat16, device="cuda", attn_impl="triton")
    else:  # the same target shape with a random 1-layer EAGLE head
        target, drafter = build_pair()
    torch.cuda.synchronize()
    timeline.mark("models", f"the 1B pair ({args.pair}) on the GPU")
    import contextlib

    from scripts.sample_profile import SampleProfiler

    sampler = SampleProfiler() if args.phase in args.sample.split(",") else contextlib.nullcontext()
    t0 = time.perf_counter()
    with sampler:
        if args.phase == "cold":
            engine = dg.compile_model(target, drafter, config(args))
        else:
            capture = "lazy" if args.phase == "warm_lazy" else "eager"
            engine = dg.compile_model(
                target, drafter, config(args, capture=capture), artifacts=args.dir, strict_artifacts=True
            )
        torch.cuda.synchronize()
    ready = time.perf_counter() - t0
    timeline.mark("engine ready")
    if isinstance(sampler, SampleProfiler):
        print(f"== {args.phase}: where the engine build's main thread was\n{sampler.report()}", file=sys.stderr)
    write_s = 0.0
    if args.phase == "cold":
        t1 = time.perf_counter()
        build_artifacts(engine, args.dir)
        write_s = time.perf_counter() - t1
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (int(n),), generator=g).tolist() for n in (17, 60, 5, 33)]
    t2 = time.perf_counter()
    outs = engine.generate(prompts, dg.SamplingParams(max_tokens=24, ignore_eos=True))
    torch.cuda.synchronize()
    generate_s = time.perf_counter() - t2
    assert not os.path.isdir(os.path.join(args.dir, CACHE)), "a CUDA artifact must not need Inductor's cache"
    c = engine.compiled.counters
    print(
        json.dumps(
            {
                "phase": args.phase,
                "ready_s": round(ready, 2),
                "write_s": round(write_s, 2),
                "generate_s": round(generate_s, 2),
                "fallbacks": engine.stats()["fallbacks"],
                "model_build_s": round(t0 - t_start, 2),
                "traces": dict(c.traces),
                "inductor_compiles": c.inductor_compiles,
                "graphs_captured": c.graphs_captured,
                "capture_s": round(c.capture_seconds, 2),
                "compile_workers": c.compile_workers,
                "kernel_variants": c.kernel_variants,
                "worker_failures": c.compile_worker_failures,
                "warmup_s": {k: round(v, 2) for k, v in c.warmup_seconds.items()},
                "report": engine.warm_up_report,
                "tokens": [o.token_ids for o in outs],
                "timeline": {name: round(t, 2) for name, t, _ in reversed(timeline.marks())},  # a phase's first
                "timeline_text": timeline.report(),
            }
        ),
        flush=True,
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument(
        "--pair",
        choices=["acceptance", "eagle"],
        default="acceptance",
        help="the 1B pair with real acceptance (models/builtin.py LLAMA_1B_ACCEPTANCE, default) or with a random "
        "EAGLE head (bench_piecewise.py)",
    )
    ap.add_argument("--phase", choices=["cold", "warm", "warm_lazy"])
    ap.add_argument("--dir")
    ap.add_argument("--compile-workers", type=int, default=None, help="CompileConfig.compile_workers (None: auto)")
    ap.add_argument("--phases", default="cold,warm,warm_lazy", help="which phases to run, in order (cold first)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per phase before its stacks are dumped")
    ap.add_argument("--timeline", action="store_true", help="print each phase's start-up timeline")
    ap.add_argument("--sample", default="", help="phases to run under the sampling profiler (comma-separated)")
    args = ap.parse_args()
    if args.phase:
        phase(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        art = os.path.join(tmp, "artifacts")
        res = {}
        phases = args.phases.split(",")
        for name in phases:
            # Each process starts from empty Inductor and Triton caches: a warm start reads the artifacts only.
            caches = {
                v: os.path.join(tmp, f"{name}_{v.lower()}") for v in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
            }
            env = {**os.environ, **caches, "PYTHONPATH": os.getcwd(), "PYTHONFAULTHANDLER": "1"}
            cmd = [sys.executable, "-m", "scripts.bench_startup", "--phase", name, "--dir", art]
            cmd += ["--k", str(args.k), "--max-num-seqs", str(args.max_num_seqs), "--pair", args.pair]
            if args.compile_workers is not None:
                cmd += ["--compile-workers", str(args.compile_workers)]
            if args.sample:
                cmd += ["--sample", args.sample]
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            try:
                out, err = proc.communicate(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack to stderr
                out, err = proc.communicate()
                print(err[-12000:])
                raise SystemExit(f"{name} phase ran past {args.timeout:.0f} s: the stacks are above") from None
            if proc.returncode:
                print(err[-4000:])
                raise SystemExit(f"{name} phase failed")
            if "== " in err:  # a sampling profile
                print(err[err.index("== ") :])
            res[name] = json.loads(out.strip().splitlines()[-1])
            res[name]["process_s"] = round(time.perf_counter() - t0, 1)
            # the process's teardown: from its last output line to its end (its start is a few ms before t0)
            res[name]["exit_s"] = round(res[name]["process_s"] - max(res[name]["timeline"].values()), 1)
        files = sum(len(f) for _, _, f in os.walk(art))
        size = sum(os.path.getsize(os.path.join(d, x)) for d, _, fs in os.walk(art) for x in fs)
    cold = res["cold"]
    print(f"artifact directory: {files} files, {size / 2**20:.1f} MiB; written in {cold['write_s']} s")
    for r in res.values():
        print(
            f"{r['phase']:>9}: engine ready in {r['ready_s']:7.2f} s, then generate {r['generate_s']:.2f} s "
            f"(capture {r['capture_s']} s, {r['graphs_captured']} graphs, {r['fallbacks']} fallbacks), "
            f"traces {r['traces']}, Inductor compiles {r['inductor_compiles']}; whole process {r['process_s']} s "
            f"(model build {r['model_build_s']} s; the process's exit after its output {r['exit_s']} s)"
        )
        t = r["timeline"]
        first = t.get("first token")
        if first is not None and r["write_s"]:  # the cold phase writes the artifacts between ready and generate
            first = f"{first} s ({first - r['write_s']:.2f} s without the artifacts' writing)"
        elif first is not None:
            first = f"{first} s"
        print(
            f"           since the process started: engine ready {t.get('engine ready', '-')} s, first token "
            f"{first}, whole process {r['process_s']} s"
        )
        if args.timeline:
            print("           " + r["timeline_text"].replace("\n", "\n           "))
        print(f"           {r['report']}")
        workers = f"compile workers {r['compile_workers']} ({r['worker_failures']} failed)"
        print(f"           {workers}, warm-up {r['warmup_s']}")
        print(f"           draftgraph's Triton kernel variants compiled: {r['kernel_variants']}")
    for r in [r for name, r in res.items() if name != "cold"]:
        print(
            f"{r['phase']}: ready {cold['ready_s'] / r['ready_s']:.1f}x faster than cold; ready + generate "
            f"{(cold['ready_s'] + cold['generate_s']) / (r['ready_s'] + r['generate_s']):.1f}x; "
            f"tokens equal: {cold['tokens'] == r['tokens']}"
        )


if __name__ == "__main__":
    main()
