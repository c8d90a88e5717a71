"""Where FULL verify time goes: the kernels of one target verify graph replay (1B-shaped target, B requests
x (1 + K) tokens), by total GPU time, from the profiler. Usage: python scripts/profile_verify.py [--b 1]"""

from __future__ import annotations

import argparse

import torch

import draftgraph as dg
from scripts.bench_full import verify_fn
from scripts.bench_piecewise import build_pair


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    args = ap.parse_args()
    b, k, ctx = args.b, args.k, args.context
    target, drafter = build_pair()
    cfg = dg.CompileConfig(
        speculation="fixed",
        mode="FULL",
        num_speculative_tokens=k,
        max_num_seqs=b,
        max_num_batched_tokens=max(b * (k + 1), 64),
        max_model_len=ctx + 64,
        device="cuda",
        gpu_memory_utilization=0.0,  # a KV cache of max_num_seqs requests, not sized from memory
        progress=False,
        capture_sizes=(b, b * (k + 1)),
        full_capture_sizes=(b,),
    )
    eng = dg.compile_model(target, drafter, cfg)
    fn, runtime = verify_fn(eng, b, k, ctx)
    assert runtime == "FULL"
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90))


if __name__ == "__main__":
    main()
