"""Model sources as something a rank's process can open: checkpoint directories pass as paths; transformers
model objects are saved once with save_pretrained; draftgraph objects (CausalLM, Drafter, other modules) are
pickled together into one file, so tensors a drafter shares with its target stay shared on every rank."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SourceRef:
    """Where a rank finds one model: a checkpoint directory ("path") or an entry of a pickled file ("pickle")."""

    kind: str  # "path" | "pickle"
    path: str
    key: str = ""  # the entry of a pickled file: "target" or "drafter"


def _saveable(source: Any) -> bool:
    """A transformers model object: its save_pretrained writes a checkpoint directory our loaders read."""
    return isinstance(source, torch.nn.Module) and callable(getattr(source, "save_pretrained", None))


def portable_sources(target: Any, drafter: Any, tmpdir: str) -> tuple[SourceRef, SourceRef | None]:
    """The target's and drafter's SourceRefs, writing under `tmpdir` what is not a path already."""
    refs: dict[str, SourceRef | None] = {"drafter": None}
    pickled: dict[str, Any] = {}
    for key, source in (("target", target), ("drafter", drafter)):
        if source is None:
            continue
        if isinstance(source, (str, os.PathLike)):
            refs[key] = SourceRef("path", os.fspath(source))
        elif _saveable(source):
            path = os.path.join(tmpdir, key)
            source.save_pretrained(path)
            refs[key] = SourceRef("path", path)
        else:
            pickled[key] = source
    if pickled:
        path = os.path.join(tmpdir, "models.pt")
        torch.save(pickled, path)  # one pickle: shared tensors saved once and shared again when loaded
        refs.update({key: SourceRef("pickle", path, key) for key in pickled})
    return refs["target"], refs["drafter"]


def open_sources(target: SourceRef, drafter: SourceRef | None) -> tuple[Any, Any]:
    """In a rank: the sources compile_model accepts (paths, or the objects unpickled on the CPU)."""
    files: dict[str, dict] = {}

    def open_one(ref: SourceRef | None):
        if ref is None:
            return None
        if ref.kind == "path":
            return ref.path
        if ref.path not in files:
            files[ref.path] = torch.load(ref.path, map_location="cpu", weights_only=False)
        return files[ref.path][ref.key]

    return open_one(target), open_one(drafter)
