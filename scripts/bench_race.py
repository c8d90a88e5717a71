"""The exponential race (a sampled token draw) as torch ops against the Triton race (ops/sampling/triton_race.py).

1. The draw alone at the 1B pair's vocabulary (128256): microseconds per call (median of CUDA-event timings)
   and the memory the call allocates beyond its input (the [N, V] noise temporaries the torch ops make).
2. The speculative step of the 1B-shaped pair (bench_piecewise.py's, FULL, one graph per step, K = 4) with
   every request sampling (temperature 0.8): graph memory and median wall ms of engine.step(), with the torch ops
   (CompileConfig(ops=OpChoices(race_sampler=False))) and with the kernel (the default), both engines built in
   this process.

Usage: python scripts/bench_race.py [--rows 1,8,32,128] [--sizes 1,32] [--k 4] [--context 512]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import draftgraph as dg
from draftgraph.ops.choices import OpChoices
from draftgraph.ops.sampling.noise import race_reference
from draftgraph.ops.sampling.triton_race import race_triton
from scripts.bench_piecewise import build_pair
from scripts.profile_step import engine as full_engine
from scripts.profile_step import time_us


def draw_table(vocab: int, rows: list[int]) -> None:
    print(f"\nthe draw alone, V = {vocab}: us per call (median of 200) and MiB allocated beyond the probabilities")
    print(f"{'rows':>5} | {'torch ops':>9} {'MiB':>7} | {'Triton':>7} {'MiB':>7} | {'speedup':>7}")
    for n in rows:
        probs = torch.softmax(torch.randn(n, vocab, device="cuda"), -1)
        seeds = torch.arange(n, device="cuda")
        pos = torch.arange(n, device="cuda") + 100
        out = {}
        for name, fn in (("torch", race_reference), ("triton", race_triton)):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fn(probs, seeds, pos, 0x1B873593)
            torch.cuda.synchronize()
            mib = (torch.cuda.max_memory_allocated() - base) / 2**20
            us = time_us(lambda fn=fn, a=(probs, seeds, pos): fn(*a, 0x1B873593))
            out[name] = (us, mib)
        assert torch.equal(race_reference(probs, seeds, pos, 7), race_triton(probs, seeds, pos, 7))
        (tu, tm), (ku, km) = out["torch"], out["triton"]
        print(f"{n:>5} | {tu:9.1f} {tm:7.1f} | {ku:7.1f} {km:7.1f} | {tu / ku:7.2f}")


def sampled_step_ms(eng, b: int, ctx: int, steps: int = 30) -> float:
    g = torch.Generator().manual_seed(b)
    for _ in range(b):
        prompt = torch.randint(0, 1000, (ctx,), generator=g).tolist()
        eng.add_request(prompt, dg.SamplingParams(max_tokens=steps + 12, temperature=0.8, ignore_eos=True))
    while any(r.prefilling for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(3):
        eng.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append((time.perf_counter() - t0) * 1e3)
    while eng.has_unfinished():
        eng.step()
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32,128")
    ap.add_argument("--sizes", default="1,32")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args()
    target, drafter = build_pair()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    draw_table(target.cfg.vocab_size, [int(r) for r in args.rows.split(",")])
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"\nsampled speculative step (temperature 0.8), FULL one graph, K={args.k}, sizes {sizes}")
    for flag in (False, True):
        ops = OpChoices(race_sampler=flag)  # a runtime choice: the models are the same
        eng = full_engine(target, drafter, max(sizes), args.k, args.context, sizes=sizes, ops=ops)
        mem = eng.stats()["compile"]["graph_memory_bytes"] / 2**20
        row = " ".join(f"B={b}: {sampled_step_ms(eng, b, args.context):.3f} ms" for b in sizes)
        print(f"  race_sampler={int(flag)}: graph memory {mem:.0f} MiB; {row}", flush=True)
        del eng
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
