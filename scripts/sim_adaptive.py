"""Adaptive speculation's choice of K in a CPU simulation of closed-batch generate() (scripts/bench_e2e.py --adaptive's
workload: B requests start together, `--new-tokens` each, greedy), against each fixed K; no GPU.

Greedy decoding is deterministic, so a request's acceptance at every step follows from one agreement sequence: m[j] =
1 where the drafter's greedy token j (on the target's own text so far) equals the target's. A step at K from token L
accepts the run of ones in m[L : L + K] (capped by the drafts the step before proposed: after a smaller K they are
padded) and emits that + 1 tokens, at most the request's tokens left; the run is not cut at the request's end (the
sequences run K_max tokens past it: the engine's verify accepts drafts there and the controller observes them, only
the emitted tokens stop at max_tokens). The sequences come from a built-in pair run
here with transformers (`--pair tiny`: TINY_ACCEPTANCE; `mid`: LLAMA_1B_ACCEPTANCE's structure at hidden 512, about
82 % agreement like the 1B pair's), prompts of 128 random tokens.

The engine's order is simulated: the K of step s + 1 is chosen while step s runs (reads up to s - 1) unless a request
of step s is within K + 1 tokens of its end (then after the read); a step is overlapped when it runs the K of the
step before and no request was near its end, else it costs `--gap` more (the host's read, bookkeeping and launch).
Step times (seconds per (K, padded size)): the H100's at B = 8 with the 1B pair (K = 0 1.408 ms, K = 2 2.193, K = 4
2.886; `scripts/bench_e2e.py --adaptive`, 2026-11-28), linear to an estimate at 128 (2.2 / 4.1 / 6.0 ms), padded sizes
1, 8, 32, 64, 128. The controller is runtime/adaptive.py's AdaptiveK: "tokens/s" without the requests' tokens left
(as before the finish-time model), "finish" with them (as runtime/engine.py passes them while no request waits).
Each batch runs twice on one controller (its rates carry over, as in the benchmark's warm-up run) unless `--fresh`.

`--predict`: instead, how well each model foresees the time a fixed K's batch has left, at its 20th step (observations
so far fed to a controller): the finish-time model's `finish_time`, and the tokens/s model's implicit estimate (the
tokens left over the batch's tokens a step, times the step time); a bias that differs by K misleads the choice.

`--times h200`: the H200's measured step times per padded size instead; `--zero`: a drafter that agrees nowhere.

Usage: python scripts/sim_adaptive.py [--pair tiny|mid] [--batches 8,32] [--prompts 128] [--fresh] [--predict]
       [--times h100|h200] [--zero]
Prints per batch of prompts the time of each variant and adaptive's K histogram, then per B the mean and the least
ratio of the best fixed K's time to adaptive's (1.000: as fast as the best fixed K).
"""

from __future__ import annotations

import argparse
import copy
import statistics
from dataclasses import replace

import torch

from draftgraph.models.builtin import LLAMA_1B_ACCEPTANCE, TINY_ACCEPTANCE, builtin_hf_target
from draftgraph.runtime.adaptive import AdaptiveK

SIZES = (1, 8, 32, 64, 128)
T8 = {0: 1.408e-3, 2: 2.193e-3, 4: 2.886e-3}  # H100, the 1B pair, B = 8, mean cached 256
T128 = {0: 2.2e-3, 2: 4.1e-3, 4: 6.0e-3}  # an estimate from the same run's B = 128 tokens/s


# The H200's (GPU 0 of nvidia-h200-x2, the same benchmark, 2026-11-28) per padded size: `--times h200`
H200 = {
    8: {0: 1.166e-3, 2: 1.803e-3, 4: 2.411e-3},
    32: {0: 1.249e-3, 2: 2.051e-3, 4: 2.952e-3},
    64: {0: 1.401e-3, 2: 2.651e-3, 4: 3.939e-3},
    128: {0: 1.739e-3, 2: 3.925e-3, 4: 6.099e-3},
}
TIMES = "h100"


