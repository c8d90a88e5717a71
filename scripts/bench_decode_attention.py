"""Decode / verify attention on long contexts (CUDA): the unsplit Triton kernel vs split-KV at each S, vs the floor.

Llama-3.2-1B attention (32 query / 8 KV heads, head_dim 64), bf16, block size 16. Attention only (the KV
write is not timed). Each timed unit is one CUDA graph holding R launches, each over its own copy of the
KV cache (so no launch finds its keys in L2, and launch overhead is amortised); do_bench's median over
replays, divided by R. Floor = K and V bytes read once (every request's context + its query tokens) over
the device-to-device copy bandwidth measured in the same run (bytes read + written per second).

It prints, per (batch, context, query length): the floor, each kernel's time and its ratio to the floor,
the S the rule picks (`choose_num_splits`, its constants in triton_split_kv.SplitKVRule) and the best S
measured: the sweep the rule's constants are calibrated from.
Usage: python scripts/bench_decode_attention.py [--contexts 1024,8192,32768] [--splits 2,4,8,16,32,64]
"""

from __future__ import annotations

import argparse
import math

import torch
import triton

from draftgraph.ops.attention.reference import paged_attention_reference
from draftgraph.ops.attention.triton_attention import attend_triton
from draftgraph.ops.attention.triton_split_kv import DEFAULT_SPLIT_KV_RULE, choose_num_splits
from draftgraph.ops.backends import device_sm_count
from draftgraph.runtime.attn_metadata import MetadataBuilder, RequestSlice

HEADS, KV_HEADS, HEAD_DIM, BLOCK, DTYPE = 32, 8, 64, 16, torch.bfloat16
MAX_COPIES_BYTES = 8 << 30  # KV copies in one graph: at most 16, at most this many bytes


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy (bytes read + written)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


class Case:
    """R copies of one batch's KV cache and metadata: `batch` requests of `ctx` cached keys, `qlen` queries."""

    def __init__(self, batch: int, ctx: int, qlen: int):
        self.batch, self.ctx, self.qlen = batch, ctx, qlen
        self.blocks_per_req = math.ceil((ctx + qlen) / BLOCK)  # the table width an engine at max_model_len ctx has
        per_copy = batch * self.blocks_per_req
        self.kv_bytes = 2 * batch * (ctx + qlen) * KV_HEADS * HEAD_DIM * DTYPE.itemsize
        self.copies = max(1, min(16, MAX_COPIES_BYTES // (2 * per_copy * BLOCK * KV_HEADS * HEAD_DIM * 2)))
        shape = (self.copies * per_copy, BLOCK, KV_HEADS, HEAD_DIM)
        self.k_cache = torch.randn(shape, device="cuda", dtype=DTYPE)
        self.v_cache = torch.randn(shape, device="cuda", dtype=DTYPE)
        t = batch * qlen
        self.q = torch.randn(t, HEADS, HEAD_DIM, device="cuda", dtype=DTYPE)
        self.metas = []
        for c in range(self.copies):
            builder = MetadataBuilder(t, batch, self.blocks_per_req, BLOCK, "cuda")
            tables = torch.arange(c * per_copy, (c + 1) * per_copy).view(batch, self.blocks_per_req).tolist()
            self.metas.append(builder.build([RequestSlice(table, ctx, qlen) for table in tables])[0])
        self._ref = None

    def attend(self, meta, num_splits: int):
        args = (meta.block_tables, meta.token_req, meta.token_kv_len, HEAD_DIM**-0.5, 0)
        return attend_triton(self.q, self.k_cache, self.v_cache, *args, num_splits=num_splits)

    def check(self, num_splits: int) -> None:
        """Each kernel against the reference once (bf16 tolerance), so a fast wrong kernel cannot win."""
        meta = self.metas[0]
        if self._ref is None:
            kv = self.q.new_zeros(self.q.shape[0], KV_HEADS, HEAD_DIM)
            no_write = torch.full_like(meta.slot_mapping, -1)
            self._ref = paged_attention_reference(self.q, kv, kv, self.k_cache, self.v_cache, no_write,
                                                  meta.block_tables, meta.token_req, meta.token_kv_len,
                                                  HEAD_DIM**-0.5, 0).float()  # fmt: skip
        torch.testing.assert_close(self.attend(meta, num_splits).float(), self._ref, atol=2e-2, rtol=0)

    def time_us(self, num_splits: int) -> float:
        self.attend(self.metas[0], num_splits)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for meta in self.metas:
                self.attend(meta, num_splits)
        ms = triton.testing.do_bench(graph.replay, warmup=25, rep=200, return_mode="median")
        return ms * 1e3 / self.copies


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="8192", help="comma-separated cached keys per request")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--qlens", default="1,5", help="query tokens per request (5 = verify with K = 4)")
    parser.add_argument("--splits", default="2,4,8,16,32,64", help="S values of the split kernel to time")
    args = parser.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    splits = ints(args.splits)
    bw = copy_bandwidth()
    sms = device_sm_count(torch.device("cuda"))
    print(f"device {torch.cuda.get_device_name()} ({sms} SMs)  torch {torch.__version__}  triton {triton.__version__}")
    print(f"measured copy bandwidth {bw / 1e9:.0f} GB/s; rule {DEFAULT_SPLIT_KV_RULE}")
    print("times in us per call (x = ratio to the KV-read floor); S=1 is the unsplit kernel")
    head = f"{'batch':>5} {'ctx':>6} {'qlen':>4} {'floor':>7} " + " ".join(f"{'S=' + str(s):>15}" for s in [1, *splits])
    print(head + f" {'rule S':>6} {'best S':>6} {'rule/best':>9}")
    for ctx in ints(args.contexts):
        for qlen in ints(args.qlens):
            for batch in ints(args.batches):
                case = Case(batch, ctx, qlen)
                floor = case.kv_bytes / bw * 1e6
                times = {}
                for s in [1, *splits]:
                    case.check(s)
                    times[s] = case.time_us(s)
                rule = choose_num_splits(batch * qlen, KV_HEADS, case.blocks_per_req * BLOCK, sms)
                if rule not in times:
                    case.check(rule)
                    times[rule] = case.time_us(rule)
                best = min(times, key=times.get)
                cells = " ".join(f"{times[s]:>7.1f} ({times[s] / floor:>4.1f}x)" for s in [1, *splits])
                print(f"{batch:>5} {ctx:>6} {qlen:>4} {floor:>7.1f} {cells} {rule:>6} {best:>6} "
                      f"{times[rule] / times[best]:>9.2f}")  # fmt: skip
                del case
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
