"""End to end on the 1B-shaped pair with real acceptance (models/builtin.py LLAMA_1B_ACCEPTANCE: Llama-3.2-1B's
shape, bf16, random seeded weights, the 14 upper layers' residual branches scaled so that the drafter, the
target's first 2 layers with its embedding, norm and head, accepts about 2.5 of K = 4 drafts), greedy.

(a) generate(): tokens/s of plain decoding (the engine without a drafter) and of speculative decoding at
    batch 1, 8 and 32, `--new-tokens` after a `--prompt-len`-token prompt, mean accepted drafts per step,
    speedup; and whether the speculative tokens equal the plain ones.
(b) transformers' own static-cache torch.compile decoding of the same target (generation_config
    cache_implementation "static": generate() compiles its decoding forward, fullgraph, mode
    "reduce-overhead") at batch 1, next to ours.
(c) The steady-state step (engine.step(), wall ms, median) at `--step-batches` after `--context` cached
    tokens, against its bandwidth floor: the bytes read once per step (plain: target layers + LM head +
    KV; spec: that + K x (drafter layers + LM head + drafter KV)) over the measured copy bandwidth. Unlike
    bench_full.py's step floor this counts the target's LM head.
(d) `--ngram`: instead of (a)-(c), plain decoding against the n-gram drafter (drafter="ngram", prompt lookup,
    no drafter model) on a target that repeats itself (models/builtin.py LLAMA_1B_SUCCESSOR: Llama-3.2-1B's shape
    and step cost, bf16, random weights, but small residual branches and an LM head that is the permuted
    embedding, so its greedy next token is the last token's fixed successor; a random-weight target copies
    nothing from its context otherwise). Workloads: each prompt is a random text X, the target's own greedy
    continuation G of it (`--new-tokens`), then X again, so the text to produce is in the prompt (as when
    rewriting it); the same with every E-th token of G's copy edited (`--edit-every`); X alone (nothing to look
    up: the drafter's cost). Tokens/s, accepted drafts per step, speedup, tokens equal.
(e) `--adaptive`: instead of (a)-(c), adaptive speculation (CompileConfig.speculation="adaptive", K from
    {0, ceil(K/2), K}) against plain decoding and each fixed K of those choices, at each batch of `--batches`
    (default 1, 8, 32, 64, 128), with the pair's drafter (real acceptance) and with the same drafter accepting
    nothing (synthetic_acceptance=(0,) * K: the same graphs, every draft rejected); tokens/s of generate(), adaptive
    against plain and against the best of plain and the fixed K, and the K adaptive ran per step. To tell the
    controller from the engine: `--controller NAME=VALUE,...` adds adaptive engines with one AdaptiveK setting
    changed (e.g. recheck=1), `--pin-k K` an adaptive engine whose controller always picks K.
Wall times: synchronize + perf_counter around whole generate() calls, medians of `--runs` after a warm-up.
Correctness: leading greedy tokens equal between our plain and speculative runs and transformers' generate
(asserted in float32, i.e. `--tiny`; bf16 may differ by rounding, so only counted there).

One file of about 560 lines, not split: its sections share the pair's build, the prompts, the timing helpers and one
argument parser, and each is one flag of the same command (docs/performance.md names them so).

Usage: python scripts/bench_e2e.py            (CUDA, the 1B pair)
       python scripts/bench_e2e.py --tiny     (smoke test: the tiny pair in float32, CPU or CUDA)
       python scripts/bench_e2e.py --ngram    (d): plain against prompt lookup on a repetitive workload
       python scripts/bench_e2e.py --adaptive (e): adaptive speculation against plain and fixed K
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
import transformers

import draftgraph as dg
from draftgraph.models.builtin import (
    LLAMA_1B_ACCEPTANCE,
    LLAMA_1B_SUCCESSOR,
    TINY_ACCEPTANCE,
    TINY_SUCCESSOR,
    acceptance_pair,
    successor_target,
)
from draftgraph.runtime.adaptive import AdaptiveK
from scripts.bench_piecewise import copy_bandwidth, layer_bytes, target_layer_bytes


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def bandwidth(device) -> float:
    """Bytes per second of a device-to-device copy (read + write)."""
    if device.type == "cuda":
        return copy_bandwidth()
    src = torch.empty(1 << 27, dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() / statistics.median(times)


def timed_runs(fn, device, runs: int) -> tuple[float, object]:
    """Median seconds of `runs` calls of fn after one warm-up call, and the last call's result."""
    out = fn()
    times = []
    for _ in range(runs):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def leading_matches(a: list[list[int]], b: list[list[int]]) -> tuple[int, int]:
    """Tokens equal before the first difference, summed over requests; and the tokens compared."""
    same = 0
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        same += n
    return same, sum(len(x) for x in a)


