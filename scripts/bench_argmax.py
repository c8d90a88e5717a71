"""Row argmax over a 128k vocabulary (CUDA): draftgraph's argmax_rows vs torch.argmax vs torch.compile'd argmax.

Each timed unit is one CUDA graph holding R = 20 calls, each on its own copy of the logits (fewer copies when
20 would pass --max-copy-gib; small inputs still sit in L2, as logits fresh from the LM head do); the median
of many replays (CUDA events) divided by R. Floor = the logits' bytes (N * V * itemsize) read once over the
device-to-device copy bandwidth measured in the same run (bytes read + written per second). Every variant's
answer is checked against torch.argmax first (equal indices), so a fast wrong kernel cannot win.

It prints per (dtype, rows): the floor, each variant's time and its ratio to the floor, and the chunks per
row (S) the rule picks. `--programs-per-sm 2,8` adds columns for argmax_rows under other ArgmaxRule targets
(the sweep the rule's constant comes from).
Usage: python scripts/bench_argmax.py [--rows 1,5,32,160,640] [--vocab 128256] [--programs-per-sm 2,8]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton

from draftgraph.ops.backends import device_sm_count
from draftgraph.ops.sampling.triton_argmax import (
    DEFAULT_ARGMAX_RULE,
    ArgmaxRule,
    argmax_triton,
    choose_chunk,
)

CALLS = 20  # calls per graph


def copy_bandwidth() -> float:
    """Bytes per second of a large device-to-device copy (bytes read + written)."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def graph_us(fn, inputs: list[torch.Tensor], replays: int) -> float:
    """Median us per call of fn over `inputs`, CALLS calls (cycling the inputs) captured in one graph."""
    for x in inputs:
        fn(x)  # compile / autotune outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            fn(inputs[i % len(inputs)])
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    del graph
    return statistics.median(times)


def make_variants(rules: list[float]) -> dict:
    """The variants timed; a fresh Dynamo cache each time, so no case meets the recompile limit."""
    torch._dynamo.reset()
    variants = {
        "argmax_rows": lambda x: torch.ops.draftgraph.argmax_rows(x),
        "torch.argmax": lambda x: x.argmax(-1),
        "compiled": torch.compile(lambda x: x.argmax(-1), dynamic=False),  # Inductor's reduction
    }
    for p in rules:
        rule = ArgmaxRule(programs_per_sm=p)
        variants[f"rows@{p:g}/SM"] = lambda x, rule=rule: argmax_triton(x, rule=rule)
    return variants


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,5,32,160,640", help="comma-separated row counts N")
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--programs-per-sm", default="", help="extra ArgmaxRule targets to time (e.g. 2,8)")
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--max-copy-gib", type=float, default=8.0, help="memory for the input copies of one case")
    args = parser.parse_args()
    sms = device_sm_count(torch.device("cuda"))
    bw = copy_bandwidth()
    rules = [float(p) for p in args.programs_per_sm.split(",") if p]
    print(f"device {torch.cuda.get_device_name()} ({sms} SMs)  torch {torch.__version__}  triton {triton.__version__}")
    print(f"measured copy bandwidth {bw / 1e9:.0f} GB/s; rule {DEFAULT_ARGMAX_RULE}; {CALLS} calls per graph")
    print("times in us per call (x = ratio to the read floor); S = chunks per row the rule picks (1: one stage)")
    print(f"{'dtype':>8} {'rows':>5} {'S':>4} {'floor':>7} " + " ".join(f"{n:>17}" for n in make_variants(rules)))
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        for rows in [int(n) for n in args.rows.split(",")]:
            nbytes = rows * args.vocab * dtype.itemsize
            copies = max(1, min(CALLS, int(args.max_copy_gib * 2**30 // nbytes)))
            inputs = [torch.randn(rows, args.vocab, device="cuda").to(dtype) for _ in range(copies)]
            inputs[0][:, args.vocab // 2] = inputs[0][:, 7] = 100.0  # a tie across chunks: 7 must win
            want = inputs[0].argmax(-1)
            variants = make_variants(rules)
            for name, fn in variants.items():
                got = fn(inputs[0])
                if not torch.equal(got, want):
                    raise AssertionError(f"{name} disagrees with torch.argmax at {dtype}, {rows} rows")
            floor = nbytes / bw * 1e6
            times = {name: graph_us(fn, inputs, args.replays) for name, fn in variants.items()}
            splits = triton.cdiv(args.vocab, choose_chunk(rows, args.vocab, sms))
            cells = " ".join(f"{t:>8.2f} ({t / floor:>5.1f}x)" for t in times.values())
            print(f"{str(dtype).removeprefix('torch.'):>8} {rows:>5} {splits:>4} {floor:>7.2f} {cells}")
            del inputs
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
