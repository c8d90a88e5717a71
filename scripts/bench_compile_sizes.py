"""Symbolic-size compile against per-size compiles: step time side by side in one run.

The 1B-shaped pair of bench_piecewise.py (EAGLE head), bf16, K = 4, FULL_AND_PIECEWISE, built twice:
- "symbolic": the default, one Inductor compile per unique piece with the token count symbolic, every CUDA
  graph captured from that code;
- "per_size": `compile_sizes` = every graphed token count (b x 1 and b x (1 + K) for each batch size b),
  so every graph runs code specialised to its size (the pre-#16 behaviour).
For each batch size: FULL verify and the fused K-step draft loop (CUDA-event medians, triton do_bench), and
the whole speculative step (wall median of engine.step() in steady decode), with symbolic / per-size ratios.
Both builds and mode NONE generate the same prompts; their tokens are compared.

Usage: python scripts/bench_compile_sizes.py [--sizes 1,8,32] [--k 4] [--context 512]
"""

from __future__ import annotations

import argparse
import time

import torch
import triton

import draftgraph as dg
from scripts.bench_full import step_time, timed, verify_fn
from scripts.bench_piecewise import Bench, build_pair


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,8,32")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    k, ctx = args.k, args.context
    target, drafter = build_pair()
    graphed = tuple(sorted({s * q for s in sizes for q in (1, k + 1)}))
    base = dict(
        mode="FULL_AND_PIECEWISE",
        num_speculative_tokens=k,
        max_num_seqs=max(sizes),
        max_num_batched_tokens=max(max(sizes) * (k + 1), 512),
        max_model_len=ctx + 64,
        device="cuda",
        progress=False,
        gpu_memory_utilization=0.0,  # a KV cache of max_num_seqs requests, not sized from memory
        capture_sizes=graphed,
        full_capture_sizes=tuple(sizes),
    )
    builds = {"symbolic": {}, "per_size": {"compile_sizes": graphed}, "none": {"mode": "NONE"}}
    engines = {}
    for name, extra in builds.items():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engines[name] = dg.compile_model(target, drafter, dg.CompileConfig(speculation="fixed", **{**base, **extra}))
        c = engines[name].compiled.counters if engines[name].compiled else None
        print(
            f"{name}: ready in {time.perf_counter() - t0:.1f} s, "
            f"{c.inductor_compiles if c else 0} Inductor compiles; {engines[name].warm_up_report}"
        )
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (int(n),), generator=g).tolist() for n in (17, 60, 5, 33, 90, 2, 41, 8)]
    params = dg.SamplingParams(max_tokens=32, ignore_eos=True)
    tokens = {name: [o.token_ids for o in e.generate(prompts, params)] for name, e in engines.items()}
    print(
        f"tokens equal: symbolic == per_size {tokens['symbolic'] == tokens['per_size']}, "
        f"symbolic == NONE {tokens['symbolic'] == tokens['none']}"
    )
    print(
        f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}; context {ctx}, "
        f"K={k}; milliseconds (median); ratio = symbolic / per_size"
    )
    hdr = f"{'B':>4} | {'part':<24} {'symbolic':>9} {'per_size':>9} {'ratio':>6}"
    print(hdr)
    print("-" * len(hdr))
    worst = 0.0
    for b in sizes:
        rows = {}
        for name in ("symbolic", "per_size"):
            fn, runtime = verify_fn(engines[name], b, k, ctx)
            assert runtime == "FULL", runtime
            rows.setdefault("FULL verify", {})[name] = timed(fn)
            rows.setdefault("fused draft loop (K)", {})[name] = timed(Bench(engines[name], ctx, k).draft_steps(b))
            rows.setdefault("whole step (wall)", {})[name] = step_time(engines[name], b, k, ctx)[0]
        for part, v in rows.items():
            ratio = v["symbolic"] / v["per_size"]
            worst = max(worst, ratio)
            print(f"{b:>4} | {part:<24} {v['symbolic']:>9.3f} {v['per_size']:>9.3f} {ratio:>6.3f}")
    for name in ("symbolic", "per_size"):
        s = engines[name].stats()
        print(f"{name}: fallbacks {s['fallbacks']}")
    print(f"worst ratio {worst:.3f} ({'within' if worst <= 1.05 else 'OVER'} 5 %)")


if __name__ == "__main__":
    main()
