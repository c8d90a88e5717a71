"""The step's logits processing and logprobs gather (ops/logits): Triton kernels against the torch ops, at the
verify's shapes (B requests x R rows, a 128k vocabulary, float32 logits), each call captured in a CUDA graph and
timed by replays (CUDA events, median), as the one-graph step runs them; checked against each other first.

* penalties: repetition 1.1 / presence 0.3 / frequency 0.2 and a 3-token logit bias on every request, K = R - 1
  drafts (processing_logits; the floor: logits read and written once, counts and flags read once);
* logprobs: the top 20 and the chosen token's (gather_packed), and torch.topk and torch.logsumexp alone.

Usage: python scripts/bench_logits.py [--vocab 128256] [--shapes 1x5,32x5,1x1,32x1]
"""

from __future__ import annotations

import argparse
import statistics

import torch

import draftgraph as dg
from draftgraph.ops.logits.logprobs import gather_packed
from draftgraph.runtime.penalties import PenaltyState
from scripts.bench_piecewise import copy_bandwidth


class _Req:
    def __init__(self, slot, prompt, output, params):
        self.slot, self.prompt, self.output, self.params, self.stop_ids = slot, prompt, output, params, frozenset()


def graph_us(fn, reps: int = 50) -> float:
    """Median microseconds of one replay of fn captured in a CUDA graph."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def measure(b: int, r: int, v: int, bw: float, g) -> tuple[list[float], float]:
    """Checks (printed when they fail), then us: [penalties torch, triton, floor, logprobs torch, triton, topk,
    logsumexp, floor]."""
    dev = "cuda"
    p = dg.SamplingParams(max_tokens=64, repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2,
                          logit_bias={7: 1.5, 100: -2.0, 5000: 3.0})  # fmt: skip
    pen_t = PenaltyState(b, v, dev, kernel=True)
    reqs = [_Req(i, list(range(i, 512 + i)), list(range(40 + i, 60 + i)), p) for i in range(b)]
    pen_t.admit(reqs)
    pen_r = PenaltyState(b, v, dev, kernel=False)
    pen_r.admit(reqs)
    logits = torch.randn(b, r, v, device=dev, generator=g) * 3
    slots = torch.arange(b, device=dev)
    drafts = torch.randint(0, 600, (b, r - 1), device=dev, generator=g) if r > 1 else None
    ours, ref = pen_t.process(logits, slots, drafts), pen_r.process(logits, slots, drafts)
    if not torch.equal(ours, ref):  # reported, not raised: the timings still come
        diff = (ours - ref).abs().nan_to_num().max().item()
        print(f"  {b}x{r}: penalties differ at {(ours != ref).sum().item()} entries, by at most {diff:.2e}")
    flat = logits.view(b * r, v)
    chosen = torch.randint(0, v, (b * r,), device=dev, generator=g)
    lo, lr = gather_packed(flat, chosen, 20, True), gather_packed(flat, chosen, 20, False)
    n = b * r * 20
    if not torch.equal(lo[:n], lr[:n]):
        print(f"  {b}x{r}: top ids differ in {(lo[:n] != lr[:n]).sum().item()} places")
    err = (lo[n:].view(torch.float64) - lr[n:].view(torch.float64)).abs().max().item()
    t = [
        graph_us(lambda: pen_r.process(logits, slots, drafts)),
        graph_us(lambda: pen_t.process(logits, slots, drafts)),
        (2 * b * r * v * 4 + b * v * 5) / bw * 1e6,
        graph_us(lambda: gather_packed(flat, chosen, 20, False)),
        graph_us(lambda: gather_packed(flat, chosen, 20, True)),
        graph_us(lambda: flat.topk(20, dim=-1)),
        graph_us(lambda: torch.logsumexp(flat, dim=-1)),
        b * r * v * 4 / bw * 1e6,
    ]
    return t, err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--shapes", default="1x5,32x5,1x1,32x1")
    args = ap.parse_args()
    v, dev = args.vocab, "cuda"
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  copy bandwidth {bw / 1e9:.0f} GB/s; V={v}")
    print(f"{'B x R':>7} | {'pen torch':>9} {'pen triton':>10} {'floor':>6} | {'lp torch':>8} {'lp triton':>9} "
          f"{'topk':>6} {'lse':>6} {'floor':>6}   (us)")  # fmt: skip
    g = torch.Generator(device=dev).manual_seed(0)
    for shape in args.shapes.split(","):
        b, r = (int(x) for x in shape.split("x"))
        t, err = measure(b, r, v, bw, g)
        print(f"{shape:>7} | {t[0]:>9.1f} {t[1]:>10.1f} {t[2]:>6.1f} | {t[3]:>8.1f} {t[4]:>9.1f} {t[5]:>6.1f} "
              f"{t[6]:>6.1f} {t[7]:>6.1f}   (max logprob error {err:.1e})", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
