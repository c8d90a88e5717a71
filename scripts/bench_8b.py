"""Llama-3.1-8B's shape with an EAGLE-3 head at its published shape, at PINNED ACCEPTANCE (no hub here: a
random-weight head accepts nothing, so CompileConfig.synthetic_acceptance draws the accept decision; every
other part of the step, its graphs and kernels, runs as with real acceptance, so step times are real).

Target: hidden 4096, 32 layers, 32 query / 8 KV heads (head_dim 128), intermediate 14336, vocabulary 128256,
RoPE llama3 (theta 500000, factor 8), untied LM head; bf16, seeded random weights built on the device.
Drafter: EAGLE-3 as published for Llama-3.1-8B (config.json LlamaForCausalLMEagle3, draft_vocab_size 32000):
fc over three target layers (3 x 4096 -> 4096), one decoder layer over [norm(emb); norm(hidden)] (q/k/v read
8192), its LM head over 32000 draft tokens mapped to target ids through d2t on the device; the target's
embedding. TP 1, or TP N under torchrun (scripts/ranks.py: each rank builds the models as modules and loads its
share into its own engine, the ranks step in lock-step; rank 0 prints, and the floor is one rank's share).

Pinned rates (conditional: rate_i = P(draft i accepted | drafts 0..i-1 accepted)); the mean acceptance
length (tokens per request per step) is L = 1 + sum_i prod_{j<=i} rate_j:
* `vLLM CI`: vLLM pins EAGLE-3 on MT-Bench at K = 3 with per-position acceptance 0.730 / 0.521 / 0.355
  (tests/v1/spec_decode/test_acceptance_length.py). Those are unconditional (P(position i accepted)), so the
  conditional rates are their ratios: 0.730, 0.521 / 0.730 = 0.714, 0.355 / 0.521 = 0.681, and
  L = 1 + 0.730 + 0.521 + 0.355 = 2.606.
* `vllm#20780`: measured lengths 2.36 / 2.79 / 3.08 / 3.32 at K = 2..5. Per-position rates are not
  published; each K here takes one constant conditional rate r (geometric: P(i accepted) = r^(i+1)), solved
  so that 1 + r + ... + r^K equals the length (r = 0.769, 0.763, 0.755, 0.754).
* `plain`: the target alone (no drafter), the baseline.

For each case and batch B (requests decoding together at `--context` cached tokens): the step's wall time
(median of `--steps` engine.step() calls, each ending in the step's one device-to-host copy, after warm-up
steps; overlapped steps, the default), the mean acceptance length measured over those steps (a check on the
pinning: over 30 steps at B = 1 it scatters by ~0.2), tok/s = B x L / step and TPOT = step / L (ms per output
token of one request) with L the pinned length (the step's shape, so its time, does not depend on which drafts
were accepted), and the step's bandwidth floor: the bytes
it must read once (target layers + its LM head + KV; plus K x (the head's layer, fc and 32000-row LM head +
its KV)) over the measured device-to-device copy speed, as scripts/bench_step.py computes it.

Usage: python scripts/bench_8b.py [--sizes 1,8,32,64] [--cases plain,vllm_ci_k3,...] [--context 512]
       torchrun --nproc-per-node 2 scripts/bench_8b.py [...]   (TP 2)
       python scripts/bench_8b.py --tiny   (smoke test: a tiny shape on the CPU, mode NONE; under torchrun: gloo)
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time

import torch

import draftgraph as dg
from draftgraph.compiler.config import expected_acceptance_length
from draftgraph.models.builtin import module_from_state_dict
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.config import ModelConfig
from draftgraph.models.drafters import load_drafter
from draftgraph.ops.choices import OpChoices
from scripts.ranks import inner_engine, join_ranks, rank_env, say

LLAMA_3_1_8B = dict(
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    rope_parameters=dict(
        rope_type="llama3",
        rope_theta=500000.0,
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    ),  # fmt: skip
)
TINY = dict(LLAMA_3_1_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048)  # fmt: skip
DRAFT_VOCAB = {"8b": 32000, "tiny": 128}

VLLM_CI_K3 = (0.730, 0.521, 0.355)  # per-position (unconditional) acceptance, vLLM's CI for EAGLE-3 at K = 3
VLLM_20780 = {2: 2.36, 3: 2.79, 4: 3.08, 5: 3.32}  # measured mean acceptance lengths, K = 2..5


def conditional(per_position: tuple[float, ...]) -> tuple[float, ...]:
    """P(position i accepted) -> P(i accepted | 0..i-1 accepted): ratios of consecutive entries."""
    prev = (1.0, *per_position[:-1])
    return tuple(a / b for a, b in zip(per_position, prev, strict=True))


def geometric(k: int, length: float) -> tuple[float, ...]:
    """K copies of the constant conditional rate r with 1 + r + ... + r^K = length (bisection)."""
    if not 1.0 <= length <= k + 1:
        raise ValueError(f"a mean acceptance length of {length} is impossible at K={k} (range [1, {k + 1}])")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_acceptance_length((mid,) * k) < length else (lo, mid)
    return ((lo + hi) / 2,) * k


CASES = {  # name: (label, K, conditional rates)
    "plain": ("plain (no drafter)", 0, ()),
    "vllm_ci_k3": ("vLLM CI 0.730/0.521/0.355", 3, conditional(VLLM_CI_K3)),
    **{f"pr20780_k{k}": (f"vllm#20780 L={length}", k, geometric(k, length)) for k, length in VLLM_20780.items()},
}


def random_weights(names_shapes: dict, device, gen, std=0.02) -> dict:
    """bf16 (or the shape's dtype) normal weights on the device; 1-D norm weights are ones."""
    out = {}
    for name, shape in names_shapes.items():
        if len(shape) == 1:
            out[name] = torch.ones(shape, device=device, dtype=torch.bfloat16)
        else:
            out[name] = torch.randn(shape, device=device, dtype=torch.bfloat16, generator=gen).mul_(std)
    return out


def layer_shapes(prefix: str, h: int, inter: int, q: int, kv: int, in_features: int) -> dict:
    return {
        prefix + "self_attn.q_proj.weight": (q, in_features),
        prefix + "self_attn.k_proj.weight": (kv, in_features),
        prefix + "self_attn.v_proj.weight": (kv, in_features),
        prefix + "self_attn.o_proj.weight": (h, q),
        prefix + "mlp.gate_proj.weight": (inter, h),
        prefix + "mlp.up_proj.weight": (inter, h),
        prefix + "mlp.down_proj.weight": (h, inter),
        prefix + "input_layernorm.weight": (h,),
        prefix + "post_attention_layernorm.weight": (h,),
    }


def target_state(shape: dict, device) -> dict:
    """The target's transformers-named state dict of seeded random weights, made on the device."""
    h, inter, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for i in range(shape["num_hidden_layers"]):
        shapes.update(layer_shapes(f"model.layers.{i}.", h, inter, q, kv, h))
    gen = torch.Generator(device=device).manual_seed(0)
    state = random_weights(shapes, device, gen)
    state["model.embed_tokens.weight"].mul_(50)  # embeddings of RMS ~1, as trained ones are
    return state


def build_target(shape: dict, device, attn_impl: str) -> CausalLM:
    """The target (TP 1) from target_state."""
    cfg = ModelConfig.from_hf(shape, dtype=torch.bfloat16)
    return CausalLM.from_state_dict(cfg, target_state(shape, device), device, attn_impl)


def hf_8b(shape: dict, device) -> torch.nn.Module:
    """The target as a module of target_state's weights carrying its config (at TP N each rank takes its share
    when the engine loads it)."""
    holder = module_from_state_dict(target_state(shape, device))
    holder.config = dict(shape)
    return holder


def eagle3_config(shape: dict, draft_vocab: int) -> dict:
    """config.json of the published EAGLE-3 head for Llama-3.1-8B (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B's keys)."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": shape["hidden_size"],
        "intermediate_size": shape["intermediate_size"],
        "num_attention_heads": shape["num_attention_heads"],
        "num_key_value_heads": shape["num_key_value_heads"],
        "num_hidden_layers": 1,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "vocab_size": shape["vocab_size"],
        "draft_vocab_size": draft_vocab,
    }


def eagle3_8b(shape: dict, draft_vocab: int, device) -> torch.nn.Module:
    """EAGLE-3 at the published layout (midlayer.*, fc, norm, lm_head over the draft vocabulary, d2t, t2d; the
    target's embedding), random weights, as a module carrying the published config."""
    h, inter, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    shapes = layer_shapes("midlayer.", h, inter, q, kv, 2 * h)
    shapes.update({"midlayer.hidden_norm.weight": (h,), "fc.weight": (h, 3 * h), "norm.weight": (h,),
                   "lm_head.weight": (draft_vocab, h)})  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(1)
    state = random_weights(shapes, device, gen)
    kept = torch.randperm(v, generator=torch.Generator().manual_seed(2))[:draft_vocab].sort().values
    state["d2t"] = (kept - torch.arange(draft_vocab)).to(device)  # draft id i -> target id i + d2t[i]
    state["t2d"] = torch.zeros(v, dtype=torch.bool).index_fill_(0, kept, True).to(device)
    holder = module_from_state_dict(state)
    holder.config = eagle3_config(shape, draft_vocab)
    return holder


def build_head(shape: dict, target: CausalLM, draft_vocab: int, device):
    """eagle3_8b's head loaded as a drafter of `target` (TP 1)."""
    return load_drafter(eagle3_8b(shape, draft_vocab, device), target, kind="eagle3")


def weight_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def copy_bandwidth(device) -> float | None:
    if device.type != "cuda":
        return None
    from scripts.bench_piecewise import copy_bandwidth as measured

    return measured()


def make_engine(target, drafter, k, rates, sizes, ctx, max_tokens, device, mode, tp=1, fuse_all_reduce=True):
    """An engine at TP `tp` (above 1: `target` and `drafter` are modules each rank takes its share of, under
    torchrun, ranks joined); `fuse_all_reduce`: OpChoices.fuse_all_reduce (ops/collectives/fused.py; False: off)."""
    max_b = max(sizes)
    parallel = {}
    if tp > 1:
        parallel = dict(tensor_parallel_size=tp, drafter_kind="eagle3" if k else None,
                        dtype="bfloat16" if device.type == "cuda" else "float32")  # fmt: skip
    cfg = dg.CompileConfig(
        speculation="fixed",
        mode=mode,
        num_speculative_tokens=k,
        max_num_seqs=max_b,
        max_num_batched_tokens=max(max_b * (k + 1), 2048),
        max_model_len=ctx + max_tokens + 16,
        device=device.type,
        gpu_memory_utilization=0.0,
        progress=False,
        full_capture_sizes=tuple(sizes) if mode != "NONE" else (),
        synthetic_acceptance=rates,
        ops=None if fuse_all_reduce else OpChoices(fuse_all_reduce=False),
        **parallel,
    )
    return dg.compile_model(target, drafter if k else None, cfg)


def step_bytes(engine, k: int) -> tuple[int, int, int]:
    """What one step of `engine` (this rank's Engine) reads once, from its own (at TP N: this rank's) models:
    the target's layers, final norm and LM head; K times the drafter's weights but the shared embedding (0 for
    plain decoding); the K and V of one token in one layer."""
    t, c = engine.target, engine.target.cfg
    t_bytes = weight_bytes(p for m in (t.layers, t.norm) for p in m.parameters())
    t_bytes += t.head_weight.numel() * t.head_weight.element_size()
    d = engine.drafter if k else None
    d_bytes = weight_bytes(p for n, p in d.named_parameters() if "embed_tokens" not in n) if d is not None else 0
    return t_bytes, d_bytes, 2 * c.num_kv_heads * c.head_dim * t.head_weight.element_size()


def measure(engine, b, k, ctx, warm, steps, vocab) -> dict:
    """b requests at `ctx` cached tokens decoding together: median wall ms of engine.step() over `steps` steps,
    the mean acceptance length and the tokens emitted over them."""
    g = torch.Generator().manual_seed(b)
    for _ in range(b):
        prompt = torch.randint(0, min(vocab, 1000), (ctx,), generator=g).tolist()
        engine.add_request(prompt, dg.SamplingParams(max_tokens=(warm + steps) * (k + 1) + 16, ignore_eos=True))
    sched = engine.scheduler
    while any(r.prefilling for r in sched.running) or sched.waiting:
        engine.step()  # prefill
    for _ in range(warm):
        engine.step()
    before = engine.stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()  # ends with the step's one device-to-host copy (a sync)
        times.append((time.perf_counter() - t0) * 1e3)
    after = engine.stats()
    while engine.has_unfinished():
        engine.step()
    verify = after["verify_steps"] - before["verify_steps"]
    length = 1 + (after["accepted_tokens"] - before["accepted_tokens"]) / verify if k and verify else 1.0
    generated = after["generated_tokens"] - before["generated_tokens"]
    return {"step_ms": statistics.median(times), "length": length, "wall_tok_s": generated / (sum(times) / 1e3)}


def steady_profile(engine, prompts, k, steps=20):
    """The profiler (runtime/profiling.py) over `steps` steady decode steps of `prompts`, each request asked for
    enough tokens to still decode then (K = k drafts a step); the requests are run to their end afterwards."""
    from draftgraph.runtime.profiling import profile_steps

    for prompt in prompts:
        engine.add_request(prompt, dg.SamplingParams(max_tokens=(steps + 10) * (k + 1), ignore_eos=True))
    while any(r.prefilling for r in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    summary = profile_steps(engine, steps)
    while engine.has_unfinished():
        engine.step()
    return summary


def profile(engine, k, ctx, steps=20) -> str:
    """One request decoding at `ctx` cached tokens: the profiler over `steps` steady steps."""
    summary = steady_profile(engine, [list(range(1, ctx + 1))], k, steps)
    return summary.format() + "\n" + summary.format_time(25)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,8,32,64")
    ap.add_argument("--cases", default=",".join(CASES), help=f"of {list(CASES)}, in this order")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--mode", default="FULL", help="CUDAGraphMode (the tiny smoke test runs NONE)")
    ap.add_argument("--tiny", action="store_true", help="smoke test: a tiny shape, CPU unless CUDA is here")
    ap.add_argument("--json", default="", help="also write the rows here (rank 0)")
    ap.add_argument(
        "--push-kernel",
        default="",
        help="at TP > 1: our peer-memory kernels compared, in turn (push, "
        "lamport: ops/collectives/push.py; the rule's other bounds as shipped); default: the shipped rule",
    )
    ap.add_argument("--unfused", action="store_true", help="at TP > 1: OpChoices.fuse_all_reduce off (the "
                    "one-row all-reduces as launches of their own, not inside the GEMVs around them: "
                    "ops/collectives/fused.py)")  # fmt: skip
    ap.add_argument("--profile", default="", help="cases whose batch-1 step is profiled after timing (CUDA): GPU "
                    "time per kernel, kernels in graphs vs outside")  # fmt: skip
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    cases = args.cases.split(",")
    if bad := [c for c in cases if c not in CASES]:
        raise SystemExit(f"--cases: {bad} unknown; choose from {list(CASES)}")
    device = join_ranks()  # under torchrun: this rank's GPU, the process group joined
    rank, tp, _ = rank_env()
    shape, key = (TINY, "tiny") if args.tiny else (LLAMA_3_1_8B, "8b")
    mode = "NONE" if device.type == "cpu" else args.mode
    attn = "triton" if device.type == "cuda" else "reference"
    t0 = time.perf_counter()
    if tp == 1:
        target = build_target(shape, device, attn)
        head = build_head(shape, target, DRAFT_VOCAB[key], device)
        say(f"models built in {time.perf_counter() - t0:.1f} s: target {weight_bytes(target.parameters()) / 2**30:.2f}"
            f" GiB, EAGLE-3 head {weight_bytes(head.parameters()) / 2**30:.3f} GiB (draft vocabulary "
            f"{head.draft_vocab_size}, target layers {head.aux_layers})")  # fmt: skip
    else:  # each engine loads this rank's share of the modules
        target, head = hf_8b(shape, device), eagle3_8b(shape, DRAFT_VOCAB[key], device)
        gib = [weight_bytes(m.parameters()) / 2**30 for m in (target, head)]
        say(
            f"models built in {time.perf_counter() - t0:.1f} s on each of {tp} ranks: target {gib[0]:.2f} GiB, "
            f"EAGLE-3 head {gib[1]:.3f} GiB (draft vocabulary {DRAFT_VOCAB[key]}), each rank loads its share"
        )
    bw = copy_bandwidth(device)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    say(f"{tp} x {gpu}  torch {torch.__version__}  copy bandwidth {bw / 1e9:.0f} GB/s" if bw else f"{tp} x {gpu}")

    rows = []
    hdr = (f"{'case':<28} {'K':>2} {'L pin':>6} {'TP':>2} {'B':>3} | {'L meas':>6} {'step ms':>8} {'floor ms':>8} "
           f"{'x floor':>7} {'tok/s':>8} {'TPOT ms':>8}")  # fmt: skip
    title = (f"PINNED ACCEPTANCE (synthetic_acceptance: the accept decision is drawn; step times are real): "
             f"Llama-3.1-8B shape, bf16, random weights, EAGLE-3 head (1 layer, draft vocab {DRAFT_VOCAB[key]}),"
             f" TP {tp}, context {args.context}, mode {mode}")  # fmt: skip
    say("\n" + title + "\n" + hdr + "\n" + "-" * len(hdr))
    kernels = [k for k in args.push_kernel.split(",") if k] if tp > 1 else []
    with dg.shared_compile_workers() if device.type == "cuda" else contextlib.nullcontext():
        for name, push_kernel in [(c, pk) for c in cases for pk in kernels or [None]]:
            label, k, rates = CASES[name]
            t1 = time.perf_counter()
            if push_kernel:  # the all-reduces' rule at this TP with our kernel `push_kernel` (read at engine setup)
                from draftgraph.ops.collectives.peer import RULES, AllReduceRule

                shipped = RULES.get(tp) or AllReduceRule(0, 0, f"bench_8b --push-kernel at {tp} ranks", 8 << 20)
                RULES[tp] = dataclasses.replace(shipped, push_kernel=push_kernel)  # (a TP without a rule: to 8 MiB)
            max_tokens = (args.warm + args.steps) * (k + 1) + 16
            eng = make_engine(target, head, k, rates, sizes, args.context, max_tokens, device, mode, tp,
                              not args.unfused)  # fmt: skip
            inner = inner_engine(eng)  # at TP N this rank's Engine: the ranks step in lock-step
            t_bytes, d_bytes, kv_token = step_bytes(inner, k)
            num_layers = inner.target.cfg.num_layers
            say(f"  ({label}{', all-reduce kernel ' + push_kernel if push_kernel else ''}: engine ready in "
                f"{time.perf_counter() - t1:.1f} s)")  # fmt: skip
            for b in sizes:
                m = measure(inner, b, k, args.context, args.warm, args.steps, shape["vocab_size"])
                kv = b * args.context * kv_token
                floor_ms = (t_bytes + num_layers * kv + k * (d_bytes + kv)) / bw * 1e3 if bw else float("nan")
                pinned = expected_acceptance_length(rates)  # 1 for plain decoding
                row = dict(case=name, label=label, k=k, rates=list(rates), pinned_length=pinned, tp=tp,
                           batch=b, length=m["length"], step_ms=m["step_ms"], floor_ms=floor_ms,
                           tok_s=b * pinned / m["step_ms"] * 1e3, wall_tok_s=m["wall_tok_s"],
                           tpot_ms=m["step_ms"] / pinned, gpu=gpu, push_kernel=push_kernel)  # fmt: skip
                rows.append(row)
                say(f"{label:<28} {k:>2} {row['pinned_length']:>6.3f} {tp:>2} {b:>3} | {row['length']:>6.3f} "
                    f"{row['step_ms']:>8.3f} {floor_ms:>8.3f} {row['step_ms'] / floor_ms:>7.2f} "
                    f"{row['tok_s']:>8.1f} {row['tpot_ms']:>8.3f}")  # fmt: skip
                if args.json and rank == 0:
                    with open(args.json, "w") as f:
                        json.dump({"title": title, "rows": rows}, f, indent=1)
            if name in args.profile.split(",") and device.type == "cuda":  # every rank profiles, in lock-step
                say(f"  profile of {label} at B=1 (pinned acceptance):\n{profile(inner, k, args.context)}")
            eng.close()
    say(f"\n(all rows: pinned acceptance; tok/s = B x L pinned / step; TPOT = step / L pinned; floor = weights"
        " + KV read once over the copy bandwidth, at TP N this rank's share) total "
        f"{time.perf_counter() - t0:.0f} s")  # fmt: skip


if __name__ == "__main__":
    main()
