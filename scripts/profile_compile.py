"""Where a cold compile's time goes: the 1B-shaped pair (bench_piecewise.py) in FULL_AND_PIECEWISE, K = 4, up
to 32 requests, from empty Inductor / Triton caches (set them in the environment), under cProfile.
`--builtin`: the built-in pair instead, configured as `draftgraph generate --device cuda` configures it.

Prints each unique piece's compile seconds and the functions with the most cumulative time. `--no-cprofile`:
the timings alone, without the profiler's overhead (what a user waits for).
Usage: TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) TRITON_CACHE_DIR=$(mktemp -d) python scripts/profile_compile.py
       [--builtin] [--no-cprofile] [--workers N] [--dump FILE]
`--workers N`: CompileConfig.compile_workers (default: auto; 0 = every compile in this process).
`--sample`: with --no-cprofile, a wall-clock sampling profile of the main thread (scripts/sample_profile.py):
where the engine process waits, subprocesses and locks included.
"""

from __future__ import annotations

import contextlib
import cProfile
import pstats
import sys
import time

import torch

import draftgraph as dg
from scripts.bench_piecewise import build_pair
from scripts.sample_profile import SampleProfiler


def main():
    workers = int(sys.argv[sys.argv.index("--workers") + 1]) if "--workers" in sys.argv else None
    if "--builtin" in sys.argv:
        from draftgraph.models.builtin import builtin_pair

        target, drafter = builtin_pair(device="cuda", attn_impl="triton")
        config = dg.CompileConfig(
            speculation="fixed", device="cuda", progress=False, gpu_memory_utilization=0.0, compile_workers=workers
        )
    else:
        target, drafter = build_pair()
        config = dg.CompileConfig(
            speculation="fixed",
            mode="FULL_AND_PIECEWISE", num_speculative_tokens=4, max_num_seqs=32, max_num_batched_tokens=512,
            max_model_len=1024, device="cuda", progress=False, gpu_memory_utilization=0.0, compile_workers=workers,
        )  # fmt: skip
    profile = "--no-cprofile" not in sys.argv
    prof = cProfile.Profile()
    sampler = SampleProfiler() if "--sample" in sys.argv and not profile else contextlib.nullcontext()
    t0 = time.perf_counter()
    if profile:
        prof.enable()
    with sampler:
        engine = dg.compile_model(target, drafter, config)
    prof.disable()
    torch.cuda.synchronize()
    c = engine.compiled.counters
    print(f"ready in {time.perf_counter() - t0:.1f} s: {engine.warm_up_report}")
    print(f"traces {dict(c.traces)}, Inductor compiles {c.inductor_compiles}, unique pieces {c.unique_pieces}, "
          f"compile workers {c.compile_workers} ({c.compile_worker_failures} failed), warm-up phases "
          f"{ {k: round(v, 1) for k, v in c.warmup_seconds.items()} }")  # fmt: skip
    out = engine.generate([[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]], dg.SamplingParams(max_tokens=16))
    print("tokens", [o.token_ids for o in out])
    for key, s in sorted(c.piece_compile_seconds.items(), key=lambda kv: -kv[1]):
        print(f"  {s:6.2f} s  {key}")
    if isinstance(sampler, SampleProfiler):
        print(sampler.report())
    if not profile:
        return
    if "--dump" in sys.argv:  # the whole profile, for pstats elsewhere
        prof.dump_stats(sys.argv[sys.argv.index("--dump") + 1])
    pstats.Stats(prof).sort_stats("cumulative").print_stats(60)
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
