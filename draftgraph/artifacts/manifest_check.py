"""What an artifact manifest must hold before anything in its directory is read: a refusal names the entry.

- The directory: every file the manifest lists is a plain relative path inside it, with a SHA-256 (the
  files themselves are read and matched once, by private_cache.py; unlisted ones are named there).
- The functions: exactly those the engine needs (target; drafter and draft_loop when it has them), each
  with its traces and unique pieces; every trace names its graph file, one declared input path per graph
  input (input_paths.py), its output layout (a treespec that decodes), and pieces whose keys the function
  holds; every piece lists its compiled code per size and / or for any size (each a listed file), so an
  entry written either way passes.
- The fields: each of `expected_fields` compared; the resolved config field by field (`config:
  num_speculative_tokens 3 != 4`), its hash only when the fields are absent or all agree.
"""

from __future__ import annotations

import re

from draftgraph.artifacts.input_paths import InputPathError, validate
from draftgraph.compiler.build import LOOP_VARIANTS

KINDS = ("fx", "inductor")  # how a piece's code is stored: an FX graph (eager backend) or Inductor's artifact
TRACE_FIELDS = ("graph", "inputs", "static_shapes", "leaf_map", "treespec", "pieces")
PIECE_FIELDS = ("multi_output", "host_only", "per_size", "dynamic")
_SAFE = re.compile(r"^[A-Za-z0-9_.-]+$")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class ManifestError(ValueError):
    """The manifest or its directory does not match what the engine needs (the message names the entry)."""


def piece_file(fn_name: str, key: str, size) -> str:
    """Where a piece's compiled code lives: per size, or "dynamic" for any size. One file per unique piece,
    whichever functions use it (`fn_name` is kept for the callers' symmetry, not the path)."""
    return f"pieces/{key}/{size}.bin"


def check_directory(manifest: dict) -> None:
    """Every `files` entry is a plain relative path (parts of letters, digits, `_.-`; no `..`, no absolute
    path) with a SHA-256 in hex: a path taken from it stays inside the directory it is joined to."""
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise ManifestError("the manifest has no 'files' table of checksums")
    for rel, digest in files.items():
        parts = rel.split("/") if isinstance(rel, str) else [""]
        if not all(_SAFE.match(p) and p not in (".", "..") for p in parts):
            raise ManifestError(f"files entry {rel!r} is not a plain relative path inside the directory")
        if not isinstance(digest, str) or not _HEX64.match(digest):
            raise ManifestError(f"files entry {rel!r}: checksum {digest!r} is not a SHA-256 in hex")


def check_functions(manifest: dict, needs: set[str]) -> None:
    functions, files = manifest.get("functions"), manifest["files"]
    if not isinstance(functions, dict):
        raise ManifestError("the manifest has no 'functions' table")
    missing, extra = sorted(needs - set(functions)), sorted(set(functions) - needs)
    if missing:
        raise ManifestError(f"function {missing[0]} is missing from the manifest (the engine needs {sorted(needs)})")
    if extra:
        raise ManifestError(f"function {extra[0]} is in the manifest but the engine has none (it has {sorted(needs)})")
    for name, fn in functions.items():
        if not isinstance(fn, dict) or not isinstance(fn.get("traces"), list) or not fn["traces"]:
            raise ManifestError(f"function {name} lists no traces")
        pieces = fn.get("pieces")
        if not isinstance(pieces, dict):
            raise ManifestError(f"function {name} has no 'pieces' table")
        for key, entry in pieces.items():
            _check_piece(f"function {name} piece {key}", name, key, entry, files)
        for i, trace in enumerate(fn["traces"]):
            _check_trace(f"function {name} trace {i}", trace, pieces, files)
        if name == "draft_loop":
            variants = [t.get("variant") for t in fn["traces"]]
            if set(variants) != set(LOOP_VARIANTS):
                raise ManifestError(f"function draft_loop has trace variants {variants}; it needs {LOOP_VARIANTS}")


def _check_piece(where: str, fn_name: str, key, entry, files: dict) -> None:
    if not isinstance(key, str) or not _SAFE.match(key) or key in (".", ".."):
        raise ManifestError(f"{where}: the key is not a plain name")
    if not isinstance(entry, dict) or any(f not in entry for f in PIECE_FIELDS):
        raise ManifestError(f"{where}: an entry needs the fields {PIECE_FIELDS}")
    for flag in ("multi_output", "host_only"):
        if not isinstance(entry[flag], bool):
            raise ManifestError(f"{where}: {flag} {entry[flag]!r} is not true or false")
    per_size, dynamic = entry["per_size"], entry["dynamic"]
    if not isinstance(per_size, dict) or not all(isinstance(s, str) and s.isdigit() for s in per_size):
        raise ManifestError(f"{where}: per_size {per_size!r} does not map sizes to stored code")
    if dynamic is None and not per_size:
        raise ManifestError(f"{where}: holds no compiled code (no size and no dynamic entry)")
    stored = {**per_size, **({"dynamic": dynamic} if dynamic is not None else {})}
    for size, kind in stored.items():
        if kind not in KINDS:
            raise ManifestError(f"{where} size {size}: kind {kind!r} is not one of {KINDS}")
        if piece_file(fn_name, key, size) not in files:
            raise ManifestError(f"{where} size {size}: {piece_file(fn_name, key, size)} is not in the manifest")


