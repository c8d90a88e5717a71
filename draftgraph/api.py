"""compile_model: load a target and drafter from any supported form and build the engine for them.

It sits above the runtime (it returns an `Engine`) and the compiler (it builds the compiled functions),
so that imports flow one way: models <- passes <- compiler <- runtime <- api / cli.
"""

from __future__ import annotations

import logging
import time
from contextvars import ContextVar
from dataclasses import replace
from typing import Any

import torch

from draftgraph.artifacts.signing import SignatureError, read_key
from draftgraph.artifacts.store import ArtifactError, check_artifacts, load_functions
from draftgraph.compiler.build import build_compiled
from draftgraph.compiler.config import DTYPES, CompileConfig, CUDAGraphMode, resolve
from draftgraph.models.drafters.base import Drafter
from draftgraph.models.drafters.loader import load_drafter
from draftgraph.models.llama import CausalLM
from draftgraph.ops.collectives.op import SINGLE, ExpertGroups, ParallelGroup
from draftgraph.preflight import artifact_mode, check_checkpoints, check_kv_memory, target_config
from draftgraph.runtime.drafting import Chooser, fused_loop_fn
from draftgraph.runtime.engine import Engine
from draftgraph.runtime.memory import measure_and_plan
from draftgraph.runtime.text import resolve_tokenizer

log = logging.getLogger("draftgraph")


def set_kernel_impl(model: torch.nn.Module, impl: str) -> None:
    """Point every attention and MoE module of `model` at the kernels `impl` ("triton" / "reference")."""
    for m in model.modules():
        if hasattr(m, "attn_impl"):
            m.attn_impl = impl


def load_target(source: Any, device, dtype, attn_impl: str, tp: ParallelGroup = SINGLE) -> CausalLM:
    """A draftgraph CausalLM from a checkpoint dir, a transformers model object or a CausalLM; with a
    tensor-parallel `tp`, this rank's share (from a checkpoint dir or a transformers object)."""
    if isinstance(source, CausalLM):
        if tp.world_size > 1 and source.tp.world_size != tp.world_size:
            raise ValueError(
                f"a draftgraph CausalLM object cannot be split over tensor_parallel_size={tp.world_size} here; pass "
                "its checkpoint directory or the transformers model instead (each rank then loads its share)"
            )
        model = source
    elif isinstance(source, str):
        model = CausalLM.from_pretrained(source, dtype=dtype, device=device, attn_impl=attn_impl, tp=tp)
    elif isinstance(source, torch.nn.Module) and hasattr(source, "config"):
        model = CausalLM.from_hf(source, dtype=dtype, device=device, attn_impl=attn_impl, tp=tp)
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
    verify_key: Any = None,
) -> Engine:
    """Build a speculative decoding engine for `target` (and `drafter`, any supported form, or None).

    `artifacts`: a directory written by `draftgraph build` (artifacts/store.py). Its compiled code is
    loaded without tracing or compiling; only CUDA graph capture remains. When it was built for something
    else (a version, the GPU, the config, a model, draftgraph's sources) or a file fails its checksum, the
    reason is logged and the engine compiles as usual, or raises `ArtifactError` with `strict_artifacts`.
    An artifact holds compiled code (Python, shared objects, pickles): load only directories you trust like a
    pickle checkpoint. Every check runs before anything is loaded, only the files its manifest lists (with
    matching checksums) are loaded, from a private copy, and loading writes nothing outside that copy. Files it
    does not list are ignored (logged), or refused with `strict_artifacts`. Checksums detect corruption only.

    `verify_key`: a key file's path (or the key's bytes) that the artifacts were signed with (`draftgraph
    build --sign-key FILE`, artifacts/signing.py): an unsigned or mis-signed directory is refused before
    anything but its manifest is read. A signature detects tampering when its key is kept apart.

    `tokenizer`: a transformers tokenizer, a directory holding one, False for none, or None (default): the
    one saved beside a target checkpoint, if any. With one, `generate` takes text prompts and outputs carry
    `.text` (runtime/text.py).

    With `config.tensor_parallel_size` x `config.data_parallel_size` N > 1 it starts N worker processes, one per
    device, and returns a `ParallelEngine` (workers/driver.py) with the Engine's API that drives them all.
    Called on every rank of a torchrun launch (RANK / WORLD_SIZE / LOCAL_RANK set), it makes this process one
    rank of N = WORLD_SIZE instead and returns a `LaunchedEngine` (workers/launched.py)."""
    config = config or CompileConfig()
    if verify_key is not None:
        if artifacts is None:
            raise ValueError("verify_key checks artifacts' signatures: pass artifacts=DIR with it, or drop it")
        if config.tensor_parallel_size * config.data_parallel_size > 1:
            raise ValueError(
                "verify_key is supported for one-process engines only (tensor_parallel_size x data_parallel_size "
                "= 1); load several ranks' artifacts without it"
            )
        verify_key = read_verify_key(verify_key)
    token = _VERIFY_KEY.set(verify_key)
    try:
        return _dispatch(target, drafter, config, artifacts, strict_artifacts, tokenizer)
    finally:
        _VERIFY_KEY.reset(token)