def step_time(k: int, n: int, ctx: float = 0.0) -> float:
    b = next(s for s in SIZES if s >= n)
    if TIMES == "h200":
        return H200[max(b, 8)][k]
    return T8[k] if b <= 8 else T8[k] + (T128[k] - T8[k]) * (b - 8) / 120


def agreement(pair: str, prompts: int, new_tokens: int) -> list[list[int]]:
    """m[j] per request: the drafter (the target's first layers) greedy-agrees with the target at new token j."""
    spec = TINY_ACCEPTANCE
    if pair == "mid":
        spec = replace(LLAMA_1B_ACCEPTANCE, hidden_size=512, intermediate_size=2048, num_heads=8, num_kv_heads=2,
                       init_std=0.02 * (2048 / 512) ** 0.5)  # fmt: skip
    hf = builtin_hf_target(spec, dtype=torch.float32)
    drafter = copy.deepcopy(hf)
    drafter.model.layers = drafter.model.layers[: spec.draft_layers]
    drafter.config.num_hidden_layers = spec.draft_layers
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, spec.vocab_size, (prompts, 128), generator=g)
    out = []
    with torch.no_grad():
        for i in range(0, prompts, 16):
            p = x[i : i + 16]
            seq = hf.generate(p, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              attention_mask=torch.ones_like(p))  # fmt: skip
            d = drafter(seq).logits.argmax(-1)
            out += (d[:, 127:-1] == seq[:, 128:]).int().tolist()
    return out


def simulate(rows, n_new, fixed=None, ctl=None, finish=True, gap=0.3e-3):
    """Seconds of one closed batch, steps, K histogram."""
    b = len(rows)
    counts = [[] for _ in range(b)]
    done = [1] * b  # the prefill emits token 0
    k_pre = fixed if fixed is not None else ctl.prompt_k()
    drafts = [k_pre] * b
    t, hist = 0.0, {}
    running = list(range(b))

    def left(rs):
        return [(n_new - done[i], counts[i]) for i in rs] if finish else None

    def ctx(rs):
        return 128 + sum(done[i] for i in rs) / len(rs)

    k = fixed if fixed is not None else ctl.choose(b, ctx(running), left(running))
    overlapped = False
    while running:
        t += step_time(k, len(running)) + (0.0 if overlapped else gap)
        if ctl is not None and not overlapped:  # (the engine measures this idle time: runtime/engine.py note_gap)
            ctl.note_gap(len(running), gap)
        hist[k] = hist.get(k, 0) + 1
        near = any(n_new - done[i] <= k + 1 for i in running)
        nxt = None if fixed is not None or near else ctl.choose(len(running), ctx(running), left(running), k)
        seen, seen_counts = [], []
        for i in running:
            cap, a = min(k, drafts[i]), 0  # (as the engine's verify: acceptance not cut at the request's end,
            while a < cap and done[i] + a < len(rows[i]) and rows[i][done[i] + a]:  # the tokens emitted are)
                a += 1
            if drafts[i] >= k:  # (padded drafts are not observed)
                seen.append(a)
                seen_counts.append(counts[i])
            done[i] += min(a + 1, n_new - done[i])
            drafts[i] = k
        if fixed is None and k:
            ctl.observe(k, seen, seen_counts if finish else None)
        running = [i for i in running if done[i] < n_new]
        if not running:
            break
        if fixed is not None:
            new_k = fixed
        else:
            new_k = nxt if nxt is not None else ctl.choose(len(running), ctx(running), left(running))
        overlapped = not near and new_k == k
        k = new_k
    return t, sum(hist.values()), hist