def build_engines(target, drafter, args, device) -> dict:
    """The plain and the speculative engine, each sized for every batch it will run; prints ready times."""
    all_b = sorted(set(args.batches) | set(args.step_batches))
    base = dict(
        max_num_seqs=max(all_b),
        max_num_batched_tokens=max(max(all_b) * (args.k + 1), 2048),
        max_model_len=max(args.prompt_len + args.new_tokens, args.context + step_tokens(args.steps, args.k))
        + 2 * args.k,
        gpu_memory_utilization=0.0,  # a KV cache of max_num_seqs requests of max_model_len
        progress=False,
    )
    engines = {}
    for name, d in (("plain", None), ("spec", drafter)):
        extra = {"num_speculative_tokens": args.k} if d is not None else {}
        if device.type == "cuda":
            rows = (1, args.k + 1) if d is not None else (1,)
            extra["capture_sizes"] = tuple(sorted({b * q for b in all_b for q in rows}))
            extra["full_capture_sizes"] = tuple(all_b)
        t0 = time.perf_counter()
        engines[name] = dg.compile_model(target, d, dg.CompileConfig(speculation="fixed", **base, **extra))
        e = engines[name]
        print(f"{name}: mode {e.config.mode.value}, ready in {time.perf_counter() - t0:.1f} s  {e.warm_up_report}")
    return engines


def ngram_workloads(xs: list[list[int]], conts: list[list[int]], edit_every: list[int], vocab: int) -> dict:
    """(d)'s prompts by workload name: X + G + X (the text to produce is in the prompt), the same with every E-th
    token of G's copy replaced by a random one (a document with edits), and X alone (nothing to look up)."""
    work = {}
    g = torch.Generator().manual_seed(1)
    for e in edit_every:
        prompts = []
        for x, c in zip(xs, conts):
            c = list(c)
            for i in range(e - 1, len(c), e) if e else ():
                c[i] = (c[i] + 1 + int(torch.randint(0, vocab - 1, (1,), generator=g))) % vocab  # never c[i] itself
            prompts.append(x + c + x)
        work[f"X+G+X, 1 in {e} of G edited" if e else "X+G+X"] = prompts
    work["X alone"] = xs
    return work