def _dispatch(target, drafter, config: CompileConfig, artifacts, strict_artifacts, tokenizer):
    from draftgraph.workers.launched import join_launch, uses_launch

    launch = uses_launch(config)  # a launch whose size is not tp x dp is refused here, naming both
    if launch is not None:
        return join_launch(launch, target, drafter, config, artifacts, strict_artifacts, tokenizer)
    if config.tensor_parallel_size * config.data_parallel_size > 1:
        from draftgraph.workers.driver import start_workers

        return start_workers(target, drafter, config, artifacts, strict_artifacts, tokenizer)
    return build_engine(target, drafter, config, artifacts, strict_artifacts, tokenizer)


def build_engine(
    target: Any,
    drafter: Any,
    config: CompileConfig,
    artifacts: str | None = None,
    strict_artifacts: bool = False,
    tokenizer: Any = None,
    tp: ParallelGroup = SINGLE,
    ep: ExpertGroups | None = None,
) -> Engine:
    """One process's engine (compile_model's work on one device; each worker rank's, workers/worker.py, with
    its tensor-parallel group `tp` and, with expert parallelism, its expert-parallel groups `ep`)."""
    tok = resolve_tokenizer(tokenizer, target)  # before any weight is read: a bad tokenizer fails fast
    # Everything that can be checked without weights is, before any are loaded (preflight.py).
    check_checkpoints(target, drafter)
    tcfg = target_config(target, DTYPES.get(config.dtype))
    auto_from = artifact_mode(artifacts) if artifacts is not None and config.mode == "auto" else None
    rc = resolve(config, tcfg.max_position_embeddings if tcfg else None, drafter is not None, auto_from)
    if tcfg is not None:
        check_kv_memory(rc, tcfg)
    if ep is not None:  # models/parallel/experts.py: experts that split, before any weight loads
        from draftgraph.models.parallel.experts import check_expert_config

        check_expert_config(tcfg, ep)
    from draftgraph.compiler.pool.pool_lifetime import release, start_pool

    # Compile workers start now, so their start overlaps the weights' loading (compiler/pool/compile_pool.py).
    started = time.time()  # artifacts.py bundles the Triton launchers built from here on
    pool = start_pool(rc, config.cache_dir, config.progress, wanted=artifacts is None)
    try:
        engine = _assemble(target, drafter, config, rc, artifacts, strict_artifacts, tp, ep, pool)
    except BaseException:
        if pool is not None:
            release(pool)
        raise
    engine.tokenizer = tok
    engine.build_started = started
    return engine