def _check_trace(where: str, trace, pieces: dict, files: dict) -> None:
    if not isinstance(trace, dict) or any(f not in trace for f in TRACE_FIELDS):
        missing = [f for f in TRACE_FIELDS if not isinstance(trace, dict) or f not in trace]
        raise ManifestError(f"{where}: missing fields {missing}")
    if trace["graph"] not in files:
        raise ManifestError(f"{where}: graph file {trace['graph']!r} is not in the manifest")
    inputs, shapes = trace["inputs"], trace["static_shapes"]
    if not isinstance(inputs, list) or not isinstance(shapes, list) or len(inputs) != len(shapes):
        raise ManifestError(f"{where}: inputs and static_shapes are not two lists of one length")
    for j, steps in enumerate(inputs):
        try:
            validate(steps)
        except InputPathError as e:
            raise ManifestError(f"{where} input {j}: {e}") from e
    for j, shape in enumerate(shapes):
        if shape is not None and not (isinstance(shape, list) and all(d is None or type(d) is int for d in shape)):
            raise ManifestError(f"{where} input {j}: static shape {shape!r} is not a list of ints / nulls")
    if not isinstance(trace["leaf_map"], list) or not all(type(j) is int and j >= 0 for j in trace["leaf_map"]):
        raise ManifestError(f"{where}: leaf_map {trace['leaf_map']!r} is not a list of output indices")
    _check_treespec(where, trace["treespec"], len(trace["leaf_map"]))
    if not isinstance(trace["pieces"], list):
        raise ManifestError(f"{where}: pieces is not a list")
    for p in trace["pieces"]:
        if not isinstance(p, dict) or not isinstance(p.get("name"), str) or not _NAME.match(p["name"]):
            raise ManifestError(f"{where}: piece {p!r} has no plain name")
        if p.get("key") not in pieces:
            raise ManifestError(f"{where} piece {p['name']}: key {p.get('key')!r} is not one of the function's pieces")
        size_at = p.get("size_at")
        ok = isinstance(size_at, list) and len(size_at) == 2 and size_at[0] in ("int", "shape", "none")
        if not ok or type(size_at[1]) is not int:
            raise ManifestError(f"{where} piece {p['name']}: size_at {size_at!r} is not [int|shape|none, index]")


def _check_treespec(where: str, text, n_leaves: int) -> None:
    """The output layout decodes (pytree raises many kinds of error on corrupt text) and has one leaf per
    leaf_map entry."""
    from torch.utils import _pytree as pytree

    if not isinstance(text, str):
        raise ManifestError(f"{where}: treespec is not a string")
    try:
        spec = pytree.treespec_loads(text)
    except Exception as e:  # noqa: BLE001 - any failure to decode stored data is a corrupt manifest
        raise ManifestError(f"{where}: treespec cannot be decoded ({type(e).__name__}: {str(e)[:120]})") from e
    if spec.num_leaves != n_leaves:
        raise ManifestError(f"{where}: treespec has {spec.num_leaves} leaves but leaf_map {n_leaves}")


def field_mismatches(manifest: dict, now: dict, config_now: dict) -> list[str]:
    """One line per differing field: `name: built for A, running B`, or per config field `config: f A != B`."""
    out = []
    built_config = manifest.get("config")
    config_lines = []
    if isinstance(built_config, dict):
        for k in sorted(set(built_config) | set(config_now)):
            a, b = built_config.get(k, "(absent)"), config_now.get(k, "(absent)")
            if a != b:
                config_lines.append(f"config: {k} {a} != {b} (built for != running)")
    for k, v in now.items():
        if manifest.get(k) == v:
            continue
        if k == "config_hash" and config_lines:
            continue  # the fields say what differs
        out.append(f"{k}: built for {manifest.get(k)!r}, running {v!r}")
    return out + config_lines


def check_trace_graph(module, trace: dict) -> None:
    """A loaded trace graph agrees with its manifest entry: one placeholder per input path, output indices
    within its outputs, each piece a submodule whose size argument exists (the treespec: _check_trace)."""
    nodes = list(module.graph.nodes)
    n_in = sum(n.op == "placeholder" for n in nodes)
    if n_in != len(trace["inputs"]):
        raise ManifestError(f"the graph takes {n_in} inputs but the manifest lists {len(trace['inputs'])} paths")
    out = [n for n in nodes if n.op == "output"]
    value = out[0].args[0] if out and out[0].args else None
    n_out = len(value) if isinstance(value, (tuple, list)) else 1
    if any(j >= n_out for j in trace["leaf_map"]):
        raise ManifestError(f"leaf_map {trace['leaf_map']} points past the graph's {n_out} outputs")
    subs = dict(module.named_children())
    for p in trace["pieces"]:
        sub = subs.get(p["name"])
        if sub is None:
            raise ManifestError(f"piece {p['name']} is not a submodule of the graph")
        kind, i = p["size_at"]
        n_args = sum(n.op == "placeholder" for n in sub.graph.nodes)
        if kind != "none" and not 0 <= i < n_args:
            raise ManifestError(f"piece {p['name']}: size_at index {i} is outside its {n_args} inputs")
