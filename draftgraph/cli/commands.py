"""The `draftgraph` command line (also `python -m draftgraph`)."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from typing import NoReturn

from draftgraph import timeline
from draftgraph.cli import artifact_cache, flags
from draftgraph.cli.parser import build_parser
from draftgraph.cli.report import print_report
from draftgraph.cli.text import cli_tokenizer, generate_text, stop_token_ids, text_prompts

log = logging.getLogger("draftgraph")

# Nothing above loads torch: `main` starts the compile workers first (_prestart_workers), then imports it.


def cmd_generate(args) -> int:
    import draftgraph as dg

    config = flags.config(args)
    # Checked before anything is built or compiled: a bad value fails in well under a second.
    texts = text_prompts(args)  # text prompts, stop ids and the tokenizer too
    stops = stop_token_ids(args)
    tokenizer = cli_tokenizer(args, needed=bool(texts))
    params = dg.SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        ignore_eos=args.ignore_eos or not texts,  # random prompts run to max_tokens
        stop_token_ids=stops,
        seed=args.seed,
    )
    if args.profile and config.tensor_parallel_size * config.data_parallel_size > 1:
        raise ValueError(
            f"--profile reads one process's engine; it runs with --tp 1 --dp 1 only, not --tp {args.tp} --dp {args.dp}"
        )
    for name in ("num_prompts", "prompt_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    print(f"config: {config}")
    t0 = time.perf_counter()
    engine = _engine(args, config, tokenizer)
    why = f" (auto: {engine.config.mode_reason})" if engine.config.mode_reason else ""
    now = time.perf_counter()
    timeline.mark("engine ready", _freeze_engine())
    print(
        f"engine ready in {now - t0:.1f} s ({timeline.since_start():.1f} s since the process started): mode "
        f"{engine.config.mode.value}{why}, device {engine.config.device}, attention {engine.config.attention}, "
        f"K={engine.k}"
    )
    if texts:
        generate_text(engine, texts, params, args.stream)
        print_report(engine.stats())
        _cache(args, engine)
        return 0
    import torch

    gen = torch.Generator().manual_seed(args.seed)
    vocab = engine.vocab_size
    lengths = torch.randint(args.prompt_len // 2, args.prompt_len + 1, (args.num_prompts,), generator=gen)
    prompts = [torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in lengths]
    outputs = engine.generate(prompts, params, progress=True)
    for out in outputs[: min(3, len(outputs))]:
        print(f"request {out.request_id}: prompt {out.prompt_token_ids[:8]}... -> {out.token_ids[:12]}...")
    print_report(engine.stats())
    _cache(args, engine)
    if args.profile:
        from draftgraph.runtime.profiling import profile_steps

        for prompt in prompts:  # the same requests again, profiled for the first --profile steps
            engine.add_request(prompt, params)
        summary = profile_steps(engine, args.profile)
        while engine.has_unfinished():
            engine.step()
        print(summary.format())
    return 0


def _cache(args, engine) -> None:
    """After generate's output (serve: once its engine is built): keep the compiled code for the next start with these
    flags (artifact_cache.py)."""
    sys.stdout.flush()
    if artifact_cache.store(args, engine) is not None:
        timeline.mark("artifacts cached", "for the next start")


def _engine(args, config, tokenizer):
    """The engine `generate` and `serve` run: the flags' models through compile_model; its report printed."""
    import draftgraph as dg

    target, drafter, where = flags.models(args)
    timeline.mark("models", where)
    cached = artifact_cache.lookup(args)  # generate: what the last start with these flags compiled
    if cached is not None:
        log.info("loading the compiled code the last start with these flags cached: %s", cached)
    engine = dg.compile_model(
        target,
        drafter,
        config,
        artifacts=args.artifacts or cached,
        strict_artifacts=args.strict_artifacts,
        tokenizer=tokenizer,
        verify_key=args.verify_key,
    )
    if engine.warm_up_report:
        print(engine.warm_up_report)
    return engine


