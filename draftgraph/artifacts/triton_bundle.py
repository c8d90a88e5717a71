"""draftgraph's own Triton kernels, compiled, inside an artifact directory (issue 16: warm start in seconds).

Inductor's artifacts carry the Triton kernels Inductor generated; draftgraph's hand-written kernels
(attention, sampling, argmax, ...) are compiled by Triton's JIT at their first call, which on a warm start
from artifacts cost ~10 s of the 1B pair's 17 s (docs/history/benchmarks-2026-11.md, 2026-11-23). `save_kernels` copies
each of those compiled kernels (its Triton cache entry: binary, IR, metadata) and the launcher modules Triton
built for them into `triton/` of the artifact directory; `restore_kernels` puts them back into the running
Triton cache, where the JIT finds them at the first call instead of compiling. An entry is keyed by Triton's
own hash (source, signature, specialisation, options, target, Triton version), so an entry for another GPU or
Triton is simply never looked up; the manifest already refuses such a mismatch.

At a load, `check_index` first refuses an index whose names are not plain file names or whose files the
manifest does not list, and `restore_kernels` then writes the checked bytes into the load's private Triton
cache (artifacts/private_cache.py), never into the user's own.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from draftgraph.ops.kernel_variants import jit_functions

TRITON_DIR = "triton"
INDEX = "index.json"
LAUNCHER = "__triton_launcher"  # the module name Triton builds a per-signature launcher under
_PLAIN = re.compile(r"^[A-Za-z0-9_.-]+$")


def _cache_root() -> str | None:
    """Triton's cache directory in this process; None without Triton (it is not a runtime dependency)."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs.cache.dir


def save_kernels(out: Path, since: float | None) -> dict:
    """Copy the compiled variants of draftgraph's kernels this process holds, and the launcher modules built
    since `since` (a time.time(); None: none), into out/triton; returns the index written."""
    kernels, launchers = {}, {}
    dest = out / TRITON_DIR
    for name, fn in sorted(jit_functions().items()):
        for entry in (getattr(fn, "device_caches", None) or {}).values():
            for kernel in list(entry[0].values()):
                group, h = getattr(kernel, "metadata_group", None), getattr(kernel, "hash", None)
                if not group or not h or h in kernels:
                    continue  # a compile still in flight, or a variant already copied
                meta = [f for f in group if f.endswith(".json")]
                if len(meta) != 1 or not all(os.path.isfile(p) for p in group.values()):
                    continue  # not a cache group this code knows how to restore
                (dest / h).mkdir(parents=True, exist_ok=True)
                for filename, path in group.items():
                    shutil.copyfile(path, dest / h / filename)
                kernels[h] = {"kernel": name, "metadata": meta[0], "files": sorted(group)}
    root = _cache_root() if since is not None else None
    if root and os.path.isdir(root):
        for key in sorted(os.listdir(root)):
            d = os.path.join(root, key)
            files = [f for f in os.listdir(d) if f.startswith(LAUNCHER)] if os.path.isdir(d) else []
            if len(files) == 1 and os.path.getmtime(os.path.join(d, files[0])) >= since:
                (dest / key).mkdir(parents=True, exist_ok=True)
                shutil.copyfile(os.path.join(d, files[0]), dest / key / files[0])
                launchers[key] = files[0]
    index = {"kernels": kernels, "launchers": launchers}
    if kernels or launchers:
        dest.mkdir(parents=True, exist_ok=True)
        (dest / INDEX).write_text(json.dumps(index, indent=1, sort_keys=True))
    return index


def check_index(index, files) -> None:
    """Raise ValueError unless `index` (triton/index.json, parsed) names only plain names, each of its files
    a file the manifest lists (`files`): nothing in it can point outside the Triton cache it is restored to."""

    def plain(name) -> bool:
        return isinstance(name, str) and bool(_PLAIN.match(name)) and name not in (".", "..")

    if not isinstance(index, dict) or not all(isinstance(index.get(k, {}), dict) for k in ("kernels", "launchers")):
        raise ValueError(f"{TRITON_DIR}/{INDEX} is not an object of 'kernels' and 'launchers' tables")
    where = f"{TRITON_DIR}/{INDEX}"
    for h, info in index.get("kernels", {}).items():
        names = info.get("files") if isinstance(info, dict) else None
        if not plain(h) or not isinstance(names, list) or not all(plain(f) for f in names):
            raise ValueError(f"{TRITON_DIR}/{INDEX}: kernel {h!r} has a name that is not a plain file name")
        if info.get("metadata") not in names:
            raise ValueError(f"{where}: kernel {h!r}: metadata {info.get('metadata')!r} is not one of its files")
        for f in names:
            if f"{TRITON_DIR}/{h}/{f}" not in files:
                raise ValueError(f"{TRITON_DIR}/{INDEX}: kernel file {TRITON_DIR}/{h}/{f} is not in the manifest")
    for key, filename in index.get("launchers", {}).items():
        if not plain(key) or not plain(filename) or not filename.startswith(LAUNCHER):
            raise ValueError(
                f"{TRITON_DIR}/{INDEX}: launcher {key!r}: {filename!r} is not a plain name starting {LAUNCHER!r}"
            )
        if f"{TRITON_DIR}/{key}/{filename}" not in files:
            raise ValueError(f"{where}: launcher file {TRITON_DIR}/{key}/{filename} is not in the manifest")


def restore_kernels(index: dict, files: dict[str, bytes], cache_root: str) -> int:
    """Put the kernels and launchers of a checked `index` (check_index) into the Triton cache at `cache_root`,
    from `files` (the listed files' checked bytes); returns how many entries were written. `cache_root` must
    be Triton's cache directory in this process (the load's private one: TRITON_CACHE_DIR)."""
    if not index.get("kernels") and not index.get("launchers"):
        return 0
    from triton.runtime.cache import get_cache_manager

    if os.path.realpath(_cache_root() or "") != os.path.realpath(cache_root):
        raise RuntimeError(f"Triton's cache is {_cache_root()!r}, not the private {cache_root!r}: nothing restored")
    written = 0
    for h, info in index.get("kernels", {}).items():
        cache = get_cache_manager(h)
        if cache.get_group(info["metadata"]) is not None:
            continue
        paths = {f: cache.put(files[f"{TRITON_DIR}/{h}/{f}"], f, binary=True) for f in info["files"]}
        cache.put_group(info["metadata"], paths)
        written += 1
    for key, filename in index.get("launchers", {}).items():
        # Launchers are stored under their cache directory's own name (Triton derives it from a hash of the
        # launcher's source, in a way that changed across versions): written back there, atomically.
        target = os.path.join(cache_root, key, filename)
        if not os.path.exists(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            tmp = f"{target}.tmp.{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(files[f"{TRITON_DIR}/{key}/{filename}"])
            os.replace(tmp, target)
            written += 1
    return written