def ngram_bench(target, spec, args, device) -> None:
    """(d): plain decoding against the n-gram drafter on the successor target (its greedy next token is the last
    token's fixed successor, so it produces again what its prompt holds), at each batch of `--batches`, on the
    workloads of ngram_workloads; prints tokens/s, accepted drafts per step, speedup and equal tokens."""
    k, n, b_max = args.k, args.new_tokens, max(args.batches)
    base = dict(
        max_num_seqs=b_max, max_num_batched_tokens=max(b_max * (k + 1), 2048),
        max_model_len=2 * args.prompt_len + 2 * n + 2 * k + 2, gpu_memory_utilization=0.0, progress=False,
    )  # fmt: skip
    engines = {}
    for name, d in (("plain", None), ("ngram", "ngram")):
        extra = {"num_speculative_tokens": k, "ngram_max": args.ngram_max} if d is not None else {}
        if device.type == "cuda":
            rows = (1, k + 1) if d is not None else (1,)
            extra["capture_sizes"] = tuple(sorted({b * q for b in args.batches for q in rows}))
            extra["full_capture_sizes"] = tuple(args.batches)
        t0 = time.perf_counter()
        engines[name] = dg.compile_model(target, d, dg.CompileConfig(speculation="fixed", **base, **extra))
        print(f"{name}: ready in {time.perf_counter() - t0:.1f} s  {engines[name].warm_up_report}")
    g = torch.Generator().manual_seed(0)
    xs = torch.randint(0, spec.vocab_size, (b_max, args.prompt_len), generator=g).tolist()
    params = dg.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    conts = [o.token_ids for o in engines["plain"].generate(xs, params)]
    work = ngram_workloads(xs, conts, args.edit_every, spec.vocab_size)
    res, tokens = {}, {}
    for w, prompts in work.items():
        for b in args.batches:
            for name, eng in engines.items():
                sec, outs = timed_runs(lambda e=eng, ps=prompts[:b]: e.generate(ps, params), device, args.runs)
                s = eng.stats()  # the last generate() call's
                acc = s["accepted_tokens"] / s["verify_steps"] if s["verify_steps"] else 0.0
                res[w, name, b] = (b * n / sec, acc)
                tokens[w, name, b] = [o.token_ids for o in outs]
    print(
        f"\n{versions(device)}; {str(target.cfg.dtype).removeprefix('torch.')}, greedy, K={k}, n-gram sizes "
        f"1..{args.ngram_max}\nTarget: {'tiny' if args.tiny else 'Llama-3.2-1B'}-shaped, random weights, every "
        f"residual branch scaled by {spec.late_scale} and an untied LM head that is the embedding with rows permuted "
        f"(models/builtin.py {'TINY' if args.tiny else 'LLAMA_1B'}_SUCCESSOR): its greedy next token is the last "
        "token's fixed successor, so it repeats text it produced before."
        f"\n(d) generate(): {n} new tokens; X: {args.prompt_len} random tokens, G: the target's own {n}-token "
        f"continuation of X; tokens/s (median of {args.runs}); accepted drafts per verify step"
    )
    hdr = (
        f"{'workload':<28} {'B':>4} | {'plain tok/s':>11} {'ngram tok/s':>11} {'speedup':>7} | {'accepted/step':>13} "
        "| ngram = plain"
    )
    print(hdr + "\n" + "-" * len(hdr))
    for w in work:
        for b in args.batches:
            (p, _), (s_, acc) = res[w, "plain", b], res[w, "ngram", b]
            same, total = leading_matches(tokens[w, "ngram", b], tokens[w, "plain", b])
            print(f"{w:<28} {b:>4} | {p:>11.1f} {s_:>11.1f} {s_ / p:>7.2f} | {acc:>13.2f} | {same}/{total} tokens")
            if target.cfg.dtype == torch.float32:
                assert same == total, f"{w}, B={b}: ngram {same}/{total} tokens equal plain's in float32"
    print(f"\nngram engine forwards by artifact (last call): {engines['ngram'].stats()['dispatch']}")


