"""Paged attention kernel timings on CUDA: Triton vs the PyTorch reference, decode and verify shapes.

Llama-3.2-1B attention shape (32 query / 8 KV heads, head_dim 64), bf16, block size 16. For each
(batch, context, query length) it prints the median time (CUDA events via triton.testing.do_bench), and
the bandwidth floor: KV bytes read once / measured device-to-device copy bandwidth.
Usage: python scripts/bench_attention.py
"""

from __future__ import annotations

import math

import torch
import triton

import draftgraph.ops.splitting  # noqa: F401  (registers the attention ops)
from draftgraph.runtime.attn_metadata import MetadataBuilder, RequestSlice


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy (bytes read + written)."""
    src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")  # 256 MiB
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def main():
    heads, kv_heads, hd, bs, dtype = 32, 8, 64, 16, torch.bfloat16
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"measured copy bandwidth {bw / 1e9:.0f} GB/s")
    print(f"{'batch':>5} {'ctx':>5} {'qlen':>4} {'triton ms':>10} {'ref ms':>8} {'floor ms':>9} {'triton/floor':>12}")
    for batch, ctx, qlen in [(1, 512, 1), (8, 512, 1), (32, 1024, 1), (128, 1024, 1), (1, 512, 5), (32, 1024, 5)]:
        blocks_per = math.ceil((ctx + qlen) / bs)
        num_blocks = batch * blocks_per
        k_cache = torch.randn(num_blocks, bs, kv_heads, hd, device="cuda", dtype=dtype)
        v_cache = torch.randn_like(k_cache)
        builder = MetadataBuilder(batch * qlen, batch, blocks_per, bs, "cuda")
        reqs = [RequestSlice(list(range(i * blocks_per, (i + 1) * blocks_per)), ctx, qlen) for i in range(batch)]
        meta, _ = builder.build(reqs)
        t = batch * qlen
        q = torch.randn(t, heads, hd, device="cuda", dtype=dtype)
        k = torch.randn(t, kv_heads, hd, device="cuda", dtype=dtype)
        v = torch.randn_like(k)
        times = {}
        args = (
            q,
            k,
            v,
            k_cache,
            v_cache,
            meta.slot_mapping,
            meta.block_tables,
            meta.token_req,
            meta.token_kv_len,
            hd**-0.5,
            0,
        )
        for impl in ("triton", "reference"):
            fn = lambda impl=impl, args=args: torch.ops.draftgraph.paged_attention(*args, impl)
            times[impl] = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        kv_bytes = 2 * batch * (ctx + qlen) * kv_heads * hd * 2
        floor = kv_bytes / bw * 1e3
        print(
            f"{batch:>5} {ctx:>5} {qlen:>4} {times['triton']:>10.4f} {times['reference']:>8.3f} "
            f"{floor:>9.4f} {times['triton'] / floor:>12.1f}"
        )


if __name__ == "__main__":
    main()
