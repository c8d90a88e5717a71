"""Few-row linear layers (CUDA): draftgraph's Triton GEMV (ops/linear/triton_gemv.py) against cuBLAS (F.linear).

The 1B-shaped model's projections (bench_full.py's pair: hidden 2048, 32/8 heads of 128, MLP 8192, vocabulary
128256) at the row counts a decode or verify step has. Each timed unit is one CUDA graph of 20 calls cycling
over enough copies of the weight to pass --l2-mib (a layer's weight is never in L2 when the step reaches it);
the median of --replays replays (CUDA events), per call. Floor = the weight's bytes over the device-to-device
copy bandwidth measured in the same run (bytes read + written per second). Every variant's output is checked
against F.linear first.

Prints per (shape, rows): the floor, cuBLAS, the config `choose_config` picks, and the best config of the sweep
(its name: block_n x block_k / warps / stages). `--sweep` prints every config's time.
Usage: python scripts/bench_gemv.py [--set 1b|8b|8b_tp2] [--rows 1,2,4,5,8,16] [--sweep] [--replays 100]
       python scripts/bench_gemv.py --fused   (one row's fused prologues against their separate kernels)
       python scripts/bench_gemv.py --pdl --set 8b_tp2   (a decode step's one-row kernels with and without
                                                           programmatic dependent launch)

`--pdl`: the one-row kernels of `--layers` layers of the set's model in one CUDA graph, each layer as a decode step
runs them (the norm in qkv, o, the norm in gate_up, the activation in down: 4 launches a layer, every layer its own
weights, so nothing is in L2), captured once as launched today and once with programmatic dependent launch (Hopper:
each kernel launched with launch_pdl starts while the one before ends, waits for it in `pdl_wait` before any
load, and releases the next after its last load: ops/linear/triton_gemv.py). Medians of --replays replays of each
graph, alternated; the weights' floor beside them. Outputs equal between the two (checked).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics

import torch
import torch.nn.functional as F
import triton

from draftgraph.ops.linear.triton_gemv import GemvConfig, choose_config, gemv_triton
from scripts.bench_argmax import CALLS, copy_bandwidth, graph_us  # 20 calls per graph, cycling the inputs

SHAPE_SETS = {  # name: {projection: (N, K) of the weight [N, K]}
    # the 1B-shaped model (bench_full.py's pair)
    "1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
           "lm_head": (128256, 2048)},
    # the 8B-shaped model (bench_8b.py) on one GPU, and one rank's share at TP 2 (column-parallel qkv / gate_up
    # halve N, row-parallel o / down halve K)
    "8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "8b_tp2": {"qkv": (3072, 4096), "o": (4096, 2048), "gate_up": (14336, 4096), "down": (4096, 7168)},
}  # fmt: skip


def sweep_configs(rows: int) -> list[GemvConfig]:
    """One row: the GEMV kernel's tilings; more: the tensor-core kernel's (block_n x block_k / warps / stages)."""
    if rows == 1:
        return [GemvConfig(bn, bk, nw) for bn, bk, nw in itertools.product((2, 4, 8), (512, 1024, 2048), (4, 8))]
    return [GemvConfig(bn, bk, nw, ns)
            for bn, bk, nw, ns in itertools.product((16, 32, 64), (64, 128, 256), (4,), (3, 4, 6))]  # fmt: skip


def name(c: GemvConfig) -> str:
    return f"{c.block_n}x{c.block_k}/{c.num_warps}/{c.num_stages}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,5,8,16")
    parser.add_argument("--set", default="1b", choices=sorted(SHAPE_SETS), help="the model whose projections are timed")
    parser.add_argument("--shapes", default="", help="projections of the set (default: all)")
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--l2-mib", type=int, default=256, help="weights cycled per graph: at least this many MiB")
    parser.add_argument("--sweep", action="store_true", help="print every config's time")
    parser.add_argument("--fused", action="store_true",
                        help="instead: one row's fused prologues (the pre-norm in qkv / gate_up, the SwiGLU activation "
                        "in down) against their separate kernels, per column block")  # fmt: skip
    parser.add_argument("--pdl", action="store_true", help="instead: a layer chain with and without programmatic "
                        "dependent launch (module docstring)")  # fmt: skip
    parser.add_argument("--layers", type=int, default=32, help="--pdl: layers in the chain")
    args = parser.parse_args()
    if args.fused:
        return fused_prologues(args)
    if args.pdl:
        return pdl_chain(args)
    bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device {torch.cuda.get_device_name()} ({sms} SMs)  torch {torch.__version__}  triton {triton.__version__}")
    print(f"measured copy bandwidth {bw / 1e9:.0f} GB/s; bf16; us per call (x = ratio to the weight-read floor)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'shape':>8} {'rows':>4} {'floor':>6} {'cuBLAS':>15} {'chosen':>15} {'best':>15} {'best config':>12}")
    shapes = SHAPE_SETS[args.set]
    for shape in args.shapes.split(",") if args.shapes else shapes:
        if shape not in shapes:
            raise SystemExit(f"--shapes: {shape!r} is not a projection of set {args.set!r} ({', '.join(shapes)})")
        n, k = shapes[shape]
        nbytes = n * k * 2
        copies = max(1, min(CALLS, -(-args.l2_mib * 2**20 // nbytes)))
        weights = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        floor = nbytes / bw * 1e6
        for rows in [int(r) for r in args.rows.split(",")]:
            x = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
            want = F.linear(x, weights[0]).float()
            configs = sweep_configs(rows)
            for c in configs:
                got = gemv_triton(x, weights[0], None, c).float()
                err = (got - want).abs().max().item()
                if err > 2e-2 * want.abs().max().item() + 1e-3:
                    raise AssertionError(f"{shape} rows {rows} config {name(c)}: max error {err}")
            t_cublas = graph_us(lambda w, x=x: F.linear(x, w), weights, args.replays)
            chosen = choose_config(rows, k)
            t_chosen = graph_us(lambda w, x=x, c=chosen: gemv_triton(x, w, None, c), weights, args.replays)
            times = {name(c): graph_us(lambda w, x=x, c=c: gemv_triton(x, w, None, c), weights, args.replays)
                     for c in configs}  # fmt: skip
            best = min(times, key=times.get)

            def cell(t, floor=floor):
                return f"{t:7.2f} ({t / floor:4.2f}x)"

            print(f"{shape:>8} {rows:>4} {floor:6.2f} {cell(t_cublas):>15} {cell(t_chosen):>15} "
                  f"{cell(times[best]):>15} {best:>12}")  # fmt: skip
            if args.sweep:
                print("         " + "  ".join(f"{k_}:{v:.2f}" for k_, v in sorted(times.items(), key=lambda kv: kv[1])))
        del weights
        torch.cuda.empty_cache()


def fused_prologues(args) -> None:
    """One row: add_rms_norm then the GEMV against the norm inside it (qkv, gate_up), silu * up then the GEMV
    against the activation inside it (down), each at 2-16 columns per program; us per call, CUDA graphs as above."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"device {torch.cuda.get_device_name()} ({sms} SMs); one row, bf16, us per call")
    print(f"{'shape':>8} {'separate':>9} " + " ".join(f"{'fused/' + str(b):>9}" for b in FUSED_BLOCKS))
    for shape in ("qkv", "gate_up", "down"):
        separate, fused = _fused_times(SHAPE_SETS[args.set][shape], shape == "down", args)
        print(f"{shape:>8} {separate:>9.2f} " + " ".join(f"{t:>9.2f}" for t in fused))


