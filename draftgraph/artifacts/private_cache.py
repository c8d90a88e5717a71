"""The files of an artifact directory, read once and checked, and the private cache a load runs from.

Every file the manifest lists is read exactly once, its SHA-256 compared with the manifest's, and only
those bytes are used afterwards: graphs are decoded from them, and the compiled code Inductor and Triton
load is written from them into a fresh private directory (mode 0700, removed at exit: `remove_at_exit`, or by
`remove_detached` in a process of its own, which the `draftgraph` command leaves running when it ends). torch's and
Triton's cache lookups see that directory only, never the artifact directory, so a file that is not
listed (or is swapped after the check) never reaches a loader. Nothing is written anywhere else.

Files that are in the directory but not listed are named: ignored (logged) by default, refused when
strict. A listed file that is a symbolic link is refused.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import shutil
import subprocess
import tempfile
from pathlib import Path

from draftgraph.artifacts.manifest_check import ManifestError
from draftgraph.artifacts.ranks import MANIFEST
from draftgraph.artifacts.signing import SIG

log = logging.getLogger("draftgraph")

CACHE = "inductor_cache"  # the Inductor cache of a CPU build inside an artifact directory
SUMMARY = "summary.txt"
NOT_LISTED = (MANIFEST, SUMMARY, SIG)  # the manifest, its readable summary and its signature


def unlisted_files(root: Path, files: dict) -> list[str]:
    """Files (and links) under root that the manifest does not list, as relative paths."""
    out = []
    for f in sorted(root.rglob("*")):
        rel = f.relative_to(root).as_posix()
        if (f.is_file() or f.is_symlink()) and rel not in files and rel not in NOT_LISTED:
            out.append(rel)
    return out


def read_listed(root: Path, files: dict, strict: bool) -> dict[str, bytes]:
    """Each listed file's bytes, read once and matched against its checksum (ManifestError otherwise)."""
    extra = unlisted_files(root, files)
    if extra:
        named = ", ".join(extra[:5]) + (f" and {len(extra) - 5} more" if len(extra) > 5 else "")
        if strict:
            raise ManifestError(
                f"file {named} is in the directory but not in the manifest (an unknown file; strict loads refuse "
                "them: remove it, or load without strict to ignore it)"
            )
        log.warning("artifacts in %s: ignoring files the manifest does not list: %s", root, named)
    out = {}
    for rel, digest in files.items():
        f = root / rel
        if f.is_symlink():
            raise ManifestError(f"artifact file {rel} is a symbolic link; artifact files must be plain files")
        try:
            data = f.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError) as e:
            raise ManifestError(f"artifact file {rel} is missing") from e
        if hashlib.sha256(data).hexdigest() != digest:
            raise ManifestError(
                f"artifact file {rel} does not match its checksum (truncated or altered); it was not loaded"
            )
        out[rel] = data
    return out


_roots: list[Path] = []  # the private directories of this process's loads, removed at its exit


def remove_at_exit() -> None:
    """The exit handler: remove every private directory still there."""
    while _roots:
        shutil.rmtree(_roots.pop(), ignore_errors=True)


def remove_detached() -> None:
    """Hand the private directories to `rm -rf` in a process of its own, which goes on after this one ends: a
    command ending does not wait for the removal (0.1 s of a CPU start's end from artifacts, its compiled
    libraries). Where that process cannot start, the directories are removed here."""
    while _roots:
        root = _roots.pop()
        try:
            subprocess.Popen(["rm", "-rf", "--", str(root)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        except OSError:
            with contextlib.suppress(OSError):
                shutil.rmtree(root, ignore_errors=True)


class PrivateCache:
    """A fresh private directory for one load: `inductor` (Inductor's cache: the listed inductor_cache/ files),
    `pieces` (the compiled pieces Inductor loads) and `triton` (Triton's cache, filled by the caller)."""

    def __init__(self, files: dict[str, bytes]):
        self.root = Path(tempfile.mkdtemp(prefix="draftgraph-artifacts-"))  # mode 0700
        if not _roots:
            atexit.unregister(remove_at_exit)  # (registered once)
            atexit.register(remove_at_exit)
        _roots.append(self.root)
        self.inductor, self.triton = self.root / "inductor", self.root / "triton"
        self.inductor.mkdir()
        for rel, data in files.items():
            if rel.startswith(CACHE + "/"):
                self._write(self.inductor / rel[len(CACHE) + 1 :], data)
            elif rel.startswith("pieces/") and rel.endswith(".bin"):
                self._write(self.root / rel, data)

    def _write(self, dest: Path, data: bytes) -> None:
        # `dest` is built from names checked by check_directory (plain parts, no `..`): inside self.root
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
