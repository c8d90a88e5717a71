"""The whole step in FULL mode, one graph against two: the 1B-shaped pair of bench_piecewise.py, bf16, K = 4.

For each batch size B, wall milliseconds of `engine.step()` in steady uniform decode (median), against the
step's bandwidth floor (weights that must be read once per step over the measured device-to-device copy
speed):
* speculative step: target layers + LM head once, then the drafter's layers + LM head K times, plus KV;
* plain decode (no drafter): target layers + LM head, plus KV.

Variants, compiled in this one process and measured side by side:
* `overlap`: the default: verify, LM head, acceptance and the K drafts in one CUDA graph per step, and the
  next step launched before the host reads the last one (CompileConfig.overlap_steps);
* `serial`: the one graph per step, each read before the next is launched (overlap_steps=False);
* `2 graphs`: one_graph_step=False: the verify graph, acceptance outside graphs, the fused loop's graph;
* `torch norms`: `overlap` with RMSNorm and the residual add as torch ops (OpChoices(norm_kernel=False)).
* `cuBLAS`: `overlap` with every linear layer on F.linear (OpChoices(gemv=False)).
* `torch rope`: `overlap` with RoPE and the v copy as torch ops (OpChoices(rope_kernel=False)).
* `norm apart`: `overlap` with each pre-norm a kernel of its own before its GEMV (norm_in_projection=False).
* `kv apart`: `overlap` with k and v written into the caches by the attention op (rope_kv_write=False).
* `both apart`: the two above at once.
* `logprobs`, `penalties`, `pen+lp`: `overlap`'s engine, its requests asking for the top 5 logprobs, for
  repetition 1.1 / presence 0.3 / frequency 0.2 penalties and a logit bias, or for both (the one-graph step's
  "_logprobs" / "_penalties" variants, captured by their first step).
* `json`: `overlap`'s engine, every request with a JSON schema (one string property: the output stays inside the
  string for the whole run), the one-graph step's "_grammar" variants: the host fills each verify row's bitmask
  between steps, so these steps are not overlapped. The engine's tokenizer is a 300-token byte-level BPE trained
  here (the built-in pair has none), the bitmask spans the target's whole vocabulary: the device's masking costs
  what it would with a real tokenizer, xgrammar's host fill less (its token-mask cache is over 300 tokens).
A variant with other OpChoices gets its own model pair built with them (the target's weights shared).
Then a profiler pass over steady steps of the first variant's engine: graph replays, kernels outside graphs.

Usage: python scripts/bench_step.py [--sizes 1,8,32,128] [--k 4] [--context 512] [--variants overlap,serial]
                                   [--repeats 3] [--kinds plain,spec]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import triton

import draftgraph as dg
from draftgraph.ops.choices import DEFAULT_OPS, OpChoices
from draftgraph.runtime.profiling import profile_steps
from scripts.bench_full import step_time
from scripts.bench_piecewise import build_pair, copy_bandwidth, layer_bytes, target_layer_bytes
from scripts.profile_step import engine as full_engine

VARIANTS = {  # name: CompileConfig fields
    "overlap": dict(one_graph_step=True, overlap_steps=True),
    "serial": dict(one_graph_step=True, overlap_steps=False),
    "2 graphs": dict(one_graph_step=False),
    # the overlapped step with RMSNorm and the residual add as torch ops (Inductor's kernels), not ops/norm's
    "torch norms": dict(one_graph_step=True, overlap_steps=True, ops=OpChoices(norm_kernel=False)),
    # the overlapped step with every linear layer on cuBLAS (F.linear), not draftgraph::linear's one-row GEMV
    "cuBLAS": dict(one_graph_step=True, overlap_steps=True, ops=OpChoices(gemv=False)),
    # RoPE on q and k and the copy of v as torch ops (Inductor's kernels), not draftgraph::rope_qkv's one kernel
    "torch rope": dict(one_graph_step=True, overlap_steps=True, ops=OpChoices(rope_kernel=False)),
    # each pre-norm and the projection after it as two ops, not one draftgraph::add_rms_norm_linear
    "norm apart": dict(one_graph_step=True, overlap_steps=True, ops=OpChoices(norm_in_projection=False)),
    # k and v written into the caches by the attention op's kernel, not by the RoPE kernel (draftgraph::rope_qkv_write)
    "kv apart": dict(one_graph_step=True, overlap_steps=True, ops=OpChoices(rope_kv_write=False)),
    # both of the above
    "both apart": dict(
        one_graph_step=True, overlap_steps=True, ops=OpChoices(norm_in_projection=False, rope_kv_write=False)
    ),
}
PENALTIES = dict(repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=0.2, logit_bias={7: 1.5})
PARAMS = {  # name: SamplingParams fields of every request, on `overlap`'s engine
    "logprobs": dict(logprobs=5),
    "penalties": PENALTIES,
    "pen+lp": dict(PENALTIES, logprobs=5),
    "json": dict(json_schema={"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}),
}


def bench_tokenizer():
    """A 300-token byte-level BPE with an eos (structured output needs the engine's tokenizer)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog", '{"text": "hello, world"}'] * 10, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


_pairs: dict[OpChoices, tuple] = {}


def pair(ops: OpChoices):
    """The model pair built with `ops` (once per OpChoices; the target's weights shared between them)."""
    if ops not in _pairs:
        _pairs[ops] = build_pair(ops=ops)
    return _pairs[ops]


def engine(spec: bool, sizes, k, ctx, variant: str):
    t0 = time.perf_counter()
    fields = dict(VARIANTS[variant])
    target, drafter = pair(fields.get("ops", DEFAULT_OPS))
    drafter = drafter if spec else None
    tokenizer = bench_tokenizer() if variant == "overlap" else None  # for the `json` variant
    eng = full_engine(target, drafter, max(sizes), k, ctx, sizes=sizes, tokenizer=tokenizer, **fields)
    name = f"{'spec' if drafter is not None else 'plain'} {variant}"
    print(f"{name}: ready in {time.perf_counter() - t0:.1f} s  {eng.warm_up_report}", flush=True)
    return eng


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,8,32,128")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"of {list(VARIANTS) + list(PARAMS)}; the first is profiled")  # fmt: skip
    ap.add_argument("--repeats", type=int, default=1,
                    help="measure the variants in turn this many times (A B A B ...), each cell the median of them: "
                    "a drift over the run (clocks, heat) then hits every variant alike")  # fmt: skip
    ap.add_argument("--kinds", default="spec,plain", help="which steps to measure, in this order (spec, plain)")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    if not kinds or set(kinds) - {"spec", "plain"}:
        raise SystemExit(f"--kinds {args.kinds!r}: a comma-separated list of spec and plain")
    sizes = [int(s) for s in args.sizes.split(",")]
    variants = args.variants.split(",")
    if bad := [v for v in variants if v not in VARIANTS and v not in PARAMS]:
        raise SystemExit(f"--variants: {bad} unknown; choose from {list(VARIANTS) + list(PARAMS)}")
    built = [v for v in variants if v in VARIANTS] + (["overlap"] if set(variants) & set(PARAMS) else [])
    k, ctx = args.k, args.context
    target, drafter = pair(DEFAULT_OPS)
    bw = copy_bandwidth()
    with dg.shared_compile_workers():  # the engines share their compiled pieces: each is compiled once
        engines = {(kind, v): engine(kind == "spec", sizes, k, ctx, v) for kind in kinds for v in dict.fromkeys(built)}
    for kind in kinds:  # the request-parameter variants step `overlap`'s engine
        engines.update({(kind, v): engines[kind, "overlap"] for v in variants if v in PARAMS})
    head = target.head_weight.numel() * target.head_weight.element_size()
    t_bytes, d_bytes = target_layer_bytes(target) + head, layer_bytes(drafter) + head
    print(
        f"\n{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  copy bandwidth "
        f"{bw / 1e9:.0f} GB/s; context {ctx}, K={k}; target {t_bytes / 2**30:.2f} GiB, drafter step "
        f"{d_bytes / 2**30:.2f} GiB (LM head included); wall ms per engine.step() (median of 30), then each "
        f"variant over its floor (weights and KV read once over the copy bandwidth)"
    )
    for kind in kinds:
        hdr = f"{kind:>5} B | " + " ".join(f"{v:>9}" for v in variants) + f" {'floor':>7} | "
        hdr += " ".join(f"{v + '/fl':>11}" for v in variants)
        print(hdr + "\n" + "-" * len(hdr))
        for b in sizes:
            kv = 2 * b * ctx * target.cfg.num_kv_heads * target.cfg.head_dim * 2  # K and V of one layer, bf16
            floor = (t_bytes + target.cfg.num_layers * kv) / bw * 1e3
            if kind == "spec":
                floor += k * (d_bytes + kv) / bw * 1e3
            runs = [[step_time(engines[kind, v], b, k, ctx, params=PARAMS.get(v))[0] for v in variants]
                    for _ in range(args.repeats)]  # fmt: skip
            t = [statistics.median(r[i] for r in runs) for i in range(len(variants))]
            print(f"{b:>7} | " + " ".join(f"{x:>9.3f}" for x in t) + f" {floor:>7.3f} | "
                  + " ".join(f"{x / floor:>11.2f}" for x in t))  # fmt: skip
    for kind in kinds:
        eng = engines[kind, variants[0]]
        print(f"\n{kind}, {variants[0]}: forwards by artifact {eng.stats()['dispatch']}")
        for i in range(4):
            eng.add_request([1 + i] * 16, dg.SamplingParams(max_tokens=40, ignore_eos=True))
        eng.step()
        eng.step()
        print(profile_steps(eng, 5).format())
        while eng.has_unfinished():
            eng.step()


if __name__ == "__main__":
    main()
