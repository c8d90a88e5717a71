"""FULL mode on the Llama-3.2-1B-shaped target with an EAGLE head (models: bench_piecewise.py), K = 4, bf16.

Three measurements per batch size B, each against its bandwidth floor (bytes that must be read once over
the measured device-to-device copy bandwidth) and as a ratio to it:

1. Target verify, B requests x (1 + K) tokens at `--context` cached tokens: eager vs PIECEWISE vs FULL.
2. The drafter's K steps as the engine runs them (Proposer.run_loop; first step over the verify rows):
   eager vs K PIECEWISE replays vs K separate FULL graphs (fusing off) vs the fused one-graph loop.
3. The whole speculative step (engine.step(): metadata, verify, rejection sampling, proposal, the one
   host copy), wall time per step in steady decode, eager vs PIECEWISE vs FULL (fused).

Medians: CUDA-event timings (triton do_bench) for 1 and 2, wall clock of synchronous steps for 3.
Usage: python scripts/bench_full.py [--sizes 1,8,32,128] [--k 4] [--context 512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import triton

import draftgraph as dg
from draftgraph.runtime.attn_metadata import RequestSlice
from draftgraph.runtime.dispatcher import BatchDescriptor
from scripts.bench_piecewise import Bench, build_pair, copy_bandwidth, layer_bytes, target_layer_bytes

MODES = {
    "eager": dict(mode="NONE"),
    "piecewise": dict(mode="PIECEWISE"),
    "full_steps": dict(mode="FULL", fuse_draft_loop=False),
    "full": dict(mode="FULL", fuse_draft_loop=True),
}


def compile_engines(target, drafter, modes, sizes, k, ctx, min_batched_tokens) -> dict:
    """One CUDA engine per entry of `modes` (name -> CompileConfig fields), each capturing every batch size
    in `sizes` at 1 and k + 1 rows per request; prints how long each took to be ready."""
    max_b = max(sizes)
    base = dict(
        num_speculative_tokens=k,
        max_num_seqs=max_b,
        max_num_batched_tokens=max(max_b * (k + 1), min_batched_tokens),
        max_model_len=ctx + 64,
        device="cuda",
        gpu_memory_utilization=0.0,  # a KV cache of max_num_seqs requests, not sized from memory
        progress=False,
        capture_sizes=tuple(sorted({s * q for s in sizes for q in (1, k + 1)})),
        full_capture_sizes=tuple(sizes),
    )
    engines = {}
    for name, extra in modes.items():
        t0 = time.perf_counter()
        engines[name] = dg.compile_model(target, drafter, dg.CompileConfig(speculation="fixed", **base, **extra))
        print(f"{name}: ready in {time.perf_counter() - t0:.1f} s  {engines[name].warm_up_report}")
    return engines


def timed(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=80, return_mode="median")


def verify_batch(engine, b, k, ctx):
    """A uniform verify batch (b requests of k + 1 rows after ctx cached tokens), dispatched and padded as
    the engine would: (dispatch, input ids, positions, metadata)."""
    r = engine.runner
    per = -(-(ctx + 2 * k + 2) // r.shape.block_size)
    q = k + 1
    slices = [RequestSlice(list(range(i * per, (i + 1) * per)), ctx, q) for i in range(b)]
    d = r.dispatcher.dispatch(BatchDescriptor(b * q, b, q))
    meta, pos = r.target_meta.build(slices, num_tokens_padded=d.num_tokens, num_reqs_padded=d.num_reqs)
    ids = torch.randint(0, 1000, (d.num_tokens,), device="cuda")
    return d, ids, pos, meta


def verify_fn(engine, b, k, ctx):
    d, ids, pos, meta = verify_batch(engine, b, k, ctx)
    return lambda: engine.runner.forwards.target(d, ids, pos, meta), d.runtime


def step_time(engine, b, k, ctx, steps=30, params: dict | None = None) -> tuple[float, float]:
    """Median wall ms of engine.step() over `steps` uniform decode steps of b requests; acceptance. `params`: more
    SamplingParams fields for every request (penalties, logprobs)."""
    g = torch.Generator().manual_seed(b)
    for _ in range(b):
        prompt = torch.randint(0, 1000, (ctx,), generator=g).tolist()
        engine.add_request(prompt, dg.SamplingParams(max_tokens=steps + 12, ignore_eos=True, **(params or {})))
    sched = engine.scheduler
    while any(r.prefilling for r in sched.running) or sched.waiting:
        engine.step()  # prefill
    for _ in range(3):
        engine.step()  # warm
    before = engine.stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()  # ends with the step's one device-to-host copy (a sync)
        times.append((time.perf_counter() - t0) * 1e3)
    after = engine.stats()
    acc = (after["accepted_tokens"] - before["accepted_tokens"]) / max(
        1, after["draft_tokens"] - before["draft_tokens"]
    )
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times), acc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,8,32,128")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    k, ctx = args.k, args.context
    target, drafter = build_pair()
    bw = copy_bandwidth()
    engines = compile_engines(target, drafter, MODES, sizes, k, ctx, min_batched_tokens=2048)
    t_bytes = target_layer_bytes(target)
    d_bytes, head = layer_bytes(drafter), target.head_weight.numel() * 2
    print(
        f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  copy bandwidth "
        f"{bw / 1e9:.0f} GB/s; context {ctx}, K={k}; milliseconds (median)"
    )
    hdr = (
        f"{'B':>4} | {'verify eager':>12} {'piecewise':>9} {'FULL':>7} {'floor':>6} {'FULL/fl':>7} | "
        f"{'K drafts eager':>14} {'pw xK':>7} {'FULL xK':>7} {'fused':>7} {'floor':>6} {'fused/fl':>8} "
        f"{'pw/fused':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    for b in sizes:
        kv = 2 * b * ctx * 8 * 64 * 2  # K and V of one layer, bf16
        t_floor = (t_bytes + 16 * kv) / bw * 1e3
        d_floor = (k * (d_bytes + head + kv)) / bw * 1e3
        v, dr = {}, {}
        for name in ("eager", "piecewise", "full"):
            fn, runtime = verify_fn(engines[name], b, k, ctx)
            v[name] = timed(fn)
            if name == "full":
                assert runtime == "FULL", runtime
        for name in MODES:
            dr[name] = timed(Bench(engines[name], ctx, k).draft_steps(b))
        print(
            f"{b:>4} | {v['eager']:>12.3f} {v['piecewise']:>9.3f} {v['full']:>7.3f} {t_floor:>6.3f} "
            f"{v['full'] / t_floor:>7.2f} | {dr['eager']:>14.3f} {dr['piecewise']:>7.3f} {dr['full_steps']:>7.3f} "
            f"{dr['full']:>7.3f} {d_floor:>6.3f} {dr['full'] / d_floor:>8.2f} {dr['piecewise'] / dr['full']:>8.2f}"
        )
    hits = engines["full"].stats()["dispatch"]
    assert any("/loop/" in key for key in hits), hits  # the fused loop ran
    print("\nwhole speculative step (engine.step, wall ms, steady decode; floor = verify floor + K-draft floor)")
    hdr = f"{'B':>4} | {'eager':>8} {'piecewise':>9} {'FULL':>8} {'floor':>6} {'FULL/fl':>7} {'pw/FULL':>7} | accept"
    print(hdr)
    print("-" * len(hdr))
    for b in sizes:
        kv = 2 * b * ctx * 8 * 64 * 2
        floor = ((t_bytes + 16 * kv) + k * (d_bytes + head + kv)) / bw * 1e3
        st = {name: step_time(engines[name], b, k, ctx) for name in ("eager", "piecewise", "full")}
        e, p, f = st["eager"][0], st["piecewise"][0], st["full"][0]
        print(
            f"{b:>4} | {e:>8.2f} {p:>9.2f} {f:>8.2f} {floor:>6.2f} {f / floor:>7.2f} {p / f:>7.2f} | "
            f"{st['full'][1]:.3f}"
        )
    s = engines["full"].stats()
    print(f"\nFULL engine: fallbacks {s['fallbacks']}, forwards by artifact {s['dispatch']}")


if __name__ == "__main__":
    main()
