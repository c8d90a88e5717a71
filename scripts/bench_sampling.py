"""Sampling probabilities (temperature, top-k, top-p) over a 128k vocabulary, each variant in a CUDA graph:
the sort-free threshold search (runtime/sampler.py) against the former sort (tests/test_sampling.py's
oracle). Median replay time (triton do_bench) and the memory the capture took, at N rows.

Usage: python scripts/bench_sampling.py [--rows 1,5,32,160] [--vocab 128256]
"""

from __future__ import annotations

import argparse

import torch
import triton

from draftgraph.runtime.sampler import _probabilities
from tests.test_sampling import sorted_probabilities


def graphed(fn, args):
    fn(*args)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn(*args)
    torch.cuda.synchronize()
    mem = torch.cuda.max_memory_allocated() - before
    ms = triton.testing.do_bench(g.replay, warmup=10, rep=100, return_mode="median")
    return out, ms, mem


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,5,32,160")
    ap.add_argument("--vocab", type=int, default=128256)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  vocab {args.vocab}; temperature 0.8, top-k 50, "
          "top-p 0.9; ms per call (median, graph replay) and capture memory")  # fmt: skip
    print(f"{'N':>5} | {'sort-free ms':>12} {'MiB':>7} | {'sort ms':>8} {'MiB':>7} | {'free/sort':>9} | max |diff|")
    for n in (int(x) for x in args.rows.split(",")):
        g = torch.Generator(device="cuda").manual_seed(n)
        logits = (torch.randn(n, args.vocab, device="cuda", generator=g) * 3).to(torch.bfloat16)
        temp = torch.full((n,), 0.8, device="cuda")
        top_k = torch.full((n,), 50, dtype=torch.long, device="cuda")
        top_p = torch.full((n,), 0.9, device="cuda")
        a, t_free, m_free = graphed(_probabilities, (logits, temp, top_k, top_p))
        b, t_sort, m_sort = graphed(lambda *x: sorted_probabilities(*x)[0], (logits, temp, top_k, top_p))
        diff = (a - b).abs().max().item()
        print(f"{n:>5} | {t_free:>12.3f} {m_free / 2**20:>7.1f} | {t_sort:>8.3f} {m_sort / 2**20:>7.1f} | "
              f"{t_free / t_sort:>9.2f} | {diff:.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
