"""The whole step in FULL mode, one graph against two: the 1B-shaped pair of bench_piecewise.py, bf16, K = 4.

For each batch size B, wall milliseconds of `engine.step()` in steady uniform decode (median), against the
step's bandwidth floor (weights that must be read once per step over the measured device-to-device copy
speed):
* speculative step: target layers + LM head once, then the drafter's layers + LM head K times, plus KV;
* plain decode (no drafter): target layers + LM head, plus KV.

Variants, compiled in this one process and measured side by side:
* `one graph`: CompileConfig(one_graph_step=True), the default: verify, LM head, acceptance and the K
  drafts in one CUDA graph per step;
* `two graphs`: one_graph_step=False: the verify graph, acceptance outside graphs, the fused loop's graph.
Then a profiler pass over steady steps of the one-graph engine: graph replays and kernels outside graphs.

Usage: python scripts/bench_step.py [--sizes 1,8,32,128] [--k 4] [--context 512]
"""

from __future__ import annotations

import argparse
import time

import torch
import triton

import draftgraph as dg
from draftgraph.runtime.profiling import profile_steps
from scripts.bench_full import step_time
from scripts.bench_piecewise import build_pair, copy_bandwidth, layer_bytes, target_layer_bytes
from scripts.profile_step import engine as full_engine


def engine(target, drafter, sizes, k, ctx, one_graph: bool):
    t0 = time.perf_counter()
    eng = full_engine(target, drafter, max(sizes), k, ctx, sizes=sizes, one_graph_step=one_graph)
    name = f"{'spec' if drafter is not None else 'plain'} {'one graph' if one_graph else 'two graphs'}"
    print(f"{name}: ready in {time.perf_counter() - t0:.1f} s  {eng.warm_up_report}", flush=True)
    return eng


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
    engines = {
        (kind, one): engine(target, d, sizes, k, ctx, one)
        for kind, d in (("spec", drafter), ("plain", None))
        for one in (True, False)
    }
    head = target.head_weight.numel() * target.head_weight.element_size()
    t_bytes, d_bytes = target_layer_bytes(target) + head, layer_bytes(drafter) + head
    print(
        f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  copy bandwidth "
        f"{bw / 1e9:.0f} GB/s; context {ctx}, K={k}; target {t_bytes / 2**30:.2f} GiB, drafter step "
        f"{d_bytes / 2**30:.2f} GiB (LM head included); wall ms per step (median)"
    )
    hdr = (
        f"{'B':>4} | {'spec 1 graph':>12} {'2 graphs':>8} {'floor':>6} {'1g/floor':>8} {'2g/1g':>6} | "
        f"{'plain 1 graph':>13} {'2 graphs':>8} {'floor':>6} {'1g/floor':>8} {'2g/1g':>6}"
    )
    print(hdr)
    print("-" * len(hdr))
    for b in sizes:
        kv = 2 * b * ctx * target.cfg.num_kv_heads * target.cfg.head_dim * 2  # K and V of one layer, bf16
        plain_floor = (t_bytes + target.cfg.num_layers * kv) / bw * 1e3
        spec_floor = plain_floor + k * (d_bytes + kv) / bw * 1e3
        t = {key: step_time(e, b, k, ctx)[0] for key, e in engines.items()}
        s1, s2, p1, p2 = t["spec", True], t["spec", False], t["plain", True], t["plain", False]
        print(
            f"{b:>4} | {s1:>12.3f} {s2:>8.3f} {spec_floor:>6.3f} {s1 / spec_floor:>8.2f} {s2 / s1:>6.2f} | "
            f"{p1:>13.3f} {p2:>8.3f} {plain_floor:>6.3f} {p1 / plain_floor:>8.2f} {p2 / p1:>6.2f}"
        )
    for key in (("spec", True), ("plain", True)):
        eng = engines[key]
        print(f"\n{key[0]}, one graph: forwards by artifact {eng.stats()['dispatch']}")
        for i in range(4):
            eng.add_request([1 + i] * 16, dg.SamplingParams(max_tokens=40, ignore_eos=True))
        eng.step()
        eng.step()
        print(profile_steps(eng, 5).format())
        while eng.has_unfinished():
            eng.step()


if __name__ == "__main__":
    main()
