"""`source_hash`: what an artifact records of draftgraph's own code (torch-free, so that the `draftgraph` command
can name its artifact cache entry before it imports torch: cli/artifact_cache.py)."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

SOURCE_DIRS = ("compiler", "passes", "models", "runtime")  # the code compiled graphs and their runs depend on


@functools.cache
def source_hash() -> str:
    """Hash of draftgraph's compiler, pass, model and runtime sources: any code change invalidates. Read once a
    process (the code it runs is what it imported; a start asks several times: the cache entry's key for the compile
    workers, the built-in pair's writer and the engine, then the artifact's manifest)."""
    root = Path(__file__).parent.parent
    h = hashlib.sha256()
    for sub in SOURCE_DIRS:
        for f in sorted((root / sub).rglob("*.py")):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]
