"""Where the Triton race (ops/sampling/triton_race.py) and race_reference disagree on CUDA: for each mismatching
row, both tokens, their p / -log(u) values as the reference computes them, the same with float64 logs, and the
Triton race forced into one stage (chunk = V) and into many splits.

Usage: python scripts/diag_race.py [--rows 1,8,32,128,256] [--vocab 128256]
"""

from __future__ import annotations

import argparse

import torch

from draftgraph.ops.sampling.noise import race_reference, uniform_noise
from draftgraph.ops.sampling.triton_race import race_triton


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,32,128,256")
    ap.add_argument("--vocab", type=int, default=128256)
    args = ap.parse_args()
    for n in [int(r) for r in args.rows.split(",")]:
        torch.manual_seed(0)
        probs = torch.softmax(torch.randn(n, args.vocab, device="cuda"), -1)
        seeds, pos = torch.arange(n, device="cuda"), torch.arange(n, device="cuda") + 100
        for salt in (7, 0x1B873593):
            ref = race_reference(probs, seeds, pos, salt)
            tri = race_triton(probs, seeds, pos, salt)
            one = race_triton(probs, seeds, pos, salt, chunk=args.vocab)
            many = race_triton(probs, seeds, pos, salt, chunk=1024)
            bad = (ref != tri).nonzero().flatten().tolist()
            print(
                f"rows {n} salt {salt:#x}: {len(bad)} rows differ (default); one stage differs in "
                f"{int((ref != one).sum())}, 1024-column splits in {int((ref != many).sum())}"
            )
            if not bad:
                continue
            u = uniform_noise(seeds, pos, salt, args.vocab)
            r32 = probs / -torch.log(u)
            r64 = probs.double() / -torch.log(u.double())
            for row in bad[:5]:
                a, b = int(ref[row]), int(tri[row])
                print(
                    f"  row {row}: ref {a} ({r32[row, a].item():.9g}, f64 {r64[row, a].item():.12g}) triton {b} "
                    f"({r32[row, b].item():.9g}, f64 {r64[row, b].item():.12g}); u {u[row, a].item():.9g} / "
                    f"{u[row, b].item():.9g}; p {probs[row, a].item():.9g} / {probs[row, b].item():.9g}; "
                    f"one stage {int(one[row])}, splits {int(many[row])}"
                )


if __name__ == "__main__":
    main()
