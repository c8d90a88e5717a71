"""Tensor-parallel decoding: step time against its floor, collective time per step and tok/s at TP 1 and TP N, with
NCCL against the peer-memory all-reduce (CompileConfig.all_reduce "nccl" vs "auto", ops/collectives/peer.py) in
one run; and a sweep of all-reduce latency by message size that the peer-memory rule is read from.

Models (random weights, seeded; no hub):
* `8b`: Llama-3.1-8B's shape (scripts/bench_8b.py), bf16; speculative = its EAGLE-3 head at the published shape
  at vLLM CI's pinned acceptance (0.730 / 0.521 / 0.355 per position, K = 3; synthetic_acceptance).
* `1b`: the realistic-acceptance pair (models/builtin.py LLAMA_1B_ACCEPTANCE: Llama-3.2-1B's shape, a draft model
  of its first 2 layers, about 2.5 of K = 4 drafts accepted for real), bf16.
* `tiny`: a tiny shape of the 8B's structure (smoke test, the CPU with gloo too).

Each row: B requests decoding together at `--context` cached tokens, the median wall time of engine.step() (each
ends in the step's one device-to-host copy), the step's floor (this rank's weights + KV read once over the
measured device-to-device copy speed: layers, LM head; plus K x the drafter's), the GPU time of collective
kernels per step (all-reduce and all-gather kernels, from the profiler over 20 steps at that B), and tok/s
(B x mean accepted length / step). Ranks step in lock-step (SPMD), each on its own engine (scripts/ranks.py), so no
driver round trip is timed.

Usage:
  python scripts/bench_tp.py --model 8b                                   (TP 1)
  torchrun --nproc-per-node 2 scripts/bench_tp.py --model 8b              (TP 2: all_reduce nccl, then auto)
  torchrun --nproc-per-node 2 scripts/bench_tp.py --model 8b --cases plain --sizes 1 \
      --all-reduce auto,auto/unfused,auto/norope             (the defaults, then without the fused all-reduce,
                                                              then without RoPE in the QKV GEMV)
  torchrun --nproc-per-node 2 scripts/bench_tp.py --sweep                 (all-reduce latency by message size)
  torchrun --nproc-per-node 2 scripts/bench_tp.py --model tiny --sizes 1,2  (smoke, CPU: gloo, mode NONE)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

import draftgraph as dg
import draftgraph.ops.launch as launching
from draftgraph.models.builtin import LLAMA_1B_ACCEPTANCE, builtin_hf_target
from draftgraph.ops.choices import OpChoices
from scripts.bench_8b import LLAMA_3_1_8B, TINY, VLLM_CI_K3, conditional, eagle3_8b, hf_8b, measure, steady_profile
from scripts.ranks import inner_engine, join_ranks, rank_env, say

COLLECTIVE_NAMES = ("allreduce", "all_reduce", "allgather", "all_gather")


# ----------------------------------------------------------------------------------------------------------- models
def hf_1b_pair(device):
    """The realistic-acceptance pair as transformers objects on `device`: the target and a model of its first
    draft_layers layers sharing its tensors."""
    import copy

    import transformers

    spec = LLAMA_1B_ACCEPTANCE
    target = builtin_hf_target(spec, device=device, dtype=torch.bfloat16)
    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = spec.draft_layers
    with torch.device("meta"):
        draft = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    draft.load_state_dict(target.state_dict(), strict=False, assign=True)
    draft.tie_weights()
    return target, draft


def model_shape(key: str) -> dict:
    if key == "1b":
        s = LLAMA_1B_ACCEPTANCE
        return dict(hidden_size=s.hidden_size, intermediate_size=s.intermediate_size, num_hidden_layers=s.num_layers,
                    num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim,
                    vocab_size=s.vocab_size, draft_layers=s.draft_layers)  # fmt: skip
    return LLAMA_3_1_8B if key == "8b" else TINY


def layer_bytes(shape: dict, in_features: int | None = None) -> int:
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    i = in_features or h
    return 2 * (i * q + 2 * i * kv + q * h + 3 * h * inter)  # bf16


def floor_bytes(key: str, k: int, b: int, ctx: int, tp: int) -> float:
    """Bytes one rank reads once per step: its share of the target's layers and LM head and of B x ctx tokens'
    KV; with a drafter, K x its share of the drafter's layers, LM head and one token's KV per request."""
    s = model_shape(key)
    h, v, n = s["hidden_size"], s["vocab_size"], s["num_hidden_layers"]
    kv_token_layer = 2 * 2 * s["num_key_value_heads"] * s["head_dim"]  # K and V, bf16
    target = n * layer_bytes(s) + 2 * v * h + n * b * ctx * kv_token_layer
    if not k:
        return target / tp
    if key == "1b":
        d = s["draft_layers"] * (layer_bytes(s) + b * ctx * kv_token_layer) + 2 * v * h
    else:  # EAGLE-3: one layer over 2h inputs, fc 3h -> h, a 32000-row head
        d = layer_bytes(s, 2 * h) + 2 * 3 * h * h + 2 * 32000 * h + b * ctx * kv_token_layer
    return (target + k * d) / tp


# ---------------------------------------------------------------------------------------------------- measurement
def collective_us(engine, k: int, ctx: int, b: int, vocab: int, steps: int = 20, show: bool = False) -> float:
    """GPU time of collective kernels per step (profiler), B requests at ctx cached tokens; `show`: print where
    the GPU time goes (busy vs span, top kernels)."""
    g = torch.Generator().manual_seed(1000 + b)
    prompts = [torch.randint(0, min(vocab, 1000), (ctx,), generator=g).tolist() for _ in range(b)]
    summary = steady_profile(engine, prompts, k, steps)
    if not summary.cuda:
        return float("nan")
    if show:
        say(summary.format_time(12))
    us = sum(t for name, t in summary.kernel_us.items() if any(c in name.lower() for c in COLLECTIVE_NAMES))
    return us / max(summary.steps, 1)


def make_engine(key, case, tp, all_reduce, sizes, ctx, max_tokens, device, mode, models, inductor=None, ops=None):
    """`all_reduce` a CompileConfig.all_reduce value; `inductor`: CompileConfig.inductor_options (None: the
    defaults); `ops`: OpChoices fields set."""
    target, drafter = models
    spec = case == "spec"
    k = (3 if key != "1b" else 4) if spec else 0
    cfg = dg.CompileConfig(
        speculation="fixed",
        mode=mode,
        device=device.type,
        dtype="bfloat16" if device.type == "cuda" else "float32",
        num_speculative_tokens=max(k, 1),
        max_num_seqs=max(sizes),
        max_num_batched_tokens=max(max(sizes) * (k + 1), 2048),
        max_model_len=ctx + max_tokens + 16,
        gpu_memory_utilization=0.0,
        progress=False,
        full_capture_sizes=tuple(sizes) if mode != "NONE" else (),
        synthetic_acceptance=conditional(VLLM_CI_K3) if spec and key != "1b" else (),
        drafter_kind=("eagle3" if key != "1b" else "draft_model") if spec else None,
        tensor_parallel_size=tp,
        all_reduce=all_reduce,
        ops=OpChoices(**ops) if ops else None,
        inductor_options=inductor or None,
    )
    return dg.compile_model(target, drafter if spec else None, cfg), k


def sweep(device, json_path: str = "", only: str = "", reps: int = 20, calls: int = 16) -> None:
    """All-reduce latency by message size (bf16), NCCL vs our push and lamport kernels (a program per 8 KiB, and per
    2 KiB) vs torch's one-shot and two-shot, each `calls` all-reduces captured in one CUDA graph (as in a decode
    step), the median over `reps` replays; checks every kernel's sums against NCCL's (max |diff|; 0 = the same
    bits). `only`: the kernels to time (comma-separated names; all when empty)."""
    import torch.distributed as dist

    from draftgraph.ops.collectives.peer import AllReduceRule, PeerAllReduce

    rank, world, _ = rank_env()
    group = dist.new_group(list(range(world)))
    big = 16 << 20
    forced = {"one_shot": AllReduceRule(big, big, "forced"), "two_shot": AllReduceRule(0, big, "forced")}
    peer = PeerAllReduce.setup(
        group, rank, device.index, {world: AllReduceRule(big, big, "forced", push_max_bytes=big)}
    )
    if peer is None:
        say("peer memory refused (see the log); nothing to sweep")
        return
    kernels = {name: PeerAllReduce(group, peer.buffer, rule) for name, rule in forced.items()}

    def nccl(x):
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    def ours(kind, bytes_per_program):
        return lambda x: peer.push.all_reduce(x, kind, bytes_per_program=bytes_per_program)

    fns = {"nccl": nccl, "push": ours("push", None), "push_2k": ours("push", 2048), "lamport": ours("lamport", None),
           "lamport_2k": ours("lamport", 2048), **{name: p.all_reduce for name, p in kernels.items()}}  # fmt: skip
    if only:  # NCCL always: the sums' reference
        fns = {name: fn for name, fn in fns.items() if name == "nccl" or name in only.split(",")}
    say(f"\nall-reduce sweep, {world} x {torch.cuda.get_device_name()}, bf16, {calls} calls per CUDA graph, median of "
        f"{reps} replays: us per all-reduce")  # fmt: skip
    say(f"{'bytes':>9} | " + " ".join(f"{n:>9}" for n in fns) + " | fastest   | max |diff| vs nccl")
    rows = []
    for nbytes in [2**i for i in range(11, 24)]:  # 2 KiB .. 8 MiB
        x = torch.randn(nbytes // 2, device=device, dtype=torch.bfloat16) * (rank + 1)
        times, diffs, want = {}, {}, None
        for name, fn in fns.items():
            for _ in range(3):
                fn(x)  # warm up (NCCL's communicator, the kernels)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                outs = [fn(x) for _ in range(calls)]
            g.replay()
            torch.cuda.synchronize()
            if name == "nccl":
                want = outs[0].clone()
            diffs[name] = (outs[-1].float() - want.float()).abs().max().item()
            ts = []
            for _ in range(reps):
                dist.barrier(group=group)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                g.replay()
                e1.record()
                e1.synchronize()
                ts.append(e0.elapsed_time(e1) * 1e3 / calls)
            times[name] = statistics.median(ts)
            del g, outs
        best = min(times, key=times.get)
        rows.append(dict(bytes=nbytes, **{f"{n}_us": t for n, t in times.items()}, fastest=best))
        say(f"{nbytes:>9} | " + " ".join(f"{times[n]:>9.2f}" for n in fns) + f" | {best:<9} | "
            + " ".join(f"{n} {d:.2g}" for n, d in diffs.items() if n != "nccl"))  # fmt: skip
    pushed = max([r["bytes"] for r in rows if r["fastest"].startswith(("push", "lamport"))], default=0)
    one = max([r["bytes"] for r in rows if r["fastest"] == "one_shot"], default=0)
    two = max([r["bytes"] for r in rows if r["fastest"] in ("one_shot", "two_shot")], default=0)
    say(f"rule implied for {world} ranks: push / lamport up to {pushed} bytes, one-shot up to {one} bytes, two-shot "
        f"up to {max(one, two)} bytes, NCCL above")  # fmt: skip
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)


DEFAULT_RULE = launching.PDL_RULE


def variant_rule(variant: str) -> tuple[str, launching.PdlRule, tuple, dict]:
    """A variant of --all-reduce: the CompileConfig.all_reduce value, the programmatic-dependent-launch
    rule its engine's kernels launch under (ops/launch.py): the default, or with `/pdlN` level N (e.g. "auto/pdl0":
    off, for an A/B against the default in one run), its Inductor options (`/ipdl`: Inductor's own kernels launch
    with PDL too, torch._inductor.config.triton.enable_pdl) and OpChoices fields turned off (`/norope`:
    rope_in_projection, the input norm, QKV, RoPE and the KV write in one kernel at one row; `/unfused`:
    fuse_all_reduce, the one-row all-reduces inside the GEMVs around them); e.g. "auto/norope/ipdl"."""
    base, *extras = variant.split("/")
    rule, inductor, ops = DEFAULT_RULE, (), {}
    for extra in extras:
        if extra == "ipdl":
            inductor = (("triton.enable_pdl", True),)
        elif extra in ("norope", "unfused"):
            ops["rope_in_projection" if extra == "norope" else "fuse_all_reduce"] = False
        elif extra.startswith("pdl") and extra[3:].isdigit():
            rule = launching.PdlRule(level=int(extra[3:]))
        else:
            raise SystemExit(f"--all-reduce variant {variant!r}: VALUE[/pdlN][/ipdl][/norope][/unfused] (N: 0-3), "
                             "e.g. auto/pdl0")  # fmt: skip
    return base, rule, inductor, ops


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="8b", choices=("8b", "1b", "tiny"))
    ap.add_argument("--cases", default="plain,spec", help="plain and/or spec (the model's drafter), in this order")
    ap.add_argument("--all-reduce", default="nccl,auto", help="the CompileConfig.all_reduce values compared (at TP > 1;"
                    " TP 1: nccl), each optionally /pdlN (the kernels' PDL level), /ipdl (Inductor's "
                    "too), /norope, /unfused (OpChoices.rope_in_projection, fuse_all_reduce off): "
                    "variant_rule")  # fmt: skip
    ap.add_argument("--sizes", default="1,8,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--mode", default="FULL_AND_PIECEWISE")
    ap.add_argument("--sweep", action="store_true", help="all-reduce latency by message size (under torchrun)")
    ap.add_argument("--kernels", default="", help="--sweep: the kernels timed beside NCCL (default: all)")
    ap.add_argument("--json", default="")
    ap.add_argument("--profile", default="", help="batch sizes whose profiled steps are printed (top kernels)")
    args = ap.parse_args()
    device = join_ranks()  # joined once here: the engines built in turn use it (compile_model leaves it up)
    rank, world, _ = rank_env()
    cuda = device.type == "cuda"
    if args.sweep:
        sweep(device, args.json if rank == 0 else "", args.kernels)
        return
    sizes = [int(s) for s in args.sizes.split(",")]
    mode = args.mode if cuda else "NONE"
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    bw = None
    if cuda:
        from scripts.bench_piecewise import copy_bandwidth

        bw = copy_bandwidth()
    t0 = time.perf_counter()
    key = args.model
    if key == "1b":
        models = hf_1b_pair(device)
    else:
        shape = LLAMA_3_1_8B if key == "8b" else TINY
        models = (hf_8b(shape, device), eagle3_8b(shape, 32000 if key == "8b" else 128, device))
    say(f"{world} x {gpu}  torch {torch.__version__}  copy bandwidth {bw / 1e9 if bw else 0:.0f} GB/s; model {key} "
        f"built in {time.perf_counter() - t0:.1f} s; TP {world}, context {args.context}, mode {mode}")  # fmt: skip
    hdr = (f"{'case':<6} {'TP':>2} {'all_reduce':>10} {'B':>3} | {'L':>5} {'step ms':>8} {'floor ms':>8} "
           f"{'x floor':>7} {'coll us':>8} {'tok/s':>9}")  # fmt: skip
    say(hdr + "\n" + "-" * len(hdr))
    rows = []
    vocab = model_shape(key)["vocab_size"]
    profile_sizes = {int(b) for b in args.profile.split(",") if b}
    variants = args.all_reduce.split(",") if world > 1 else [v for v in args.all_reduce.split(",") if "nccl" in v]
    variants = variants or ["nccl"]
    shared = dg.shared_compile_workers() if cuda else contextlib.nullcontext()
    with shared:
        for case in args.cases.split(","):
            for ar in variants:
                t1 = time.perf_counter()
                max_tokens = (args.warm + args.steps + 40) * 5 + 16
                base, rule, inductor, ops = variant_rule(ar)
                launching.PDL_RULE = rule  # (read as kernels launch and graphs capture: this engine's own)
                eng, k = make_engine(
                    key, case, world, base, sizes, args.context, max_tokens, device, mode, models, inductor, ops
                )
                inner = inner_engine(eng)  # a launched rank's own Engine: the ranks step together
                say(f"  ({case}, all_reduce {ar}: engine ready in {time.perf_counter() - t1:.1f} s)")
                for b in sizes:
                    m = measure(inner, b, k, args.context, args.warm, args.steps, vocab)
                    coll = collective_us(inner, k, args.context, b, vocab, show=b in profile_sizes)
                    floor = floor_bytes(key, k, b, args.context, world) / bw * 1e3 if bw else float("nan")
                    row = dict(model=key, case=case, tp=world, all_reduce=ar, batch=b, length=m["length"],
                               step_ms=m["step_ms"], floor_ms=floor, coll_us=coll,
                               tok_s=b * m["length"] / m["step_ms"] * 1e3, gpu=gpu)  # fmt: skip
                    rows.append(row)
                    say(f"{case:<6} {world:>2} {ar:>10} {b:>3} | {m['length']:>5.2f} {m['step_ms']:>8.3f} "
                        f"{floor:>8.3f} {m['step_ms'] / floor:>7.2f} {coll:>8.1f} {row['tok_s']:>9.1f}")  # fmt: skip
                stats = inner.stats()
                say(f"  fallbacks {stats['fallbacks']}; dispatch {dict(list(stats['dispatch'].items())[:6])}")
                eng.close()
                launching.PDL_RULE = DEFAULT_RULE
    if len(variants) > 1:
        for case in args.cases.split(","):
            for b in sizes:
                t = {r["all_reduce"]: r["step_ms"] for r in rows if r["case"] == case and r["batch"] == b}
                if len(t) == len(variants):
                    say(f"{case} B={b}: " + ", ".join(f"{v} {t[v]:.3f} ms" for v in variants)
                        + f"; {variants[0]}/{variants[-1]} = {t[variants[0]] / t[variants[-1]]:.2f}x")  # fmt: skip
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    say(f"total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
