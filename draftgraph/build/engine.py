"""build_engine: one process's engine from a `BuildRequest` (request.py), the one path both compile_model
(api.py) and every worker rank (workers/worker.py) take.

In order: the tokenizer; everything that can be checked without weights (preflight.py) and the resolved
config; the compile pool, started now so that its start overlaps the weights' loading; the target and
drafter (this rank's share with a tensor-parallel group); the compiled functions (compiler/build.py) or the
artifacts' code (artifacts/store.py); then the Engine, which sizes its KV cache, warms up and captures as
it is constructed (runtime/engine.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

import torch

from draftgraph import timeline
from draftgraph.artifacts.signing import SignatureError, read_key
from draftgraph.artifacts.store import ArtifactError, check_artifacts, load_functions
from draftgraph.build.preflight import artifact_mode, check_checkpoints, check_kv_memory, target_config
from draftgraph.build.request import BuildRequest
from draftgraph.compiler.build import CompileSettings, build_compiled
from draftgraph.compiler.config import DTYPES, CUDAGraphMode, ResolvedConfig, resolve
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.drafters.base import Drafter
from draftgraph.models.drafters.loader import load_drafter
from draftgraph.models.drafters.ngram import NGRAM, is_ngram
from draftgraph.ops.choices import DEFAULT_OPS, OpChoices, check_op_choices
from draftgraph.ops.collectives.op import SINGLE, ExpertGroups, ParallelGroup
from draftgraph.runtime.drafting import Chooser, fused_loop_fn
from draftgraph.runtime.engine import Engine
from draftgraph.runtime.text import resolve_tokenizer

log = logging.getLogger("draftgraph")


def set_kernel_impl(model: torch.nn.Module, impl: str) -> None:
    """Point every attention and MoE module of `model` at the kernels `impl` ("triton" / "reference")."""
    for m in model.modules():
        if hasattr(m, "attn_impl"):
            m.attn_impl = impl


def load_target(
    source: Any, device, dtype, attn_impl: str, tp: ParallelGroup = SINGLE, ops: OpChoices = DEFAULT_OPS
) -> CausalLM:
    """A draftgraph CausalLM from a checkpoint dir, a transformers model object or a CausalLM; with a
    tensor-parallel `tp`, this rank's share (from a checkpoint dir or a transformers object); its layers use the
    kernels `ops` names (a CausalLM passed in must have been built with them)."""
    if isinstance(source, CausalLM):
        check_op_choices(source, ops, "the target")
        if tp.world_size > 1 and source.tp.world_size != tp.world_size:
            raise ValueError(
                f"a draftgraph CausalLM object cannot be split over tensor_parallel_size={tp.world_size} here; pass "
                "its checkpoint directory or the transformers model instead (each rank then loads its share)"
            )
        model = source
    elif isinstance(source, str):
        model = CausalLM.from_pretrained(source, dtype=dtype, device=device, attn_impl=attn_impl, tp=tp, ops=ops)
    elif isinstance(source, torch.nn.Module) and hasattr(source, "config"):
        model = CausalLM.from_hf(source, dtype=dtype, device=device, attn_impl=attn_impl, tp=tp, ops=ops)
    else:
        raise TypeError(
            f"target of type {type(source).__name__} is not supported; pass a checkpoint directory, a "
            "transformers *ForCausalLM object or a draftgraph CausalLM"
        )
    model = model.to(device=device, dtype=dtype) if dtype is not None else model.to(device)
    set_kernel_impl(model, attn_impl)
    return model


def build_engine(
    request: BuildRequest, tp: ParallelGroup = SINGLE, ep: ExpertGroups | None = None, lockstep_group: str = ""
) -> Engine:
    """One process's engine (compile_model's work on one device; each worker rank's, workers/worker.py, with
    its tensor-parallel group `tp`, with expert parallelism its expert-parallel groups `ep`, and across
    replicas the CPU group its steps agree over, `lockstep_group`: runtime/lockstep.py)."""
    target, drafter, config, artifacts = request.target, request.drafter, request.config, request.artifacts
    if is_ngram(drafter, config.drafter_kind):  # models/drafters/ngram.py: no checkpoint, no model
        if tp.world_size > 1 or ep is not None or lockstep_group:
            raise ValueError(
                "drafter='ngram' runs in one-process engines only for now (tensor_parallel_size x "
                "data_parallel_size = 1); use a model drafter with several ranks, or one rank"
            )
        config = replace(config, drafter_kind=NGRAM)
        request = replace(request, config=config)
    tok = resolve_tokenizer(request.tokenizer, target)  # before any weight is read: a bad tokenizer fails fast
    # Everything that can be checked without weights is, before any are loaded (preflight.py).
    check_checkpoints(target, None if config.drafter_kind == NGRAM else drafter)
    tcfg = target_config(target, DTYPES.get(config.dtype))
    auto_from = artifact_mode(artifacts) if artifacts is not None and config.mode == "auto" else None
    rc = resolve(config, tcfg.max_position_embeddings if tcfg else None, drafter is not None, auto_from)
    if tcfg is not None:
        check_kv_memory(rc, tcfg)  # on CUDA the first device call: the context is made here
    if rc.device.type == "cuda":
        torch.cuda.init()  # (where the check above did not: a model object's config)
        timeline.mark("CUDA init")
    if ep is not None:  # models/parallel/experts.py: experts that split, before any weight loads
        from draftgraph.models.parallel.experts import check_expert_config

        check_expert_config(tcfg, ep)
    from draftgraph.compiler.pool.pool_lifetime import release, start_pool

    # Compile workers start now, so their start overlaps the weights' loading (compiler/pool/compile_pool.py).
    started = time.time()  # artifacts/store.py bundles the Triton launchers built from here on
    pool = start_pool(rc, config.cache_dir, config.progress, wanted=artifacts is None)
    try:
        model, draft, compiled, notes = _assemble(request, rc, tp, ep, pool)
        # The Engine sizes its KV cache, warms up and captures (closing the pool) as it is constructed.
        return Engine(
            model, draft, rc, compiled, tokenizer=tok, build_started=started, lockstep_group=lockstep_group,
            prepare=True, notes=notes,
        )  # fmt: skip
    except BaseException:
        if pool is not None:
            release(pool)
        raise


def _assemble(request: BuildRequest, rc: ResolvedConfig, tp, ep, pool) -> tuple:
    """build_engine's weights and compiled functions: (target, drafter, compiled, report notes)."""
    config = request.config
    model = load_target(request.target, rc.device, rc.dtype, rc.attention, tp, rc.ops)
    notes = []
    if ep is not None:  # this rank's experts only, before anything compiles
        from draftgraph.models.parallel.experts import shard_experts

        notes.append(shard_experts(model, ep, request.target))
    draft: Drafter | None = None
    if request.drafter is not None and rc.ngram is None:  # the n-gram drafter has no model (runtime/ngram_state.py)
        draft_tp = tp if rc.draft_tensor_parallel_size > 1 else SINGLE
        draft = load_drafter(
            request.drafter, model, kind=config.drafter_kind, device=rc.device, attn_impl=rc.attention,
            dtype=model.cfg.dtype, tp=draft_tp, ops=rc.ops,
        )  # fmt: skip
        draft = draft.to(rc.device)
        set_kernel_impl(draft, rc.attention)
    check_kv_memory(rc, model.cfg, draft)  # the exact bytes, drafter included, before any compile
    timeline.mark("weight load")
    compiled = None
    if rc.mode != CUDAGraphMode.NONE:
        loop_fns = None
        if rc.fuse_draft_loop:
            choose = Chooser(draft, model.cfg.vocab_size, rc.ops.race_sampler)
            loop_fns = fused_loop_fn(draft, choose, rc.num_speculative_tokens, rc.block_size)
        compiled = build_compiled(model, draft, rc, loop_fns, CompileSettings.of(config), pool)
    if request.artifacts is not None:
        if compiled is None:
            raise ValueError("artifacts hold compiled code, which mode NONE does not use; choose a compiling mode")
        notes.append(_use_artifacts(request, compiled, rc, model, draft))
        timeline.mark("kernel loads", "artifacts")
    return model, draft, compiled, tuple(x for x in notes if x)


def read_verify_key(key) -> bytes:
    """A verify key's bytes from a key file's path or the bytes themselves; a bad one is an ArtifactError."""
    try:
        return read_key(key)
    except SignatureError as e:
        raise ArtifactError(str(e)) from e


def _use_artifacts(request: BuildRequest, compiled, rc, model, draft) -> str:
    """Load the artifacts into `compiled`, or say why not (and raise when strict). Every check (signature with
    the request's verify_key, manifest, checksums, graphs) runs before anything is copied or loaded."""
    path, strict = request.artifacts, request.strict_artifacts
    t0 = time.perf_counter()
    fns = {"target": model.forward}
    if draft is not None:
        fns["drafter"] = draft.forward
    if compiled.loops is not None:
        fns["draft_loop"] = tuple(loop.loop_fn for loop in compiled.loops)
    try:
        checked = check_artifacts(path, rc, model, draft, needs=fns, strict=strict, verify_key=request.verify_key)
        load_functions(checked, compiled, fns)
    except ArtifactError as e:
        if strict:
            raise
        log.warning("%s; compiling instead", e)
        return f"artifacts not used ({e}); compiled instead"
    return f"loaded compiled code from {path} in {time.perf_counter() - t0:.1f} s (no trace, no Inductor compile)"
