"""The fused draft loop (one Dynamo trace of the drafter's K steps per variant) against the loop run around the
compiled drafter step (`CompileConfig(fuse_draft_loop=False)`), both inside the one-graph step of FULL modes.

1. Cold start, each variant in a fresh process with empty Inductor and Triton caches, interleaved `--repeats`
   times: seconds to a ready engine, the warm-up phases (forwards, draft loops, waiting for the compile workers),
   Dynamo traces, Inductor compiles and graphs captured. `--pair builtin` (as `draftgraph generate --device
   cuda` configures it) or `1b` (bench_piecewise.py's 1B-shaped pair, K = 4, up to 32 requests).
2. Steady uniform decode of the 1B-shaped pair (`--steps`), both engines in one process: median wall ms of
   `engine.step()` at each batch size, measured alternately, and whether both generate the same tokens.

Usage: python scripts/bench_fuse_loop.py [--pair builtin,1b] [--repeats 2] [--sizes 1,8,32] [--no-steps]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

VARIANTS = {"fused": True, "unfused": False}  # name -> fuse_draft_loop


def pair_for(pair: str):
    if pair == "builtin":
        from draftgraph.models.builtin import builtin_pair

        return builtin_pair(device="cuda", attn_impl="triton")
    from scripts.bench_piecewise import build_pair

    return build_pair()


def config_for(pair: str, fuse: bool, sizes=(1, 8, 32)):
    import draftgraph as dg

    if pair == "builtin":  # as `draftgraph generate --device cuda` configures it
        return dg.CompileConfig(
            speculation="fixed", device="cuda", progress=False, gpu_memory_utilization=0.0, fuse_draft_loop=fuse
        )
    return dg.CompileConfig(
        speculation="fixed", mode="FULL_AND_PIECEWISE", num_speculative_tokens=4, max_num_seqs=max(32, *sizes),
        max_num_batched_tokens=512, max_model_len=1024, device="cuda", progress=False,
        gpu_memory_utilization=0.0, fuse_draft_loop=fuse,
    )  # fmt: skip


def child_build(pair: str, fuse: bool) -> None:
    import torch

    import draftgraph as dg

    target, drafter = pair_for(pair)
    cfg = config_for(pair, fuse)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    eng = dg.compile_model(target, drafter, cfg)
    torch.cuda.synchronize()
    ready = time.perf_counter() - t0
    c = eng.compiled.counters
    out = {
        "ready_s": round(ready, 2),
        "phases": {k: round(v, 2) for k, v in c.warmup_seconds.items()},
        "traces": dict(c.traces),
        "inductor_compiles": c.inductor_compiles,
        "graphs": c.graphs_captured,
        "graph_mib": round(c.graph_memory_bytes / 2**20),
        "pool": {k: (c.compile_pool or {}).get(k) for k in ("ready_s", "waited_s", "last_done_s")},
    }
    print("RESULT " + json.dumps(out), flush=True)


def child_steps(sizes: list[int]) -> None:
    import torch

    import draftgraph as dg
    from scripts.bench_full import step_time

    engines = {}
    target, drafter = pair_for("1b")  # one pair of models for both engines
    for name, fuse in VARIANTS.items():
        t0 = time.perf_counter()
        engines[name] = dg.compile_model(target, drafter, config_for("1b", fuse, sizes))
        print(f"{name}: built in {time.perf_counter() - t0:.1f} s ({engines[name].warm_up_report})", flush=True)
    prompts = [[1 + i, 5, 9, 17, 33, 65][: 3 + i % 3] for i in range(8)]
    params = dg.SamplingParams(max_tokens=24, ignore_eos=True)
    tokens = {n: [o.token_ids for o in e.generate(prompts, params)] for n, e in engines.items()}
    print(f"greedy tokens equal (8 requests x 24): {tokens['fused'] == tokens['unfused']}")
    print(f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}; engine.step() wall ms, median of 3 alternating"
          f" rounds of 30 steps (context 512, K = 4)")  # fmt: skip
    print(f"{'B':>4} | {'fused':>8} {'unfused':>8} {'unfused/fused':>13} | accept")
    for b in sizes:
        times = {n: [] for n in engines}
        acc = None
        for _ in range(3):
            for n, e in engines.items():
                t, acc = step_time(e, b, 4, 512)
                times[n].append(t)
        f, u = statistics.median(times["fused"]), statistics.median(times["unfused"])
        print(f"{b:>4} | {f:>8.3f} {u:>8.3f} {u / f:>13.3f} | {acc:.3f}", flush=True)
        for n, e in engines.items():
            hits = e.stats()["dispatch"]
            assert any(k.startswith("step/") for k in hits), (n, hits)  # the one-graph step ran


def run_child(args: list[str], timeout: float) -> str:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(), TRITON_CACHE_DIR=tempfile.mkdtemp())
    env["PYTHONPATH"] = os.getcwd()
    p = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        print(p.stdout[-3000:], p.stderr[-3000:])
        raise SystemExit(f"child {args} failed with {p.returncode}")
    return p.stdout


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", default="builtin,1b")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sizes", default="1,8,32")
    ap.add_argument("--no-steps", action="store_true")
    ap.add_argument("--child", choices=["build", "steps"])
    ap.add_argument("--fuse", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=240.0)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.child == "build":
        return child_build(args.pair, bool(args.fuse))
    if args.child == "steps":
        return child_steps(sizes)
    for pair in args.pair.split(","):
        results = {n: [] for n in VARIANTS}
        for _ in range(args.repeats):
            for name, fuse in VARIANTS.items():
                out = run_child(["--child", "build", "--pair", pair, "--fuse", str(int(fuse))], args.timeout)
                r = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
                results[name].append(r)
                print(f"{pair} {name}: {json.dumps(r)}", flush=True)
        for name, rs in results.items():
            print(f"{pair} {name}: ready median {statistics.median(r['ready_s'] for r in rs):.2f} s "
                  f"({', '.join(str(r['ready_s']) for r in rs)})")  # fmt: skip
    if not args.no_steps:
        print(run_child(["--child", "steps", "--sizes", args.sizes], 2 * args.timeout), flush=True)


if __name__ == "__main__":
    main()
