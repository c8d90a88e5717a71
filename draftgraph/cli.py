"""The `draftgraph` command line (also `python -m draftgraph`)."""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from draftgraph import envs
from draftgraph.compiler.artifacts import ArtifactError


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", help="target checkpoint directory (default: the built-in model pair)")
    p.add_argument("--drafter", help="drafter checkpoint directory (default: the built-in drafter)")
    p.add_argument("--drafter-kind", choices=["eagle", "eagle3", "mtp", "draft_model"], help="default: detect")
    p.add_argument("--no-drafter", action="store_true", help="plain decoding with the target alone")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=3)
    p.add_argument("--mode", default="NONE", help="CUDA graph mode (default NONE)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--attention", default="auto", choices=["auto", "sdpa", "reference", "triton"])
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--capture-sizes", default="", help="comma-separated token counts (default: auto)")
    p.add_argument("--compile-backend", default="inductor", choices=["inductor", "eager"])
    p.add_argument("--no-cuda-graphs", action="store_true", help="compiled pieces without CUDA graphs")
    p.add_argument(
        "--capture",
        default="eager",
        choices=["eager", "lazy"],
        help="capture every CUDA graph at start (eager), or each when a step first needs it (lazy)",
    )
    p.add_argument(
        "--check-addresses",
        action="store_true",
        default=envs.check_addresses(),
        help="verify static input addresses at every graph replay (env DRAFTGRAPH_CHECK_ADDRESSES=1)",
    )
    p.add_argument(
        "--dump-graphs",
        default=envs.dump_graphs_dir(),
        help="write each pass's before/after graph here (env DRAFTGRAPH_DUMP_GRAPHS)",
    )


def _config(args, **over):
    import draftgraph as dg

    fields = dict(
        mode=args.mode,
        num_speculative_tokens=args.num_speculative_tokens,
        attention=args.attention,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
        drafter_kind=args.drafter_kind,
        capture_sizes=tuple(int(x) for x in args.capture_sizes.split(",") if x),
        compile_backend=args.compile_backend,
        use_cuda_graphs=not args.no_cuda_graphs,
        capture=args.capture,
        check_addresses=args.check_addresses,
        dump_graphs_dir=args.dump_graphs,
    )
    fields.update(over)
    return dg.CompileConfig(**fields)


def _models(args):
    """(target, drafter) from --target / --drafter, or the built-in pair."""
    from draftgraph.models.builtin import BuiltinSpec, builtin_pair

    if args.target:
        target, drafter = args.target, None if args.no_drafter else args.drafter
        if drafter is None and not args.no_drafter:
            print("no --drafter given: plain decoding with the target alone")
    else:
        spec = BuiltinSpec(seed=args.seed)
        print(
            f"built-in pair: {spec.family} target, {spec.num_layers} layers, hidden {spec.hidden_size}, "
            f"vocab {spec.vocab_size}; drafter: its first {spec.draft_layers} layers (shared weights)"
        )
        target, built_drafter = builtin_pair(spec)
        drafter = None if args.no_drafter else (args.drafter or built_drafter)
    return target, drafter


def cmd_generate(args) -> int:
    import draftgraph as dg

    config = _config(args)
    print(f"config: {config}")
    target, drafter = _models(args)
    t0 = time.perf_counter()
    engine = dg.compile_model(target, drafter, config, artifacts=args.artifacts, strict_artifacts=args.strict_artifacts)
    if engine.warm_up_report:
        print(engine.warm_up_report)
    print(
        f"engine ready in {time.perf_counter() - t0:.1f} s: mode {engine.config.mode.value}, device "
        f"{engine.config.device}, attention {engine.config.attention}, K={engine.k}"
    )
    gen = torch.Generator().manual_seed(args.seed)
    vocab = engine.target.cfg.vocab_size
    lengths = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (args.num_prompts,), generator=gen)
    prompts = [torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in lengths]
    params = dg.SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        ignore_eos=True,
        seed=args.seed,
    )
    outputs = engine.generate(prompts, params, progress=True)
    for out in outputs[: min(3, len(outputs))]:
        print(f"request {out.request_id}: prompt {out.prompt_token_ids[:8]}... -> {out.token_ids[:12]}...")
    print_report(engine.stats())
    if args.profile:
        from draftgraph.runtime.profiling import profile_steps

        for prompt in prompts:  # the same requests again, profiled for the first --profile steps
            engine.add_request(prompt, params)
        summary = profile_steps(engine, args.profile)
        while engine.has_unfinished():
            engine.step()
        print(summary.format())
    return 0


def print_report(s: dict) -> None:
    k = s["num_speculative_tokens"]
    print(f"\nsteps {s['steps']}, generated tokens {s['generated_tokens']}, wall {s['seconds']:.2f} s")
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


