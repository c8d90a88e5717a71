"""CPU prefill: a long prompt through transformers' SDPA path against draftgraph's engine (mode NONE).

A small random-weight Llama (hidden 256, 4 layers, 4 query / 2 KV heads by default). transformers runs the
prompt as one forward with `attn_implementation="sdpa"` and `logits_to_keep=1` (what its generate() does
for the first token); draftgraph runs `engine.generate(prompt, max_tokens=1)` without a drafter, with its
default chunked prefill (512 tokens per step) and each attention implementation asked for. Times are
wall-clock medians over --runs interleaved runs after one warm-up; both sides produce the same first token.

Usage: python scripts/bench_cpu_prefill.py [--tokens 3000] [--runs 5] [--impl sdpa reference]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch


def build_hf(args):
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def medians_s(fns: dict, runs: int) -> dict:
    """Median wall and process CPU time of each function: {name: (wall s, cpu s)}. Runs interleave (a, b, a,
    b, ...) so that load from other processes on a shared machine falls on every side alike; CPU time is
    the steadier of the two there."""
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(runs):
        for name, fn in fns.items():
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            times[name].append((time.perf_counter() - t0, time.process_time() - c0))
    return {name: tuple(statistics.median(col) for col in zip(*ts)) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--impl", nargs="+", default=["sdpa"], choices=["sdpa", "reference"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers

    import draftgraph as dg

    hf = build_hf(args)
    prompt = torch.randint(0, args.vocab, (args.tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        first = int(hf(ids, logits_to_keep=1).logits[0, -1].argmax())

    def run_hf():
        with torch.inference_mode():
            hf(ids, logits_to_keep=1)

    print(
        f"# {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"transformers {transformers.__version__}; Llama hidden {args.hidden}, {args.layers} layers, "
        f"{args.heads}/{args.kv_heads} heads, vocab {args.vocab}; {args.tokens}-token prompt, median of {args.runs}"
    )
    fns = {"transformers sdpa": run_hf}
    for impl in args.impl:
        config = dg.CompileConfig(
            mode="NONE",
            device="cpu",
            attention=impl,
            max_num_seqs=1,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.tokens + 16,
            progress=False,
        )
        engine = dg.compile_model(hf, None, config)
        params = dg.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        got = engine.generate([prompt], params)[0].token_ids[0]
        assert got == first, f"draftgraph ({impl}) first token {got} != transformers' {first}"
        fns[f"draftgraph NONE, attention {impl}"] = lambda engine=engine, params=params: engine.generate(
            [prompt], params
        )
    rows = medians_s(fns, args.runs)
    base_wall, base_cpu = rows["transformers sdpa"]
    print("| run | wall s | / transformers | CPU s | / transformers |\n|---|---:|---:|---:|---:|")
    for name, (wall, cpu) in rows.items():
        print(f"| {name} | {wall:.3f} | {wall / base_wall:.2f} | {cpu:.3f} | {cpu / base_cpu:.2f} |")


if __name__ == "__main__":
    main()