def cmd_serve(args) -> int:
    """Bind first, then build the engine in the server's engine thread (/health: 503 until it is ready). Under
    torchrun, rank 0 serves and leads; the other ranks build their engines and follow rank 0's calls."""
    from draftgraph.workers.launched import launch_env

    config = flags.config(args)
    tokenizer = cli_tokenizer(args, needed=False)
    name = args.served_model_name or args.target or "draftgraph-builtin"
    try:
        from draftgraph.serve.server import bind, serve
    except ImportError as e:  # the `serve` extra is not installed
        raise ValueError(
            f'draftgraph serve needs FastAPI, uvicorn and prometheus-client ({e}); pip install -e ".[serve]"'
        ) from e
    print(f"config: {config}")
    launch = launch_env()
    several = launch is not None and launch.world_size > 1

    def make_engine():
        engine = _engine(args, config, tokenizer)
        _cache(args, engine)  # (before serving: its dummy runs use the engine's buffers)
        _freeze_engine()
        print(f"engine ready: mode {engine.config.mode.value}, device {engine.config.device}, K={engine.k}", flush=True)
        if several and launch.rank == 0:
            engine.lead()
        return engine

    if several and launch.rank != 0:  # a follower: no HTTP; rank 0's calls until it stops
        make_engine().follow()
        return 0
    return serve(make_engine, bind(args.host, args.port), name, args.max_queue)


def cmd_build(args) -> int:
    """Compile every piece and every fused loop for every capture size, then write them as artifacts."""
    import functools
    import tempfile

    import draftgraph as dg
    from draftgraph.artifacts.store import CACHE, build_artifacts, summary_text

    if args.mode == "NONE":
        print("draftgraph build: error: mode NONE compiles nothing; choose a compiling mode", file=sys.stderr)
        return 2
    from draftgraph.artifacts.signing import read_key, sign_manifest

    key = read_key(args.sign_key) if args.sign_key else None  # a bad key fails before anything compiles
    mode = "FULL_AND_PIECEWISE" if args.mode == "auto" else args.mode  # graphs are captured when loaded
    from draftgraph.workers.launched import launch_env

    launch = launch_env()  # under torchrun each rank checks (and writes) its own OUT/rank-R only
    mine = args.out if launch is None or launch.world_size == 1 else os.path.join(args.out, f"rank-{launch.rank}")
    if os.path.isdir(mine) and os.listdir(mine):
        print(f"draftgraph build: error: {mine} is not empty; choose a new directory", file=sys.stderr)
        return 2
    # Graphs are captured at load, not here. On the CPU, Inductor's cache (the built C++ libraries, which a
    # CPU artifact does not bundle) goes into the artifact; a CUDA artifact bundles its kernels, and the
    # build's cache goes to a temporary directory.
    import torch

    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    with tempfile.TemporaryDirectory(prefix="draftgraph-build-") as tmp:
        cache = tmp if cuda else os.path.join(args.out, CACHE)
        config = flags.config(args, mode=mode, use_cuda_graphs=False, cache_dir=cache, gpu_memory_utilization=0.0)
        print(f"config: {config}")
        target, drafter, _ = flags.models(args)
        t0 = time.perf_counter()
        if config.tensor_parallel_size * config.data_parallel_size > 1:  # one artifact set per rank: OUT/rank-R
            from draftgraph.build.request import BuildRequest
            from draftgraph.workers.build import build_ranks

            manifests = build_ranks(BuildRequest(target, drafter, config), args.out)
        else:
            # the built-in pair's target goes inside (generate --artifacts reads it without transformers)
            extra = None if args.target else functools.partial(artifact_cache.write_builtin, flags.builtin_spec(args))
            manifests = [build_artifacts(dg.compile_model(target, drafter, config), args.out, extra=extra)]
    if key is not None:  # each rank's manifest (OUT/rank-R), or OUT's; under torchrun, this rank's own
        many = len(manifests) > 1 and launch is None
        for d in [os.path.join(args.out, f"rank-{r}") for r in range(len(manifests))] if many else [mine]:
            print(f"signed {sign_manifest(d, key)}")
    print(summary_text(manifests[0]), end="")
    where = f" (rank-0 .. rank-{len(manifests) - 1}, one per rank)" if len(manifests) > 1 else ""
    files = sum(len(m["files"]) for m in manifests)
    print(f"built {args.out}{where} in {time.perf_counter() - t0:.1f} s ({files} files)")
    return 0