def cmd_build(args) -> int:
    """Compile every piece and every fused loop for every capture size, then write them as artifacts."""
    import os
    import tempfile

    import draftgraph as dg
    from draftgraph.compiler.artifacts import CACHE, build_artifacts, summary_text

    if args.mode == "NONE":
        print("draftgraph build: error: mode NONE compiles nothing; choose a compiling mode", file=sys.stderr)
        return 2
    if os.path.isdir(args.out) and os.listdir(args.out):
        print(f"draftgraph build: error: {args.out} is not empty; choose a new directory", file=sys.stderr)
        return 2
    # Graphs are captured at load, not here. On the CPU, Inductor's cache (the built C++ libraries, which a
    # CPU artifact does not bundle) goes into the artifact; a CUDA artifact bundles its kernels, and the
    # build's cache goes to a temporary directory.
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    with tempfile.TemporaryDirectory(prefix="draftgraph-build-") as tmp:
        cache = tmp if cuda else os.path.join(args.out, CACHE)
        config = _config(args, use_cuda_graphs=False, cache_dir=cache)
        print(f"config: {config}")
        target, drafter = _models(args)
        t0 = time.perf_counter()
        engine = dg.compile_model(target, drafter, config)
        manifest = build_artifacts(engine, args.out)
    print(summary_text(manifest), end="")
    print(f"built {args.out} in {time.perf_counter() - t0:.1f} s ({len(manifest['files'])} files)")
    return 0


def cmd_inspect(args) -> int:
    import draftgraph as dg
    from draftgraph.inspection.inspect import inspect_model
    from draftgraph.models.builtin import BuiltinSpec, builtin_drafter, builtin_pair

    if args.mode == "NONE":
        print(
            "draftgraph inspect: error: mode NONE compiles nothing; choose a compiling mode (e.g. PIECEWISE)",
            file=sys.stderr,
        )
        return 2
    config = dg.CompileConfig(
        mode=args.mode,
        num_speculative_tokens=args.num_speculative_tokens,
        device="cpu",
        dtype=args.dtype,
        attention="reference",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        capture_sizes=tuple(int(x) for x in args.capture_sizes.split(",") if x) or (1, 2, 4, 8, 16),
        compile_backend=args.compile_backend,
        drafter_kind=args.drafter_kind,
        progress=False,
    )
    if args.target:
        target, drafter = args.target, args.drafter
    else:
        target, _ = builtin_pair(BuiltinSpec(family=args.family, seed=args.seed))
        drafter = builtin_drafter(args.drafter_kind or "eagle", target)
    if args.no_drafter:
        drafter = None
    report = inspect_model(target, drafter, config, args.out)
    from draftgraph.inspection.inspect import summary_text

    print(summary_text(report), end="")
    print(f"inspection written to {args.out}")
    return 1 if report["graph_breaks"] else 0


def cmd_graph_diff(args) -> int:
    from draftgraph.inspection.graph_diff import main_diff

    return main_diff(args.a, args.b, args.json)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="draftgraph", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("generate", "run"):
        p = sub.add_parser(name, help="generate with speculative decoding and report acceptance and tokens/s")
        _add_common(p)
        p.add_argument("--num-prompts", type=int, default=8)
        p.add_argument("--prompt-len", type=int, default=24)
        p.add_argument("--max-tokens", type=int, default=64)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--top-k", type=int, default=0)
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--artifacts", help="load compiled code from this `draftgraph build` directory")
        p.add_argument(
            "--strict-artifacts",
            action="store_true",
            help="stop (exit 2) when the artifacts do not match, instead of compiling",
        )
        p.add_argument(
            "--profile",
            type=int,
            default=0,
            metavar="STEPS",
            help="afterwards, profile this many steps: GPU kernels launched from CUDA graphs vs outside them",
        )
        p.set_defaults(func=cmd_generate)
    p = sub.add_parser("build", help="compile ahead of time into an artifact directory (manifest, summary, code)")
    _add_common(p)
    p.add_argument("--out", required=True, help="artifact directory to write (new or empty)")
    p.set_defaults(func=cmd_build, mode="FULL_AND_PIECEWISE")
    p = sub.add_parser("inspect", help="write normalized graph dumps and a summary for a model pair and config")
    _add_common(p)
    p.add_argument("--out", required=True, help="inspection directory to write")
    p.add_argument(
        "--family",
        default="llama",
        choices=["llama", "qwen2", "qwen3", "mistral"],
        help="built-in target family (without --target)",
    )
    p.set_defaults(func=cmd_inspect, mode="PIECEWISE")
    p = sub.add_parser("graph-diff", help="compare two inspections; exit 0 equal, 1 different, 2 error")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_graph_diff)
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, TypeError, ArtifactError) as e:
        print(f"draftgraph: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
