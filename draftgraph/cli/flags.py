"""What the command-line flags build: the resolved CompileConfig (`config`, with --capture auto decided per command)
and the models (`models`: --target / --drafter, or the built-in pair, read from a checkpoint where one is kept).
Nothing here imports torch at module level: the command starts its compile workers before torch loads."""

from __future__ import annotations

import logging

from draftgraph.cli import artifact_cache

log = logging.getLogger("draftgraph")


def config(args, **over):
    import draftgraph as dg

    fields = dict(
        mode=args.mode,
        num_speculative_tokens=args.num_speculative_tokens,
        speculation=getattr(args, "speculation", "auto"),
        attention=args.attention,
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        seed=args.seed,
        drafter_kind=args.drafter_kind,
        ngram_min=getattr(args, "ngram_min", 1),
        ngram_max=getattr(args, "ngram_max", 3),
        capture_sizes=tuple(int(x) for x in args.capture_sizes.split(",") if x),
        compile_sizes=tuple(int(x) for x in args.compile_sizes.split(",") if x),
        compile_backend=args.compile_backend,
        use_cuda_graphs=not args.no_cuda_graphs,
        capture=capture(args),
        fuse_draft_loop=FUSE[args.fuse_draft_loop],
        overlap_steps=not getattr(args, "no_overlap_steps", False),
        prefix_caching=not getattr(args, "no_prefix_caching", False),
        prefix_state_snapshots=getattr(args, "prefix_state_snapshots", 0),
        check_addresses=args.check_addresses,
        dump_graphs_dir=args.dump_graphs,
        inductor_options=inductor_options(args.inductor_option),
        ops=op_choices(getattr(args, "ops", "")),
        compile_workers=getattr(args, "compile_workers", None),
        tensor_parallel_size=getattr(args, "tp", 1),
        draft_tensor_parallel_size=getattr(args, "draft_tp", None),
        data_parallel_size=getattr(args, "dp", 1),
        expert_parallel=getattr(args, "expert_parallel", False),
        all_reduce=getattr(args, "all_reduce", "auto"),
    )
    fields.update(over)
    config = dg.CompileConfig(**fields)
    from draftgraph.workers.launched import uses_launch

    uses_launch(config)  # under torchrun: a launch that is not tp x dp processes is refused before anything loads
    return config


def capture(args) -> str:
    """--capture auto: lazy for `generate` and its alias `run` (graphs captured by the steps that need them: the
    first token does not wait for sizes the job may never run), also at several tensor-parallel ranks (they take the
    same steps, so each captures a graph, its collectives inside, at the same step as its peers); eager for `serve`
    (steady latency from the first request), for adaptive speculation (its cost model measures the captured graphs
    at start) and for data-parallel replicas (each steps its own requests: every graph at start, as before)."""
    if args.capture != "auto":
        return args.capture
    adaptive = getattr(args, "speculation", "fixed") == "adaptive"
    one_off = getattr(args, "command", "") in ("generate", "run")
    return "lazy" if one_off and not adaptive and getattr(args, "dp", 1) == 1 else "eager"


FUSE = {"auto": "auto", "on": True, "off": False}  # --fuse-draft-loop -> CompileConfig.fuse_draft_loop


def op_choices(spec: str):
    """--ops NAME=0|1,... -> an OpChoices, or None (every kernel) when empty."""
    from draftgraph.ops.choices import OpChoices

    return OpChoices.parse(spec) if spec else None


def inductor_options(given: list[str] | None):
    """--inductor-option KEY=VALUE pairs (VALUE a Python literal), or None for draftgraph's defaults."""
    if not given:
        return None
    import ast

    pairs = []
    for item in given:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(
                f"draftgraph: error: --inductor-option {item!r} must be KEY=VALUE, e.g. split_reductions=False"
            )
        try:
            pairs.append((key.strip(), ast.literal_eval(value.strip())))
        except (ValueError, SyntaxError):
            pairs.append((key.strip(), value.strip()))  # a bare word is a string
    return tuple(pairs)


def models(args):
    """(target, drafter, where) from --target / --drafter, or the built-in pair; `where`: the timeline's note."""
    from draftgraph.models.builtin import builtin_hf_pair, builtin_pair
    from draftgraph.ops.choices import DEFAULT_OPS

    if args.target:
        target, drafter = args.target, None if args.no_drafter else args.drafter
        if drafter is None and not args.no_drafter:
            print("no --drafter given: plain decoding with the target alone")
        return target, drafter, ""
    spec = builtin_spec(args)
    print(
        f"built-in pair: {spec.family} target, {spec.num_layers} layers, hidden {spec.hidden_size}, "
        f"vocab {spec.vocab_size}; drafter: its first {spec.draft_layers} layers (shared weights)"
    )
    # Several ranks load their shares from checkpoints: the start-up cache's (the target's, and the drafter's
    # written from it), else the pair crosses as transformers objects.
    split = getattr(args, "tp", 1) * getattr(args, "dp", 1) > 1
    ops = op_choices(getattr(args, "ops", "")) or DEFAULT_OPS  # the layers are built with --ops
    # the same weights, read without importing transformers: from --artifacts (draftgraph build wrote them
    # there), else from the start-up cache
    inside = artifact_cache.builtin_in_artifacts(args, spec)
    checkpoint = inside or _builtin_checkpoint(args, spec)
    if checkpoint is not None and split:
        drafter = None if args.no_drafter else (args.drafter or _builtin_drafter(spec, checkpoint))
        if drafter is not None or args.no_drafter or args.drafter:
            return checkpoint, drafter, "built-in pair, checkpoints"
        checkpoint = None  # (the drafter's could not be written: the pair in memory)
    if checkpoint is not None:
        from draftgraph.models.causal_lm import CausalLM
        from draftgraph.models.drafters.loader import truncated_draft_model

        target = CausalLM.from_pretrained(checkpoint, ops=ops)
        built_drafter = truncated_draft_model(target, spec.draft_layers)
    else:
        target, built_drafter = builtin_hf_pair(spec) if split else builtin_pair(spec, ops=ops)
    drafter = None if args.no_drafter else (args.drafter or built_drafter)
    return target, drafter, "built-in pair" + (", from the artifacts" if inside else "")


def _builtin_drafter(spec, target: str) -> str | None:
    """The built-in drafter's checkpoint beside the cached target's (artifact_cache.py), or None where it could not
    be written (logged)."""
    try:
        return artifact_cache.builtin_drafter_checkpoint(spec, target)
    except Exception as e:  # noqa: BLE001 - a cache: the pair is built in memory instead
        log.warning("the built-in drafter's weights were not cached (%s: %s)", type(e).__name__, e)
        return None


def builtin_spec(args):
    """The built-in pair of these flags (its weights follow --seed)."""
    from draftgraph.models.builtin import BuiltinSpec

    return BuiltinSpec(seed=args.seed)


def _builtin_checkpoint(args, spec) -> str | None:
    """The built-in target's cached checkpoint (artifact_cache.py), or None: not used by this command, or it could
    not be written (logged; the pair is built in memory instead)."""
    if not artifact_cache.builtin_enabled(args):
        return None
    try:
        return artifact_cache.builtin_checkpoint(spec)
    except Exception as e:  # noqa: BLE001 - a cache: the pair is built in memory instead
        log.warning("the built-in pair's weights were not cached (%s: %s)", type(e).__name__, e)
        return None
