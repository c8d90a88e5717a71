"""What an engine is built from: compile_model's arguments as one frozen object, passed whole from the
public entry (api.py) to the one-process build (engine.py) or to every rank (workers/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from draftgraph.compiler.config import CompileConfig


@dataclass(frozen=True)
class BuildRequest:
    """A target and drafter (checkpoint directories, transformers model objects or draftgraph models; ranks
    started by draftgraph get `workers.sources.SourceRef`s until they open them) and how to build their engine.

    `artifacts`: a directory written by `draftgraph build` to load compiled code from (several ranks: its
    rank-R subdirectories); `strict_artifacts`: raise instead of compiling when they do not fit. `tokenizer`:
    a transformers tokenizer, a directory holding one, False for none, or None (the one beside a target
    checkpoint). `verify_key`: the bytes of the key `artifacts` must be signed with (refused before anything but
    the manifest is read when unsigned or mis-signed). `build_dir`: several ranks only: each writes its
    artifacts into build_dir/rank-R."""

    target: Any
    drafter: Any = None
    config: CompileConfig = field(default_factory=CompileConfig)
    artifacts: str | None = None
    strict_artifacts: bool = False
    tokenizer: Any = None
    build_dir: str | None = None
    verify_key: bytes | None = None  # the key the artifacts must be signed with (artifacts/signing.py)

    def __post_init__(self):
        if not isinstance(self.config, CompileConfig):
            raise TypeError(
                f"config is a {type(self.config).__name__}; pass a draftgraph CompileConfig (dg.CompileConfig(...))"
            )