def adaptive_bench(target, drafter, args, device) -> None:
    """(e): adaptive speculation against plain decoding and fixed K at each batch of `--batches`, with the drafter's
    real acceptance and with every draft rejected (pinned acceptance 0); prints each table row as it is measured."""
    k, n, batches = args.k, args.new_tokens, args.batches
    half = -(-k // 2)
    b_max = max(batches)
    base = dict(
        max_num_seqs=b_max, max_num_batched_tokens=max(b_max * (k + 1), 2048),
        max_model_len=args.prompt_len + n + 2 * k + 2, gpu_memory_utilization=0.0, progress=False,
    )  # fmt: skip
    zero = (0.0,) * k
    variants = {  # name -> (drafter, K, speculation, pinned acceptance); the comparisons first
        "plain": (None, 0, "fixed", ()),
        "adaptive": (drafter, k, "adaptive", ()),
        f"K={k}": (drafter, k, "fixed", ()),
        f"K={half}": (drafter, half, "fixed", ()),
        "adaptive acc 0": (drafter, k, "adaptive", zero),
        f"K={k} acc 0": (drafter, k, "fixed", zero),
        f"K={half} acc 0": (drafter, half, "fixed", zero[:half]),
    }
    tweaks = [x for x in args.controller.split(",") if x]
    for t in tweaks:  # the controller with one setting changed (runtime/adaptive.py AdaptiveK), A/B in the same runs
        name, sep, value = t.partition("=")
        if not sep or not hasattr(AdaptiveK((0, 1), lambda *a: None), name):
            raise SystemExit(f"--controller {t!r}: expected NAME=VALUE, NAME an AdaptiveK setting (e.g. recheck=1)")
        variants[f"adaptive {t}"] = (drafter, k, "adaptive", ())
    if args.pin_k is not None:  # an adaptive engine (K_max = k) whose controller always answers one K: its engine
        tweaks.append(f"pinned={args.pin_k}")  # against the fixed-K engine's, with no choice in between
        variants[f"adaptive pinned={args.pin_k}"] = (drafter, k, "adaptive", ())
    if args.skip:
        variants = {name: v for name, v in variants.items() if name not in args.skip.split(",")}
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, target.cfg.vocab_size, (b_max, args.prompt_len), generator=g).tolist()
    params = dg.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    print(
        f"\n{versions(device)}; {str(target.cfg.dtype).removeprefix('torch.')}, greedy, {n} new tokens after a "
        f"{args.prompt_len}-token prompt, tokens/s of generate() (median of {args.runs})",
        flush=True,
    )
    engines = {}
    for name, (d, kk, speculation, rates) in variants.items():
        # compile_workers=0: the later engines find every piece in Inductor's cache; workers would only start up
        extra = dict(num_speculative_tokens=kk, speculation=speculation, synthetic_acceptance=rates) if d else {}
        if device.type == "cuda":
            rows = (1, kk + 1) if d is not None else (1,)
            extra["capture_sizes"] = tuple(sorted({b * q for b in batches for q in rows}))
            extra["full_capture_sizes"] = tuple(batches)
        t0 = time.perf_counter()
        engines[name] = dg.compile_model(target, d, dg.CompileConfig(**base, **extra, compile_workers=0))
        if name.startswith("adaptive pinned="):
            ctl, pin = engines[name].adaptive, int(name.split("=")[1])
            if pin not in ctl.ks:
                raise SystemExit(f"--pin-k {pin}: not one of the adaptive engine's K choices {ctl.ks}")
            ctl.choose = lambda *a, ctl=ctl, pin=pin, **kw: (setattr(ctl, "current", pin), ctl._count(pin))[1]
        elif name.startswith("adaptive ") and "=" in name:  # a --controller variant
            setting, value = name.removeprefix("adaptive ").split("=")
            setattr(engines[name].adaptive, setting, type(getattr(engines[name].adaptive, setting))(float(value)))
        print(f"{name}: ready in {time.perf_counter() - t0:.1f} s  {engines[name].warm_up_report}", flush=True)
    # As the CLI once its engine is built (cli/commands.py _freeze_engine): what the engines hold moved out of the
    # collector's sight, so a full collection in one variant's timed run does not walk every engine's graphs
    gc.collect()
    gc.freeze()
    res, hist, runs, per_run = {}, {}, {}, {}
    for b in batches:  # the variants in turn within each run (round robin, rotated), medians over the runs
        times = runs[b] = {name: [] for name in engines}
        names = list(engines)
        for run in range(args.runs + 1):  # run 0 warms up
            # each run starts one variant later (no variant always follows the same one: a heavy one before it
            # would leave the GPU's clocks or the host's caches to it alone)
            for name in names[run % len(names) :] + names[: run % len(names)]:
                eng = engines[name]
                sync(device)
                t0 = time.perf_counter()
                eng.generate(prompts[:b], params)
                sync(device)
                if run:
                    times[name].append(time.perf_counter() - t0)
                    if getattr(eng, "adaptive", None) is not None:  # each run's K per step and tokens a verify step
                        s = eng.stats()
                        acc = s["accepted_tokens"] / max(s["verify_steps"], 1)
                        per_run.setdefault((name, b), []).append(
                            f"{times[name][-1] * 1e3:.1f} ms {dict(s['speculation']['histogram'])} acc {acc:.2f}"
                        )
        for name, eng in engines.items():
            res[name, b] = b * n / statistics.median(times[name])
            s = eng.stats()
            hist[name, b] = s["speculation"]["histogram"]
            acc = s["accepted_tokens"] / s["verify_steps"] if s["verify_steps"] else 0.0
            hits = s["prefix_cache"]["hit_tokens"]
            per_step = statistics.median(times[name]) / max(s["steps"], 1) * 1e3  # (steps: the last run's)
            spread = max(times[name]) / min(times[name]) - 1  # the runs' spread: what one engine's runs differ by
            print(f"  B={b:>3} {name:>15}: {res[name, b]:>8.1f} tok/s (runs spread {spread:.1%}), accepted/step "
                  f"{acc:.2f}, K per step (last run) "
                  f"{hist[name, b]}, steps {s['steps']} ({s.get('overlapped_steps', 0)} overlapped, "
                  f"{s.get('dropped_steps', 0)} dropped), wall per step {per_step:.3f} ms, "
                  f"prefix-cache hit tokens {hits}, catch-up tokens "
                  f"{s['speculation'].get('catch_up_tokens', 0)}, probes {s['speculation'].get('probes', 0)}",
                  flush=True)  # fmt: skip
            if getattr(eng, "adaptive", None) is not None:  # what the controller saw: why it chose its K
                ctx, ctl = args.prompt_len + n / 2, eng.adaptive
                view = {kk: (eng.step_times(kk, b, ctx), ctl.expected_tokens(kk)) for kk in ctl.ks}
                unit = "ms" if device.type == "cuda" else "(the target's bytes, x 1e3: no graphs timed here)"
                text = ", ".join(f"K={kk}: {t * 1e3:.3f} {unit} x {e:.2f} tokens" if t else f"K={kk}: no time"
                                 for kk, (t, e) in view.items())  # fmt: skip
                st, pb = eng.step_times, eng.step_times.bucket(b)
                startup = ", ".join(f"K={kk} {st.measured[kk, pb] * 1e3:.3f} ms + {st.per_token[kk, pb] * 1e6:.2f} us/t"
                                    for kk in ctl.ks if (kk, pb) in st.measured)  # fmt: skip
                print(f"      controller at B={b}, mean cached {ctx:.0f}: {text}; acceptance rates "
                      f"{[round(a, 3) for a in ctl.rates]}; start-up at {pb} rows: {startup or 'none'}; steady "
                      f"offset {st.offset.get(pb, 0.0) * 1e3:+.3f} ms; a step not overlapped idles the device "
                      f"{ctl.gap(b) * 1e3:.3f} ms", flush=True)  # fmt: skip
                print(
                    f"      runs in order (time, K per step, accepted drafts a verify step): "
                    f"{'; '.join(per_run.get((name, b), []))}",
                    flush=True,
                )
    for label, suffix in (("the pair's drafter (real acceptance)", ""), ("every draft rejected (acc 0)", " acc 0")):
        fixed = [f for f in (f"K={half}{suffix}", f"K={k}{suffix}") if f in variants]
        if f"adaptive{suffix}" not in variants:
            continue
        print(f"\n(e) {label}: adaptive K in (0, {half}, {k}) against plain and fixed K")
        hdr = (f"{'B':>4} | {'plain':>8} " + " ".join(f"{f:>12}" for f in fixed) + f" {'adaptive':>9} | "
               f"{'vs plain':>8} {'vs best':>7} | {'paired':>15} | adaptive K per step")  # fmt: skip
        print(hdr + "\n" + "-" * len(hdr))
        ours = [f"adaptive{suffix}"] + ([f"adaptive {t}" for t in tweaks] if not suffix else [])
        for b in batches:
            for mine_name in ours:  # the default controller, then any --controller / --pin-k variant (named)
                p, a, fx = res["plain", b], res[mine_name, b], [res[f, b] for f in fixed]
                # paired: within each run (the variants back to back), plain's time / adaptive's and the fastest
                # fixed variant's / adaptive's; the median of those ratios (drift between runs cancels in a pair)
                t = runs[b]
                mine = t[mine_name]
                vs_plain = statistics.median(x / y for x, y in zip(t["plain"], mine))
                vs_best = statistics.median(min(r) / y for r, y in zip(zip(*(t[f] for f in ["plain", *fixed])), mine))
                tag = "" if mine_name == ours[0] else f" ({mine_name})"
                print(f"{b:>4} | {p:>8.1f} " + " ".join(f"{x:>12.1f}" for x in fx) + f" {a:>9.1f} | {a / p:>8.3f} "
                      f"{a / max([p, *fx]):>7.3f} | {vs_plain:>6.3f} {vs_best:>7.3f} | "
                      f"{hist[mine_name, b]}{tag}")  # fmt: skip
        print(
            "paired: the medians over the runs of (plain's time / adaptive's) and (the fastest of plain and fixed K "
            "in that run / adaptive's), each run's variants back to back"
        )


