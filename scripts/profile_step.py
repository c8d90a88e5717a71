"""Where a steady FULL step's GPU time goes: per-kernel time, busy share, and matmul efficiency at small M.

1. The 1B-shaped pair of bench_piecewise.py (bf16, FULL, one graph per step): plain decode and the K = 4
   speculative step at the given batch sizes, profiled over steady steps: GPU kernel time per step, the span
   from first kernel start to last kernel end (idle gaps inside the graph show as busy < 100 %), and the
   top kernels by time.
2. F.linear at the pair's shapes for M = 1, 5, 8 rows (cuBLAS through aten, as Inductor's extern mm calls
   it): microseconds and achieved bandwidth against the measured copy speed.

Usage: python scripts/profile_step.py [--sizes 1,32] [--k 4] [--context 512] [--kinds plain,spec]
       [--variants default,addmm] (Inductor settings of scripts/bench_inductor_options.py, profiled one after the
       other) [--no-linear]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

import draftgraph as dg
from draftgraph.runtime.profiling import profile_steps
from scripts.bench_piecewise import build_pair, copy_bandwidth


def engine(target, drafter, b, k, ctx, inductor_options=None, sizes=None, tokenizer=None, **over):
    """A FULL-mode CUDA engine graphing batch sizes `sizes` (default: b alone); `over`: more CompileConfig
    fields (scripts/bench_step.py: one_graph_step); `tokenizer`: the engine's (bench_step's json variant)."""
    sizes = tuple(sizes) if sizes else (b,)
    max_b = max(sizes)
    cfg = dg.CompileConfig(
        speculation="fixed",
        mode="FULL",
        num_speculative_tokens=k if drafter is not None else 0,
        max_num_seqs=max_b,
        max_num_batched_tokens=max(max_b * (k + 1), 2048),
        max_model_len=ctx + 96,
        device="cuda",
        gpu_memory_utilization=0.0,
        progress=False,
        full_capture_sizes=sizes,
        inductor_options=inductor_options,
        **over,
    )
    return dg.compile_model(target, drafter, cfg, tokenizer=tokenizer)


def profile(eng, b, ctx, steps=10):
    g = torch.Generator().manual_seed(b)
    for _ in range(b):
        prompt = torch.randint(0, 1000, (ctx,), generator=g).tolist()
        eng.add_request(prompt, dg.SamplingParams(max_tokens=steps + 12, ignore_eos=True))
    while any(r.prefilling for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(3):
        eng.step()
    s = profile_steps(eng, steps)
    while eng.has_unfinished():
        eng.step()
    return s


def time_us(fn, reps=200) -> float:
    for _ in range(10):
        fn()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        start[i].record()
        fn()
        end[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(start, end)) * 1e3


def linear_table(target, bw):
    c = target.cfg
    shapes = {
        "qkv": ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
        "o_proj": (c.hidden_size, c.num_heads * c.head_dim),
        "gate_up": (2 * c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
        "lm_head": (c.vocab_size, c.hidden_size),
    }
    print(f"\nF.linear, bf16, cuBLAS (median of 200, CUDA events); bandwidth against copy {bw / 1e9:.0f} GB/s")
    print(f"{'weight':>8} {'shape':>14} | " + " | ".join(f"M={m:<2} us   GB/s  eff" for m in (1, 5, 8)))
    for name, (n, kdim) in shapes.items():
        w = torch.randn(n, kdim, device="cuda", dtype=torch.bfloat16)
        row = []
        for m in (1, 5, 8):
            x = torch.randn(m, kdim, device="cuda", dtype=torch.bfloat16)
            us = time_us(lambda x=x, w=w: F.linear(x, w))
            gbs = w.numel() * 2 / us / 1e3
            row.append(f"{us:8.2f} {gbs:6.0f} {gbs * 1e9 / bw:4.0%}")
        print(f"{name:>8} {str((n, kdim)):>14} | " + " | ".join(row))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,32")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--kinds", default="plain,spec")
    ap.add_argument("--variants", default="default")
    ap.add_argument("--no-linear", action="store_true")
    args = ap.parse_args()
    from scripts.bench_inductor_options import VARIANTS

    target, drafter = build_pair()
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    kinds = {"plain": None, "spec": drafter}
    for b in [int(s) for s in args.sizes.split(",")]:
        for name in args.kinds.split(","):
            for variant in args.variants.split(","):
                eng = engine(target, kinds[name], b, args.k, args.context, inductor_options=VARIANTS[variant])
                s = profile(eng, b, args.context)
                print(f"\n== {name} B={b} ({variant}): {s.graph_launches / max(s.steps, 1):.0f} graph launches/step")
                print(s.format_time(25))
                del eng
                torch.cuda.empty_cache()
    if not args.no_linear:
        linear_table(target, bw)


if __name__ == "__main__":
    main()
