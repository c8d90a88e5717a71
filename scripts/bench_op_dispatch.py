"""What a custom op call costs before its kernel runs: torch.library.custom_op against draftgraph's registry
(ops/registry.py), for ops with paged attention's signature and with argmax's, each with a trivial body.

Every eager call and every op a piecewise runtime runs between its pieces pays this on the host. Prints the
median microseconds per call (of --repeats runs of --calls calls) of: the body alone, the op through
torch.library.custom_op, the op through the registry; and the ratio.

Usage: python scripts/bench_op_dispatch.py [--device cuda] [--calls 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from draftgraph.ops.registry import custom_op as registry_op


def attention_like(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor, block_tables: torch.Tensor, token_req: torch.Tensor, token_kv_len: torch.Tensor,
    scale: float, window: int, impl: str,
) -> torch.Tensor:  # fmt: skip
    return q.new_empty(q.shape)


def argmax_like(logits: torch.Tensor) -> torch.Tensor:
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


def define(kind: str):
    """(attention op, argmax op) defined by `kind` ("custom_op" or "registry") under a namespace of its own."""
    ns = f"bench_{kind}"
    if kind == "custom_op":
        torch.library.custom_op(f"{ns}::attention", attention_like, mutates_args=("k_cache", "v_cache"))
        torch.library.custom_op(f"{ns}::argmax", argmax_like, mutates_args=())
    else:
        registry_op(f"{ns}::attention", mutates_args=("k_cache", "v_cache"))(attention_like)
        registry_op(f"{ns}::argmax")(argmax_like)
    ops = getattr(torch.ops, ns)
    return ops.attention.default, ops.argmax.default


def per_call_us(fn, calls: int, repeats: int) -> float:
    for _ in range(100):
        fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(runs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device(args.device)
    t, h, d = 4, 8, 64
    q, k, v = torch.zeros(t, h, d, device=dev), torch.zeros(t, 2, d, device=dev), torch.zeros(t, 2, d, device=dev)
    kc, vc = torch.zeros(16, 16, 2, d, device=dev), torch.zeros(16, 16, 2, d, device=dev)
    ints = [torch.zeros(t, dtype=torch.long, device=dev) for _ in range(3)]
    tables = torch.zeros(1, 4, dtype=torch.int32, device=dev)
    attn_args = (q, k, v, kc, vc, ints[0], tables, ints[1], ints[2], 0.125, 0, "triton")
    logits = torch.zeros(4, 1024, device=dev)
    ops = {kind: define(kind) for kind in ("custom_op", "registry")}
    print(f"{torch.__version__}, {args.device}; us per call (median of {args.repeats} x {args.calls} calls)")
    print(f"{'op':>10} | {'body':>6} {'custom_op':>10} {'registry':>9} {'saved':>6} {'ratio':>6}")
    with torch.no_grad():
        for i, (name, body, a) in enumerate(
            (("attention", attention_like, attn_args), ("argmax", argmax_like, (logits,)))
        ):
            us = {"body": per_call_us(lambda f=body, a=a: f(*a), args.calls, args.repeats)}
            for kind, pair in ops.items():
                us[kind] = per_call_us(lambda op=pair[i], a=a: op(*a), args.calls, args.repeats)
            saved = us["custom_op"] - us["registry"]
            print(f"{name:>10} | {us['body']:6.1f} {us['custom_op']:10.1f} {us['registry']:9.1f} {saved:6.1f} "
                  f"{us['custom_op'] / us['registry']:6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