def hf_static_compiled(hf, prompt, new_tokens: int, device, runs: int) -> tuple[float, list[int]]:
    """transformers' static-cache decoding, compiled the way transformers does it itself: with a static cache,
    generate() compiles the decoding forward (its CompileConfig: fullgraph, mode "reduce-overhead", i.e. CUDA
    graphs) and marks each step's graph boundary. Returns the median seconds of a whole generate() (prefill
    included) and the tokens."""
    from transformers.generation.configuration_utils import CompileConfig

    hf.generation_config.cache_implementation = "static"
    hf.generation_config.compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
    hf.generation_config.disable_compile = False
    ids = torch.tensor([prompt], device=device)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)  # no eos: all run
    t0 = time.perf_counter()
    for _ in range(2):  # compile (prefill and decode shapes), then record the CUDA graphs
        hf.generate(ids, **kw)
    sync(device)
    print(f"transformers static cache + torch.compile: ready in {time.perf_counter() - t0:.1f} s")
    sec, out = timed_runs(lambda: hf.generate(ids, **kw), device, runs)
    return sec, out[0, ids.shape[1] :].tolist()


def step_tokens(steps: int, k: int) -> int:
    """max_tokens for steady_step_ms: no request finishes in the timed steps even if every draft is accepted."""
    return (steps + 4) * (k + 1)