def predict(rows, n_new, k, at=20):
    """(finish_time's, tokens/s model's) estimate of the time left after `at` steps of a batch at fixed K, over the
    realized time left."""
    ctl = AdaptiveK((0, 2, 4), step_time, sizes=SIZES)
    b = len(rows)
    counts, done, running = [[] for _ in range(b)], [1] * b, list(range(b))
    t, t_at, est = 0.0, 0.0, None
    for step in range(10**6):
        if not running:
            break
        if step == at:
            left = [(n_new - done[i], counts[i]) for i in running]
            tokens = sum(r for r, _ in left) / (len(running) * ctl.expected_tokens(k))
            est, t_at = (ctl.finish_time(k, left), tokens * step_time(k, len(running))), t
        t += step_time(k, len(running))
        seen = []
        for i in running:
            a = 0
            while a < k and done[i] + a < len(rows[i]) and rows[i][done[i] + a]:
                a += 1
            seen.append(a)
            done[i] += min(a + 1, n_new - done[i])
        ctl.observe(k, seen, [counts[i] for i in running])
        running = [i for i in running if done[i] < n_new]
    return est[0] / (t - t_at), est[1] / (t - t_at)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pair", default="tiny", choices=("tiny", "mid"))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--gap", type=float, default=0.3e-3, help="seconds a step not overlapped adds")
    ap.add_argument("--fresh", action="store_true", help="a new controller per batch (no rates carried over)")
    ap.add_argument("--predict", action="store_true", help="each model's estimate of a fixed K's time left")
    ap.add_argument("--times", default="h100", choices=("h100", "h200"), help="whose step times (module docstring)")
    ap.add_argument("--zero", action="store_true", help="a drafter that agrees nowhere (acc 0): no model is run")
    args = ap.parse_args()
    global TIMES
    TIMES = args.times
    extra = 4  # K_max: drafts past a request's last token are verified against the model's continuation, as on a GPU
    m = (
        [[0] * (args.new_tokens + extra) for _ in range(args.prompts)]
        if args.zero
        else agreement(args.pair, args.prompts, args.new_tokens + extra)
    )
    print(f"{args.pair} pair: {len(m)} requests, agreement {statistics.mean(map(statistics.mean, m)):.3f}")
    if args.predict:
        for b in map(int, args.batches.split(",")):
            for k in (2, 4):
                est = [predict(m[off : off + b], args.new_tokens, k) for off in range(0, len(m) - b + 1, b)]
                fin, tps = (statistics.mean(x) for x in zip(*est))
                print(f"B={b:>3} K={k}: estimated / realized time left at step 20: finish time {fin:.3f}, "
                      f"tokens/s model {tps:.3f} ({len(est)} batches)")  # fmt: skip
        return
    for b in map(int, args.batches.split(",")):
        ratios = {"tokens/s": [], "finish": []}
        for off in range(0, len(m) - b + 1, b):
            rows = m[off : off + b]
            res = {f"K={k}": simulate(rows, args.new_tokens, fixed=k, gap=args.gap) for k in (0, 2, 4)}
            for name in ratios:
                ctl = AdaptiveK((0, 2, 4), step_time, sizes=SIZES)
                finish = name == "finish"
                if not args.fresh:  # the benchmark's warm-up run: rates and K carry over
                    simulate(rows, args.new_tokens, ctl=ctl, finish=finish, gap=args.gap)
                res[name] = simulate(rows, args.new_tokens, ctl=ctl, finish=finish, gap=args.gap)
            best = min(res[f"K={k}"][0] for k in (0, 2, 4))
            for name in ratios:
                ratios[name].append(best / res[name][0])
            print(f"B={b:>3} prompts {off:>3}+: " + ", ".join(f"{n} {v[0] * 1e3:.1f} ms" for n, v in res.items())
                  + f"; K per step: tokens/s {res['tokens/s'][2]}, finish {res['finish'][2]}")  # fmt: skip
        for name, r in ratios.items():
            print(f"B={b:>3} {name:>8}: best fixed / adaptive mean {statistics.mean(r):.3f}, least {min(r):.3f}")


if __name__ == "__main__":
    main()