def cmd_inspect(args) -> int:
    import draftgraph as dg
    from draftgraph.inspection.report import inspect_model
    from draftgraph.models.builtin import BuiltinSpec, builtin_drafter, builtin_pair

    if args.mode == "NONE":
        print(
            "draftgraph inspect: error: mode NONE compiles nothing; choose a compiling mode (e.g. PIECEWISE)",
            file=sys.stderr,
        )
        return 2
    config = dg.CompileConfig(
        mode="PIECEWISE" if args.mode == "auto" else args.mode,  # inspection compiles on the CPU
        num_speculative_tokens=args.num_speculative_tokens,
        device="cpu",
        dtype=args.dtype,
        attention="reference",
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        capture_sizes=tuple(int(x) for x in args.capture_sizes.split(",") if x) or (1, 2, 4, 8, 16),
        compile_backend=args.compile_backend,
        drafter_kind=args.drafter_kind,
        fuse_draft_loop=flags.FUSE[args.fuse_draft_loop],
        progress=False,
    )
    if args.target:
        target, drafter = args.target, args.drafter
    elif args.family == "deepseek_v32":
        from draftgraph.models.builtin_deepseek import builtin_deepseek_v32_hf
        from draftgraph.models.causal_lm import CausalLM

        target = CausalLM.from_hf(builtin_deepseek_v32_hf(args.seed))
        drafter = builtin_drafter(args.drafter_kind or "mtp", target)
    elif args.family == "qwen3_5":
        from draftgraph.models.builtin_qwen3_5 import builtin_qwen3_5_hf
        from draftgraph.models.causal_lm import CausalLM

        target = CausalLM.from_hf(builtin_qwen3_5_hf(args.seed))
        drafter = builtin_drafter(args.drafter_kind or "mtp", target)
    else:
        target, _ = builtin_pair(BuiltinSpec(family=args.family, seed=args.seed))
        drafter = builtin_drafter(args.drafter_kind or "eagle", target)
    if args.no_drafter:
        drafter = None
    report = inspect_model(target, drafter, config, args.out)
    from draftgraph.inspection.report import summary_text

    print(summary_text(report), end="")
    print(f"inspection written to {args.out}")
    return 1 if report["graph_breaks"] else 0


def cmd_graph_diff(args) -> int:
    from draftgraph.inspection.graph_diff import main_diff

    return main_diff(args.a, args.b, args.json)


def _prestart_workers(args):
    """`generate` on a GPU, compiling with workers (the defaults): the compile workers' process starts before
    this one imports torch, so that both import it side by side; its workers wait (no CUDA start, no prewarm)
    until `_command` releases them after this process's imports. The engine build takes the pool when its
    settings match (compiler/pool/pool_lifetime.py: prestart). `--device auto` counts as a GPU where the NVIDIA
    driver's device node exists; where torch then finds none, the build closes the pool. Returns the pool, or
    None when none was started."""
    if args.command not in ("generate", "run", "serve") or args.mode == "NONE" or args.artifacts:
        return None
    if artifact_cache.lookup(args) is not None:  # the last start's compiled code loads: nothing to compile
        return None
    if args.compile_backend != "inductor" or args.compile_workers == 0 or args.tp * args.dp > 1:
        return None
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:  # under torchrun: each rank starts its own
        return None
    if args.device == "cpu" or (args.device == "auto" and not os.path.exists("/dev/nvidiactl")):
        return None
    from draftgraph.compiler.pool.pool_lifetime import auto_workers, prestart

    return prestart(args.compile_workers or auto_workers("cuda"), "cuda:0")


def _prestart_ranks(args) -> None:
    """`generate` or `serve` with several ranks on GPUs: the ranks' processes start before this one imports torch,
    import theirs and make their device contexts beside it, then wait for the build (workers/prestart.py). Not under
    a launcher (torchrun started the ranks) and not on the CPU (forked ranks start in milliseconds)."""
    world = getattr(args, "tp", 1) * getattr(args, "dp", 1)
    if args.command not in ("generate", "run", "serve") or world == 1:
        return
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
        return
    if args.device == "cpu" or (args.device == "auto" and not os.path.exists("/dev/nvidiactl")):
        return
    from draftgraph.workers.prestart import prestart_ranks

    prestart_ranks(world, cuda=True)


def _compiles(args) -> bool:
    """Whether the command's engine runs compiled code (traces, or loads artifacts): `build`, and `generate` and
    `serve` in any mode but NONE, which "auto" is on the CPU. (`--device auto` counts as a GPU where the NVIDIA
    driver's device node exists, as for _prestart_workers: no CUDA call before the imports are done.)"""
    if args.command not in ("generate", "run", "serve", "build") or args.mode == "NONE":
        return False
    if args.command == "build" or args.mode != "auto" or args.device == "cuda":
        return True
    return args.device == "auto" and os.path.exists("/dev/nvidiactl")


def _import_compiler(args) -> None:
    """What a compiling command imports anyway (Dynamo, and Inductor's compile path, which loading compiled code
    uses too), imported with the rest of the start's imports: `run` then freezes their objects out of the
    collector's sight (_freeze_imports), instead of collections scanning them while the engine traces or loads. An
    engine of mode NONE imports none of it (draftgraph's modules import Dynamo and sympy where they use them)."""
    if not _compiles(args):
        return
    import torch._dynamo  # noqa: F401

    if args.compile_backend == "inductor":
        import torch._inductor.compile_fx  # noqa: F401


