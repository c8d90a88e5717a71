"""Target verify and the drafter's K steps: eager vs PIECEWISE vs FULL (whole-forward CUDA graphs), on the
Llama-3.2-1B-shaped target with an EAGLE head (see bench_piecewise.py for the models), K = 4, bf16.

Verify: B requests x (1 + K) tokens at `--context` cached tokens. Draft: K steps of B rows (step 1 on B
rows here, as in later steps; forward, logits over the full vocabulary, argmax, on-device advance). FULL
draft steps are K separate full-graph replays (the fused one-graph loop is not built yet). Bandwidth floor
beside each row; medians of CUDA-event timings.
Usage: python scripts/bench_full.py [--sizes 1,8,32,128] [--k 4] [--context 512]
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import triton

import draftgraph as dg
from draftgraph.runtime.attn_metadata import RequestSlice
from draftgraph.runtime.dispatcher import BatchDescriptor
from scripts.bench_piecewise import build_pair, copy_bandwidth, layer_bytes


def verify_fn(engine, b, k, ctx):
    r = engine.runner
    bs, q = r.shape.block_size, k + 1
    per = math.ceil((ctx + 2 * k + 2) / bs)
    slices = [RequestSlice(list(range(i * per, (i + 1) * per)), ctx, q) for i in range(b)]
    d = r.dispatcher.dispatch(BatchDescriptor(b * q, b, q))
    meta, pos = r.target_meta.build(slices, num_tokens_padded=d.num_tokens, num_reqs_padded=d.num_reqs)
    ids = torch.randint(0, 1000, (d.num_tokens,), device="cuda")
    return lambda: r.forwards.target(d, ids, pos, meta), d.runtime


def draft_fn(engine, b, k, ctx):
    r = engine.runner
    bs = r.shape.block_size
    per = math.ceil((ctx + 2 * k + 2) / bs)
    tables = torch.zeros(b, engine.config.max_blocks_per_req, device="cuda", dtype=torch.int32)  # engine width
    tables[:, :per] = torch.arange(b * per, device="cuda", dtype=torch.int32).view(b, per)
    d = r.dispatcher.dispatch(BatchDescriptor(b, b, 1))
    hidden = torch.randn(d.num_tokens, 2048, device="cuda", dtype=torch.bfloat16)
    base = torch.full((b,), ctx, device="cuda", dtype=torch.long)
    toks0 = torch.randint(0, 1000, (d.num_tokens,), device="cuda")

    def run():
        h, toks = hidden, toks0
        for step in range(k):
            pos, meta = r._advance(tables, base + step, d.num_tokens, d.num_reqs)
            nh, lh = r.forwards.drafter(d, toks, pos, h, meta)
            t = r.drafter.compute_logits(lh[:b]).argmax(-1)
            toks = torch.cat([t, t.new_zeros(d.num_tokens - b)])
            h = nh
        return toks

    return run, d.runtime


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
    max_b = max(sizes)
    base = dict(
        num_speculative_tokens=k,
        max_num_seqs=max_b,
        max_num_batched_tokens=max_b * (k + 1),
        max_model_len=ctx + 64,
        device="cuda",
        progress=False,
        capture_sizes=tuple(sorted({s * q for s in sizes for q in (1, k + 1)})),
        full_capture_sizes=tuple(sizes),
    )
    engines = {}
    for name, mode in (("eager", "NONE"), ("piecewise", "PIECEWISE"), ("full", "FULL")):
        t0 = time.perf_counter()
        engines[name] = dg.compile_model(target, drafter, dg.CompileConfig(mode=mode, **base))
        print(f"{name}: ready in {time.perf_counter() - t0:.1f} s  {engines[name].warm_up_report}")
    t_bytes = layer_bytes(target) - target.head_weight.numel() * 2
    d_bytes, head = layer_bytes(drafter), target.head_weight.numel() * 2
    print(
        f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  copy bandwidth "
        f"{bw / 1e9:.0f} GB/s; context {ctx}, K={k}; milliseconds (median)"
    )
    hdr = (
        f"{'B':>4} | {'verify eager':>12} {'piecewise':>9} {'FULL':>7} {'floor':>6} {'FULL/floor':>10} | "
        f"{'K drafts eager':>14} {'piecewise':>9} {'FULL xK':>7} {'floor':>6} {'FULL/floor':>10}"
    )
    print(hdr)
    print("-" * len(hdr))
    for b in sizes:
        kv = 2 * b * ctx * 8 * 64 * 2
        t_floor = (t_bytes + 16 * kv) / bw * 1e3
        d_floor = k * (d_bytes + head + kv) / bw * 1e3
        rows = {}
        for name in ("eager", "piecewise", "full"):
            fv, rv = verify_fn(engines[name], b, k, ctx)
            fd, rd = draft_fn(engines[name], b, k, ctx)
            rows[name] = (
                triton.testing.do_bench(fv, warmup=10, rep=60, return_mode="median"),
                triton.testing.do_bench(fd, warmup=10, rep=60, return_mode="median"),
                rv,
                rd,
            )
        assert rows["full"][2] == "FULL" and rows["full"][3] == "FULL", rows["full"]
        e, p, f = rows["eager"], rows["piecewise"], rows["full"]
        print(
            f"{b:>4} | {e[0]:>12.3f} {p[0]:>9.3f} {f[0]:>7.3f} {t_floor:>6.3f} {f[0] / t_floor:>10.2f} | "
            f"{e[1]:>14.3f} {p[1]:>9.3f} {f[1]:>7.3f} {d_floor:>6.3f} {f[1] / d_floor:>10.2f}"
        )
    c = engines["full"].compiled.counters
    print(
        f"\nFULL engine: graphs captured {c.graphs_captured}, replays {sum(c.graph_replays.values())}, "
        f"compiled runs without graph {sum(c.compiled_runs.values())}"
    )


if __name__ == "__main__":
    main()
