"""Host time of one metadata build (runtime/attn_metadata.py `MetadataBuilder.build`), the host work every step
does once for the target and once for the drafter: request slices from real block tables at several batch sizes
and context lengths, median of repeated timed loops. Host work only (on CUDA the copies are queued, not waited
for), so the CPU numbers stand for the GPU machine's host too.

    python scripts/bench_metadata_build.py [--device cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time

from draftgraph.runtime.attn_metadata import MetadataBuilder, RequestSlice
from draftgraph.runtime.kv_cache import BlockAllocator, BlockTable

CASES = ((1, 512), (1, 8192), (32, 512), (32, 4096), (128, 2048))


def time_build(batch: int, context: int, device: str, k: int = 4, block_size: int = 16, loops: int = 7) -> float:
    """Microseconds per build of `batch` verify requests (1 + k tokens each) after `context` cached tokens."""
    max_blocks = context // block_size + 8
    builder = MetadataBuilder(batch * (k + 1), batch, max_blocks, block_size, device)
    alloc = BlockAllocator(batch * max_blocks)
    tables = []
    for _ in range(batch):
        table = BlockTable(alloc, block_size)
        table.ensure_capacity(context + k + 1)
        tables.append(table)
    slices = [RequestSlice(t.blocks, context, k + 1) for t in tables]
    n = 200
    runs = []
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(n):
            builder.build(slices, num_tokens_padded=batch * (k + 1), num_reqs_padded=batch)
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    print(f"{'batch':>5} {'context':>7} {'us / build':>10}")
    for batch, context in CASES:
        print(f"{batch:5d} {context:7d} {time_build(batch, context, args.device):10.1f}")


if __name__ == "__main__":
    main()