def _assemble(target, drafter, config: CompileConfig, rc, artifacts, strict_artifacts, tp, ep, pool) -> Engine:
    """build_engine's weights, compiled functions, KV cache and warm-up (the pool is closed by the warm-up)."""
    model = load_target(target, rc.device, rc.dtype, rc.attention, tp)
    experts_note = ""
    if ep is not None:  # this rank's experts only, before anything compiles
        from draftgraph.models.parallel.experts import shard_experts

        experts_note = shard_experts(model, ep, target)
    draft: Drafter | None = None
    if drafter is not None:
        draft_tp = tp if rc.draft_tensor_parallel_size > 1 else SINGLE
        draft = load_drafter(
            drafter, model, kind=config.drafter_kind, device=rc.device, attn_impl=rc.attention, dtype=model.cfg.dtype,
            tp=draft_tp,
        )  # fmt: skip
        draft = draft.to(rc.device)
        set_kernel_impl(draft, rc.attention)
    check_kv_memory(rc, model.cfg, draft)  # the exact bytes, drafter included, before any compile
    compiled = None
    if rc.mode != CUDAGraphMode.NONE:
        loop_fns = None
        if rc.fuse_draft_loop:
            choose = Chooser(draft, model.cfg.vocab_size)
            loop_fns = fused_loop_fn(draft, choose, rc.num_speculative_tokens, rc.block_size)
        compiled = build_compiled(
            model,
            draft,
            rc,
            loop_fns,
            config.compile_backend,
            config.cache_dir,
            config.check_addresses,
            config.dump_graphs_dir,
            config.progress,
            pool,
        )

    artifact_note = ""
    if artifacts is not None:
        if compiled is None:
            raise ValueError("artifacts hold compiled code, which mode NONE does not use; choose a compiling mode")
        artifact_note = _use_artifacts(artifacts, strict_artifacts, compiled, rc, model, draft)

    plan = None
    if rc.gpu_memory_utilization:  # measure weights, activations and graphs first, then size the KV cache
        probe = replace(rc, num_kv_blocks=rc.max_blocks_per_req + 1)
        engine = Engine(model, draft, probe, compiled, kv_grows_in_place=True)  # where CUDA can (growable.py)
        plan = measure_and_plan(engine, rc.gpu_memory_utilization)
    else:
        engine = Engine(model, draft, rc, compiled)
    engine.memory_plan = plan
    if compiled is not None and not (plan is not None and plan.kept_graphs):
        engine.warm_up_report = engine.warm_up()
    if plan is not None:
        engine.warm_up_report = "; ".join(x for x in (engine.warm_up_report, plan.describe()) if x)
    if artifact_note or experts_note:
        engine.warm_up_report = "; ".join(x for x in (experts_note, artifact_note, engine.warm_up_report) if x)
    return engine


# compile_model's verify_key (its bytes) while it builds the engine: read where the artifacts are checked
_VERIFY_KEY: ContextVar[bytes | None] = ContextVar("draftgraph_verify_key", default=None)


def read_verify_key(key) -> bytes:
    try:
        return read_key(key)
    except SignatureError as e:
        raise ArtifactError(str(e)) from e


def _use_artifacts(path: str, strict: bool, compiled, rc, model, draft) -> str:
    """Load the artifacts into `compiled`, or say why not (and raise when strict). Every check (signature
    with compile_model's verify_key, manifest, checksums, graphs) runs before anything is copied or loaded."""
    t0 = time.perf_counter()
    fns = {"target": model.forward}
    if draft is not None:
        fns["drafter"] = draft.forward
    if compiled.loops is not None:
        fns["draft_loop"] = tuple(loop.loop_fn for loop in compiled.loops)
    try:
        checked = check_artifacts(path, rc, model, draft, needs=fns, strict=strict, verify_key=_VERIFY_KEY.get())
        load_functions(checked, compiled, fns)
    except ArtifactError as e:
        if strict:
            raise
        log.warning("%s; compiling instead", e)
        return f"artifacts not used ({e}); compiled instead"
    return f"loaded compiled code from {path} in {time.perf_counter() - t0:.1f} s (no trace, no Inductor compile)"
