"""The report `draftgraph generate` prints after its output: steps, tokens, acceptance histogram, tokens/s, how
the forwards ran (graph replays, compiled pieces, fallbacks by dispatch key), from `Engine.stats()`."""

from __future__ import annotations


def print_report(s: dict) -> None:
    """Print the report of stats `s` (`Engine.stats()`, or the merged stats of several ranks / replicas)."""
    k = s["num_speculative_tokens"]
    print(f"\nsteps {s['steps']}, generated tokens {s['generated_tokens']}, wall {s['seconds']:.2f} s")
    replicas = s.get("per_replica", [])
    for d, r in enumerate(replicas if len(replicas) > 1 else []):  # data parallelism: each replica's share
        print(f"  replica {d}: steps {r['steps']}, tokens {r['generated_tokens']}, dummy steps {r['dummy_steps']}")
    if s.get("preemptions"):
        print(f"preemptions {s['preemptions']} (the KV cache ran out: requests were recomputed)")
    if s.get("overlapped_steps"):
        print(
            f"overlapped steps {s['overlapped_steps']} (launched before the step ahead of them was read; "
            f"{s['dropped_steps']} dropped: every request had stopped)"
        )
    if k:
        total = max(1, s["verify_steps"])
        print(f"acceptance histogram (accepted drafts per verify step, K={k}):")
        for a, count in enumerate(s["acceptance_histogram"]):
            bar = "#" * round(40 * count / total)
            print(f"  {a}: {count:6d} ({100 * count / total:5.1f}%) {bar}")
        print(
            f"acceptance rate {100 * s['acceptance_rate']:.1f}%, mean accepted length "
            f"{s['mean_accepted_length']:.2f} tokens per verify step"
        )
    if "compile" in s:
        c = s["compile"]
        replays, compiled, dynamic = (sum(c[k].values()) for k in ("graph_replays", "compiled_runs", "dynamic_runs"))
        ran = (
            f"piece runs: {replays} CUDA-graph replays, {compiled} compiled without graphs, {dynamic} on "
            f"dynamic-shape code past the captured sizes"
        )
    else:
        ran = "eager, no compilation"
    print(f"tokens/s {s['tokens_per_second']:.1f}  (mode {s['mode']}; {ran})")
    if s.get("dispatch") and s["mode"] != "NONE":
        hits = ", ".join(f"{key} {n}" for key, n in s["dispatch"].items())
        print(f"forwards by artifact ({s['fallbacks']} fallbacks without graphs): {hits}")
        if s["fallbacks_by_key"]:
            missed = ", ".join(f"{key} {n}" for key, n in s["fallbacks_by_key"].items())
            print(f"fallbacks by dispatch key: {missed}")