def steady_step_ms(engine, b: int, ctx: int, vocab: int, steps: int) -> tuple[float, float]:
    """Median wall ms of engine.step() over `steps` uniform decode steps of b requests after ctx-token
    prompts (each step ends with its device-to-host copy); mean accepted drafts per step (0 when plain)."""
    g = torch.Generator().manual_seed(b)
    for _ in range(b):
        prompt = torch.randint(0, vocab, (ctx,), generator=g).tolist()
        params = dg.SamplingParams(max_tokens=step_tokens(steps, engine.k), temperature=0.0, ignore_eos=True)
        engine.add_request(prompt, params)
    sched = engine.scheduler
    engine.reset_stats()
    while sched.waiting or any(r.prefilling for r in sched.running):
        engine.step()
    for _ in range(3):
        engine.step()
    before = engine.stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
    after = engine.stats()
    verify = after["verify_steps"] - before["verify_steps"]
    acc = (after["accepted_tokens"] - before["accepted_tokens"]) / verify if verify else 0.0
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times), acc


def versions(device) -> str:
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    triton = ""
    if device.type == "cuda":
        import triton as tr

        triton = f"  triton {tr.__version__}"
    return f"{where}  torch {torch.__version__}  transformers {transformers.__version__}{triton}"


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="the tiny pair in float32, small sizes: a smoke test")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--batches", default=None, help="generate() batch sizes (default 1,8,32; tiny: 1,4)")
    ap.add_argument("--step-batches", default=None, help="step batch sizes (default 1,8,32,128; tiny: 1,4)")
    ap.add_argument("--prompt-len", type=int, default=None, help="default 128 (tiny: 16)")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 256 (tiny: 24)")
    ap.add_argument("--context", type=int, default=None, help="cached tokens in (c) (default 512; tiny: 32)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per batch size in (c)")
    ap.add_argument("--runs", type=int, default=None, help="timed generate() runs (default 3; tiny: 1)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers' static-cache compiled decoding")
    ap.add_argument("--ngram", action="store_true", help="(d) only: plain against prompt lookup, repetitive prompts")
    ap.add_argument("--ngram-max", type=int, default=3, help="(d): the longest n-gram matched (default 3)")
    ap.add_argument(
        "--edit-every", default="0,16", help="(d): X+G+X workloads, every E-th token of G's copy edited (0: none)"
    )
    ap.add_argument("--adaptive", action="store_true", help="(e) only: adaptive speculation against plain, fixed K")
    ap.add_argument("--skip", default="", help="(e): variants left out, comma-separated (e.g. 'K=2 acc 0')")
    ap.add_argument(
        "--controller", default="", help="(e): more adaptive variants, each with one AdaptiveK setting (recheck=1,...)"
    )
    ap.add_argument(
        "--pin-k", type=int, default=None, help="(e): one more adaptive engine whose controller always picks this K"
    )
    args = ap.parse_args()
    tiny = args.tiny
    default_batches = "1,8,32,64,128" if args.adaptive else "1,8,32"
    args.batches = [int(x) for x in (args.batches or ("1,4" if tiny else default_batches)).split(",")]
    args.step_batches = [int(x) for x in (args.step_batches or ("1,4" if tiny else "1,8,32,128")).split(",")]
    args.prompt_len = args.prompt_len or (16 if tiny else 128)
    args.new_tokens = args.new_tokens or (24 if tiny else 256)
    args.context = args.context or (32 if tiny else 512)
    args.runs = args.runs or (1 if tiny else 3)
    args.edit_every = [int(x) for x in args.edit_every.split(",")]
    return args


