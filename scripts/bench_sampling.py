"""Sampling probabilities (temperature, top-k, top-p) over a 128k vocabulary, each variant in a CUDA graph:
the Triton kernels (ops/sampling/triton_probs.py, what `_probabilities` runs on CUDA; 4-bit digits, and 8-bit
as a second column), the same sort-free algorithm in torch ops (`probabilities_torch_ops`) and the former sort
(tests/test_sampling.py's oracle). Median replay time (triton do_bench) and the memory the capture took, at N
rows; the last column is the largest difference of the Triton result from the sort's.

Usage: python scripts/bench_sampling.py [--rows 1,5,32,160] [--vocab 128256] [--top-k 50] [--top-p 0.9]
"""

from __future__ import annotations

import argparse

import torch
import triton

from draftgraph.ops.sampling.probs import probabilities_torch_ops
from draftgraph.ops.sampling.triton_probs import probabilities_triton
from tests.test_sampling import sorted_probabilities

VARIANTS = {
    "triton": probabilities_triton,
    "triton-8bit": lambda *x: probabilities_triton(*x, bits=8),
    "torch-ops": probabilities_torch_ops,
    "sort": lambda *x: sorted_probabilities(*x)[0],
}


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
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--top-p", type=float, default=0.9)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  vocab {args.vocab}; temperature 0.8, "
          f"top-k {args.top_k}, top-p {args.top_p}; ms per call (median, graph replay) and capture MiB")  # fmt: skip
    print(f"{'N':>5} | " + " | ".join(f"{name:>11} ms     MiB" for name in VARIANTS) + " | max |triton - sort|")
    for n in (int(x) for x in args.rows.split(",")):
        g = torch.Generator(device="cuda").manual_seed(n)
        logits = (torch.randn(n, args.vocab, device="cuda", generator=g) * 3).to(torch.bfloat16)
        temp = torch.full((n,), 0.8, device="cuda")
        top_k = torch.full((n,), args.top_k, dtype=torch.long, device="cuda")
        top_p = torch.full((n,), args.top_p, device="cuda")
        outs, cells = {}, []
        for name, fn in VARIANTS.items():
            outs[name], ms, mem = graphed(fn, (logits, temp, top_k, top_p))
            cells.append(f"{ms:>14.3f} {mem / 2**20:>7.1f}")
        diff = (outs["triton"] - outs["sort"]).abs().max().item()
        print(f"{n:>5} | " + " | ".join(cells) + f" | {diff:.2e}")


if __name__ == "__main__":
    main()