FUSED_BLOCKS = (2, 4, 8, 16)


def _fused_times(nk: tuple[int, int], down: bool, args) -> tuple[float, list[float]]:
    from draftgraph.ops.linear.triton_gemv import add_rms_norm_gemv_triton, silu_mul_gemv_triton, silu_mul_triton
    from draftgraph.ops.norm.triton_rms_norm import rms_norm_triton

    gen = torch.Generator(device="cuda").manual_seed(0)
    n, k = nk
    copies = max(1, min(CALLS, -(-args.l2_mib * 2**20 // (n * k * 2))))
    weights = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    one = choose_config(1, k)
    if down:
        gu = torch.randn(1, 2 * k, device="cuda", generator=gen, dtype=torch.bfloat16)

        def separate(w):
            return gemv_triton(silu_mul_triton(gu), w, None, one)

        def fused(w, b):
            return silu_mul_gemv_triton(gu, w, None, GemvConfig(b, one.block_k, 8))
    else:
        x, r = (torch.randn(1, k, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
        nw = torch.ones(k, device="cuda", dtype=torch.bfloat16)

        def separate(w):
            return gemv_triton(rms_norm_triton(x, r, nw, 1e-6)[1], w, None, one)

        def fused(w, b):
            return add_rms_norm_gemv_triton(x, r, nw, 1e-6, w, None, GemvConfig(b, one.block_k, 8))

    times = [graph_us(functools.partial(fused, b=b), weights, args.replays) for b in FUSED_BLOCKS]
    return graph_us(separate, weights, args.replays), times


def pdl_chain(args) -> None:
    from draftgraph.ops.linear.triton_gemv import add_rms_norm_gemv_triton, silu_mul_gemv_triton

    shapes, gen = SHAPE_SETS[args.set], torch.Generator(device="cuda").manual_seed(0)
    hidden = shapes["qkv"][1]
    layers = [{p: torch.randn(*shapes[p], device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
               for p in ("qkv", "o", "gate_up", "down")} for _ in range(args.layers)]  # fmt: skip
    nbytes = sum(w.numel() * 2 for layer in layers for w in layer.values())
    x = torch.randn(1, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
    nw = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
    o_in = torch.randn(1, shapes["o"][1], device="cuda", generator=gen, dtype=torch.bfloat16)
    cfg = {p: choose_config(1, shapes[p][1], silu_mul=p == "down", norm=p in ("qkv", "gate_up")) for p in shapes}

    def chain(pdl: int) -> torch.Tensor:
        h, r = x, torch.zeros_like(x)
        for w in layers:  # (a layer's real inputs where the shapes chain; o takes a fixed row: attention's stand-in)
            r, _qkv = add_rms_norm_gemv_triton(h, r, nw, 1e-6, w["qkv"], None, cfg["qkv"], pdl=pdl)
            h = gemv_triton(o_in, w["o"], None, cfg["o"], pdl=pdl)
            r, gu = add_rms_norm_gemv_triton(h, r, nw, 1e-6, w["gate_up"], None, cfg["gate_up"], pdl=pdl)
            h = silu_mul_gemv_triton(gu, w["down"], None, cfg["down"], pdl=pdl)
        return h

    levels = (0, 1, 2, 3)
    want = chain(0)
    for level in levels[1:]:
        got = chain(level)
        torch.cuda.synchronize()
        if not torch.equal(want, got):
            raise AssertionError(f"PDL {level} changed the chain's output: max difference {(want - got).abs().max()}")
    graphs = {}
    for level in levels:
        chain(level)
        torch.cuda.synchronize()
        graphs[level] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[level]):
            chain(level)
    times = {level: [] for level in levels}
    for _ in range(5):
        for g in graphs.values():
            g.replay()
    for _ in range(args.replays):
        for level, g in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times[level].append(start.elapsed_time(end) * 1e3)
    bw = copy_bandwidth()
    floor = nbytes / bw * 1e6
    med = {level: statistics.median(t) for level, t in times.items()}
    launches = 4 * args.layers
    print(
        f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}; set "
        f"{args.set}, {args.layers} layers, {launches} one-row launches, {nbytes / 1e9:.2f} GB of weights; floor "
        f"(weights / copy bandwidth {bw / 1e9:.0f} GB/s) {floor:.1f} us; medians of {args.replays} replays each"
    )
    names = {0: "as launched today", 1: "PDL: wait first", 2: "PDL: first weight chunk, then wait",
             3: "PDL: release at once, first weight chunk, then wait"}  # fmt: skip
    for level, t in med.items():
        print(f"  {names[level]:>52}: {t:8.1f} us ({t / floor:.3f}x floor), {(med[0] - t) / launches:+.2f} us a launch")


if __name__ == "__main__":
    main()