def main():
    args = parse_args()
    device = torch.device(args.device)
    spec, dtype = (TINY_ACCEPTANCE, torch.float32) if args.tiny else (LLAMA_1B_ACCEPTANCE, torch.bfloat16)
    t0 = time.perf_counter()
    attn = "triton" if device.type == "cuda" else "sdpa"
    if args.ngram:  # (d) alone: the successor target, no drafter model
        spec = TINY_SUCCESSOR if args.tiny else LLAMA_1B_SUCCESSOR
        _, target, _ = successor_target(spec, dtype=dtype, device=device, attn_impl=attn)
        sync(device)
        print(f"built the successor target ({spec.num_layers} layers) in {time.perf_counter() - t0:.1f} s")
        ngram_bench(target, spec, args, device)
        return
    hf, target, drafter = acceptance_pair(spec, dtype=dtype, device=device, attn_impl=attn)
    sync(device)
    print(f"built the pair ({spec.num_layers} layers, drafter {spec.draft_layers}) in {time.perf_counter() - t0:.1f} s")
    if args.adaptive:  # (e) alone
        adaptive_bench(target, drafter, args, device)
        return
    bw = bandwidth(device)
    engines = build_engines(target, drafter, args, device)
    k, n = args.k, args.new_tokens
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, spec.vocab_size, (max(args.batches), args.prompt_len), generator=g).tolist()
    params = dg.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)

    res, tokens = {}, {}
    for b in args.batches:
        for name, eng in engines.items():
            sec, outs = timed_runs(lambda e=eng, ps=prompts[:b]: e.generate(ps, params), device, args.runs)
            s = eng.stats()
            acc = s["accepted_tokens"] / s["verify_steps"] if s["verify_steps"] else 0.0
            res[name, b] = (b * n / sec, acc)
            tokens[name, b] = [o.token_ids for o in outs]
    hf_ref = None
    n_ref = min(8, max(args.batches))
    with torch.no_grad():  # transformers' eager generate (dynamic cache): the reference tokens
        ids = torch.tensor(prompts[:n_ref], device=device)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
        hf_ref = out[:, args.prompt_len :].tolist()
    hf_sec = hf_tokens = None
    if not args.no_hf:
        try:  # a failure in transformers' compile path is reported, and the rest still runs
            with torch.no_grad():
                hf_sec, hf_tokens = hf_static_compiled(hf, prompts[0], n, device, args.runs)
        except Exception as e:
            print(f"transformers static cache + torch.compile failed: {type(e).__name__}: {e}")

    print(
        f"\n{versions(device)}; {str(dtype).removeprefix('torch.')}, greedy, K={k}; copy bandwidth {bw / 1e9:.0f} GB/s"
    )
    print(f"(a) generate(): {n} new tokens after a {args.prompt_len}-token prompt, tokens/s (median of {args.runs})")
    hdr = f"{'B':>4} | {'plain tok/s':>11} {'spec tok/s':>10} {'speedup':>7} | {'accepted/step':>13} | spec = plain"
    print(hdr + "\n" + "-" * len(hdr))
    for b in args.batches:
        (p, _), (s_, acc) = res["plain", b], res["spec", b]
        same, total = leading_matches(tokens["spec", b], tokens["plain", b])
        print(f"{b:>4} | {p:>11.1f} {s_:>10.1f} {s_ / p:>7.2f} | {acc:>13.2f} | {same}/{total} tokens")
    b_ref = max(args.batches)
    for name in engines:
        same, total = leading_matches(tokens[name, b_ref][:n_ref], hf_ref)
        print(f"{name} (batch {b_ref}) = transformers' generate on {n_ref} prompts: {same}/{total} leading tokens")
        if dtype == torch.float32:
            assert same == total, f"{name}: {same}/{total} tokens equal transformers' in float32"
    if hf_sec is not None:
        hf_tps = n / hf_sec
        print(f"\n(b) batch 1: transformers static cache + torch.compile {hf_tps:.1f} tok/s")
        if 1 in args.batches:
            for name in engines:
                same, total = leading_matches([tokens[name, 1][0]], [hf_tokens])
                print(
                    f"    ours {name}: {res[name, 1][0]:.1f} tok/s = {res[name, 1][0] / hf_tps:.2f}x transformers' "
                    f"({same}/{total} leading tokens equal)"
                )

    ctx = args.context
    t_bytes, d_bytes = target_layer_bytes(target), layer_bytes(drafter)
    head = target.head_weight.numel() * target.head_weight.element_size()
    c = target.cfg
    kv_layer = 2 * ctx * c.num_kv_heads * c.head_dim * target.head_weight.element_size()  # per request
    print(
        f"\n(c) engine.step() in steady decode after {ctx} cached tokens, wall ms (median of {args.steps}); floor: "
        f"target layers {t_bytes / 1e6:.1f} MB + LM head {head / 1e6:.1f} MB + KV, spec adds K x (drafter layers "
        f"{d_bytes / 1e6:.1f} MB + LM head + KV)"
    )
    hdr = (
        f"{'B':>4} | {'plain ms':>8} {'floor':>6} {'x floor':>7} | {'spec ms':>8} {'floor':>6} {'x floor':>7} | "
        f"{'accepted':>8} {'ms/token':>8}"
    )
    print(hdr + "\n" + "-" * len(hdr))
    for b in args.step_batches:
        p_ms, _ = steady_step_ms(engines["plain"], b, ctx, spec.vocab_size, args.steps)
        s_ms, acc = steady_step_ms(engines["spec"], b, ctx, spec.vocab_size, args.steps)
        p_floor = (t_bytes + head + c.num_layers * b * kv_layer) / bw * 1e3
        s_floor = p_floor + k * (d_bytes + head + spec.draft_layers * b * kv_layer) / bw * 1e3
        print(
            f"{b:>4} | {p_ms:>8.3f} {p_floor:>6.3f} {p_ms / p_floor:>7.2f} | {s_ms:>8.3f} {s_floor:>6.3f} "
            f"{s_ms / s_floor:>7.2f} | {acc:>8.2f} {s_ms / (1 + acc):>8.3f}"
        )
    print(f"\nspec engine forwards by artifact (last call): {engines['spec'].stats()['dispatch']}")


if __name__ == "__main__":
    main()