def main(argv: list[str] | None = None) -> int:
    """Run one command in this process; returns its exit status (`run` is the command's process)."""
    return _command(_parse(argv))


def _parse(argv: list[str] | None):
    parser = build_parser(
        {
            "generate": cmd_generate,
            "build": cmd_build,
            "inspect": cmd_inspect,
            "graph-diff": cmd_graph_diff,
            "serve": cmd_serve,
        }
    )
    return parser.parse_args(argv)


def _command(args, after_imports=None) -> int:
    """Run the parsed command; `after_imports`: called once torch, Inductor and draftgraph are imported, before any
    work (`run` freezes the collector's view there)."""
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s")
    pool = _prestart_workers(args)
    _prestart_ranks(args)
    artifact_cache.prestart_builtin(args)  # (a cold start: the built-in pair's checkpoint written beside the imports)
    from draftgraph.artifacts.store import ArtifactError
    from draftgraph.workers.ranked import WorkerError

    if pool is not None:  # torch is imported here: the prestarted workers start (CUDA, prewarm) now
        pool.release()
    _import_compiler(args)
    note = after_imports() if after_imports is not None else None
    timeline.mark("imports", note or "")

    try:
        from draftgraph.workers.launched import launch_env

        launch = launch_env()  # under torchrun every rank runs this command; rank 0 alone prints
        if launch is None or launch.rank == 0:
            return args.func(args)
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            return args.func(args)
    except (ValueError, FileNotFoundError, TypeError, ArtifactError) as e:
        print(f"draftgraph: error: {e}", file=sys.stderr)
        return 2
    except WorkerError as e:  # a rank's error, named; its traceback with -v
        text = str(e) if args.verbose else str(e).split("\nTraceback (most recent call last)")[0]
        print(f"draftgraph: error: {text}", file=sys.stderr)
        return 2


def run(argv: list[str] | None = None) -> NoReturn:
    """The `draftgraph` command's process: `main`, then `finish` (no slow teardown after the output)."""
    args = _parse(argv)
    finish(_command(args, after_imports=_freeze_imports), args.verbose)


def _freeze_imports() -> str:
    """What the imports made (about 300,000 objects: torch's, Inductor's, sympy's modules) lives as long as the
    process: moved out of the garbage collector's sight (gc.freeze), so that start-up's full collections (before KV
    sizing and around capture, 0.17 s each on a GPU host) and the automatic ones while tracing skip it. Only the
    command's own process does this (`run`: it ends with os._exit, nothing frozen is ever freed); `main`, which
    tests call in their process, does not."""
    import gc

    global _FROZEN
    gc.freeze()
    _FROZEN = True
    return f"{gc.get_freeze_count()} objects frozen out of the collector's sight"


_FROZEN = False  # whether this is `run`'s process, its imports frozen (under `main` nothing is frozen)


def _freeze_engine() -> str:
    """In `run`'s process, once its engine is built: what the build made (compiled code, FX graphs, CUDA graphs,
    caches) lives as long as the process too, so it is frozen like the imports; the automatic collections the steps'
    garbage triggers then walk only that garbage, not every object the engine holds (a full one takes tens of ms,
    a step's worth of time, wherever it falls). Returns what it froze ("" under `main`)."""
    if not _FROZEN:
        return ""
    import gc

    before = gc.get_freeze_count()
    gc.freeze()
    return f"{gc.get_freeze_count() - before} more objects frozen"


def finish(rc: int, verbose: bool = False) -> NoReturn:
    """End the process once the command's output is out: run the exit handlers that clean up (compile and worker
    processes, temporary directories), print the start-up timeline (with -v: its last line, what the handlers
    cost), flush, then end without the interpreter's teardown. Skipped: Inductor's wait for its compile
    subprocesses to shut down (seconds: 10 s on an H100, where they were still starting; they end themselves when
    this process is gone), freeing every object and the CUDA context one by one (the kernel reclaims it all at
    once)."""
    timeline.mark("exit")
    from draftgraph.workers.process_end import exit_now, run_exit_handlers

    # Ours (prestarted compile pools, worker ranks, private caches, weakref.finalize'd objects), logging's flush,
    # and any other library's.
    run_exit_handlers()
    if verbose:  # (printed after the handlers, so that the timeline says what they cost)
        timeline.mark("exit handlers")
        print(timeline.report(), file=sys.stderr)
    exit_now(rc)


if __name__ == "__main__":
    run()
