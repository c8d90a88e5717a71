"""compile_model: load a target and drafter from any supported form and build the engine for them."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch

from draftgraph.compiler.artifacts import ArtifactError, load_functions, mismatches, read_manifest
from draftgraph.compiler.capture import build_compiled
from draftgraph.compiler.config import CompileConfig, CUDAGraphMode, resolve
from draftgraph.compiler.memory import measure_and_plan
from draftgraph.models.drafters.base import Drafter
from draftgraph.models.drafters.loader import load_drafter
from draftgraph.models.llama import CausalLM
from draftgraph.runtime.engine import Engine
from draftgraph.runtime.text import resolve_tokenizer

log = logging.getLogger("draftgraph")


def set_kernel_impl(model: torch.nn.Module, impl: str) -> None:
    """Point every attention and MoE module of `model` at the kernels `impl` ("triton" / "reference")."""
    for m in model.modules():
        if hasattr(m, "attn_impl"):
            m.attn_impl = impl


def load_target(source: Any, device, dtype, attn_impl: str) -> CausalLM:
    """A draftgraph CausalLM from a checkpoint dir, a transformers model object or a CausalLM."""
    if isinstance(source, CausalLM):
        model = source
    elif isinstance(source, str):
        model = CausalLM.from_pretrained(source, dtype=dtype, device=device, attn_impl=attn_impl)
    elif isinstance(source, torch.nn.Module) and hasattr(source, "config"):
        model = CausalLM.from_hf(source, dtype=dtype, device=device, attn_impl=attn_impl)
    else:
        raise TypeError(
            f"target of type {type(source).__name__} is not supported; pass a checkpoint directory, a "
            "transformers *ForCausalLM object or a draftgraph CausalLM"
        )
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    set_kernel_impl(model, attn_impl)
    return model


def compile_model(
    target: Any,
    drafter: Any = None,
    config: CompileConfig | None = None,
    artifacts: str | None = None,
    strict_artifacts: bool = False,
    tokenizer: Any = None,
) -> Engine:
    """Build a speculative decoding engine for `target` (and `drafter`, any supported form, or None).

    `artifacts`: a directory written by `draftgraph build` (compiler/artifacts.py). Its compiled code is
    loaded without tracing or compiling; only CUDA graph capture remains. When it was built for something
    else (a version, the GPU, the config, a model, draftgraph's sources) or a file fails its checksum, the
    reason is logged and the engine compiles as usual, or raises `ArtifactError` with `strict_artifacts`.

    `tokenizer`: a transformers tokenizer, a directory holding one, False for none, or None (default): the
    one saved beside a target checkpoint, if any. With one, `generate` takes text prompts and outputs carry
    `.text` (runtime/text.py)."""
    config = config or CompileConfig()
    tok = resolve_tokenizer(tokenizer, target)  # before any weight is read: a bad tokenizer fails fast
    max_pos = getattr(getattr(target, "cfg", None), "max_position_embeddings", None)
    if max_pos is None and hasattr(target, "config"):
        max_pos = getattr(target.config, "max_position_embeddings", None)
    rc = resolve(config, max_pos, drafter is not None)
    model = load_target(target, rc.device, rc.dtype, rc.attention)
    draft: Drafter | None = None
    if drafter is not None:
        draft = load_drafter(
            drafter, model, kind=config.drafter_kind, device=rc.device, attn_impl=rc.attention, dtype=model.cfg.dtype
        )
        draft = draft.to(rc.device)
        set_kernel_impl(draft, rc.attention)
    compiled = None
    if rc.mode != CUDAGraphMode.NONE:
        compiled = build_compiled(
            model,
            draft,
            rc,
            config.compile_backend,
            config.cache_dir,
            config.check_addresses,
            config.dump_graphs_dir,
            config.progress,
        )

    artifact_note = ""
    if artifacts is not None:
        if compiled is None:
            raise ValueError("artifacts hold compiled code, which mode NONE does not use; choose a compiling mode")
        artifact_note = _use_artifacts(artifacts, strict_artifacts, compiled, rc, model, draft)

    def build(resolved):
        if compiled is None:
            return Engine(model, draft, resolved)
        return Engine(model, draft, resolved, compiled.target, compiled.drafter, compiled)

    plan = None
    if config.gpu_memory_utilization:  # measure weights, activations and graphs first, then size the KV cache
        plan = measure_and_plan(build, rc, config.gpu_memory_utilization)
        rc = replace(rc, num_kv_blocks=plan.num_blocks)
    engine = build(rc)
    engine.memory_plan = plan
    engine.tokenizer = tok
    if compiled is not None:
        engine.warm_up_report = engine.warm_up()
    if plan is not None:
        engine.warm_up_report = "; ".join(x for x in (engine.warm_up_report, plan.describe()) if x)
    if artifact_note:
        engine.warm_up_report = "; ".join(x for x in (artifact_note, engine.warm_up_report) if x)
    return engine


def _use_artifacts(path: str, strict: bool, compiled, rc, model, draft) -> str:
    """Load the artifacts into `compiled`, or say why not (and raise when strict)."""
    import time

    t0 = time.perf_counter()
    try:
        manifest = read_manifest(path)
        diffs = mismatches(manifest, rc, model, draft)
        if diffs:
            raise ArtifactError(
                f"artifacts in {path} were built for something else: "
                + "; ".join(f"{k}: built for {a!r}, running {b!r}" for k, a, b in diffs)
            )
    except ArtifactError as e:
        if strict:
            raise
        log.warning("%s; compiling instead", e)
        return f"artifacts not used ({e}); compiled instead"
    fns = {"target": model.forward}
    if draft is not None:
        fns["drafter"] = draft.forward
    if compiled.loops is not None:
        fns["draft_loop"] = tuple(loop.loop_fn for loop in compiled.loops)
    load_functions(path, manifest, compiled, fns)
    return f"loaded compiled code from {path} in {time.perf_counter() - t0:.1f} s (no trace, no Inductor compile)"
