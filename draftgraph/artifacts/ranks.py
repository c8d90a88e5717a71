"""Artifacts of several ranks: one artifact set per rank, each manifest saying which rank it is.

A build with W = tensor_parallel_size x data_parallel_size > 1 ranks writes rank r's artifacts (its manifest,
graphs, pieces and, on the CPU, its Inductor cache) into DIR/rank-r; a one-process build writes DIR itself.
Each rank's compiled code is its own: its shard's constants (its vocabulary range, its experts) are baked into
the graphs. Every manifest records `parallel` (world size and rank; tensor-, data- and expert-parallel sizes
and ranks), and a load compares it with the running rank first: a build for other ranks, or a directory laid
out for another world (a one-process build loaded by ranks, per-rank directories by one process), is named
with both sides and the fix (rebuild with the running --tp / --dp, or run with the built ones).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

MANIFEST = "manifest.json"
ONE_PROCESS = {
    "world_size": 1,
    "rank": 0,
    "tensor_parallel_size": 1,
    "tp_rank": 0,
    "data_parallel_size": 1,
    "dp_rank": 0,
    "expert_parallel": False,
}


def rank_dir(root: str, rank: int) -> str:
    """Where rank `rank` of a build of several ranks keeps its artifacts."""
    return os.path.join(root, f"rank-{rank}")


def world_of(rc) -> int:
    return rc.tensor_parallel_size * rc.data_parallel_size


def this_rank(rc) -> int:
    """This process's rank among the config's world_of(rc) ranks (0 for one process)."""
    if world_of(rc) == 1:
        return 0
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def parallel_fields(rc, rank: int) -> dict:
    """What a manifest says about the rank it was built on (rank r: data-parallel replica r // tp, tensor-
    parallel rank r % tp)."""
    tp = rc.tensor_parallel_size
    return {
        "world_size": world_of(rc),
        "rank": rank,
        "tensor_parallel_size": tp,
        "tp_rank": rank % tp,
        "data_parallel_size": rc.data_parallel_size,
        "dp_rank": rank // tp,
        "expert_parallel": bool(rc.expert_parallel),
    }


def _describe(p: dict) -> str:
    ep = ", expert_parallel" if p.get("expert_parallel") else ""
    return (
        f"rank {p.get('rank')} of {p.get('world_size')} (tensor_parallel_size={p.get('tensor_parallel_size')}, "
        f"data_parallel_size={p.get('data_parallel_size')}{ep})"
    )


def _flags(p: dict) -> str:
    ep = " --expert-parallel" if p.get("expert_parallel") else ""
    return f"--tp {p.get('tensor_parallel_size')} --dp {p.get('data_parallel_size')}{ep}"


def mismatch(path: str, built: dict, running: dict) -> str | None:
    """None when `built` (a manifest's `parallel`) is the running rank's; else what differs and the fix."""
    keys = ("world_size", "rank", "tensor_parallel_size", "data_parallel_size", "expert_parallel")
    built = built if isinstance(built, dict) else {}
    if all(built.get(k) == running[k] for k in keys):
        return None
    fix = f"rebuild them with `draftgraph build {_flags(running)}`"
    if built.get("world_size") == running["world_size"] and built.get("rank") != running["rank"]:
        fix = f"rank r loads {os.path.dirname(path)}/rank-r: keep the per-rank directories as built, or {fix}"
    elif built.get("world_size", 1) > 1 or running["world_size"] > 1:
        fix += f", or run with {_flags(built)}"
    return f"artifacts in {path} were built for {_describe(built)}, but this engine is {_describe(running)}: {fix}"


def _read_parallel(manifest_file: Path) -> dict | None:
    try:
        data = json.loads(manifest_file.read_text())
    except (OSError, ValueError):
        return None
    return data.get("parallel", ONE_PROCESS) if isinstance(data, dict) else None


def layout_problem(path: str, running: dict) -> str | None:
    """Where `path` holds no manifest, a build of another world laid out around it, named (None otherwise:
    the manifest's own check says what is wrong)."""
    root = Path(path)
    if (root / MANIFEST).is_file():
        return None
    if running["world_size"] == 1:  # one process given a directory of per-rank directories
        built = _read_parallel(root / "rank-0" / MANIFEST)
        return mismatch(path, built, running) if built is not None else None
    parent = root.parent  # rank r of several loads DIR/rank-r
    built = _read_parallel(parent / MANIFEST)  # DIR is a one-process build
    if built is None:
        built = _read_parallel(parent / "rank-0" / MANIFEST)  # DIR holds fewer ranks than this world
    return mismatch(str(parent), built, running) if built is not None else None
