"""compile_model: the public entry. It gathers its arguments into a `BuildRequest` and sends it down the one
build path (build/engine.py), on this process or on the worker ranks it starts or joins (workers/).

Imports flow one way: ... <- runtime <- build <- api / workers <- cli.
"""

from __future__ import annotations

from typing import Any

from draftgraph.build.engine import build_engine, read_verify_key
from draftgraph.build.request import BuildRequest
from draftgraph.compiler.config import CompileConfig
from draftgraph.runtime.engine import Engine


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
    request = BuildRequest(target, drafter, config, artifacts, strict_artifacts, tokenizer, verify_key=verify_key)
    from draftgraph.workers.launched import join_launch, uses_launch

    launch = uses_launch(request.config)  # a launch whose size is not tp x dp is refused here, naming both
    if launch is not None:
        return join_launch(launch, request)
    if request.config.tensor_parallel_size * request.config.data_parallel_size > 1:
        from draftgraph.models.drafters.ngram import is_ngram

        if is_ngram(drafter, config.drafter_kind):
            raise ValueError(
                "drafter='ngram' runs in one-process engines only for now (tensor_parallel_size x data_parallel_size "
                "= 1); use a model drafter with several ranks, or one rank"
            )
        from draftgraph.workers.driver import start_workers

        return start_workers(request)
    return build_engine(request)
