"""Ahead-of-time artifacts: build once (`draftgraph build`), start warm (`compile_model(..., artifacts=DIR)`).

An artifact directory holds, per compiled function (target, drafter, the fused loop's two variants) and per
Dynamo trace, the split graph, the input paths and output layout (artifacts/loaded.py); each unique compute
piece's compiled code once, whichever functions share it: the symbolic-size version, plus one per listed
`compile_sizes` entry (Inductor's `CompiledArtifact`, or the FX graph with compile_backend="eager" and for
pieces that compute no tensor); a JSON manifest; a readable summary.

The manifest records what the code was built for: draftgraph, torch, triton, CUDA and Python versions, the
GPU architecture, the resolved config's fields and their hash, hashes of both model configs and of
draftgraph's compiler, pass, model and runtime sources, the capture sizes and mode, and a SHA-256 per file;
`draftgraph build --sign-key FILE` adds an HMAC-SHA256 of the manifest (signing.py).

Loading (check_artifacts, then load_functions) runs every check before anything is copied, restored or
loaded: the signature when a verify key is given, the manifest's shape and every path in it, the fields
against the running setup, the functions and pieces against what the engine needs (manifest_check.py),
each listed file read once against its checksum (private_cache.py; unlisted files ignored, or refused when
strict), Triton's index (triton_bundle.py) and every graph (call targets from the allowlist). Only then are
the checked bytes copied into a private Inductor + Triton cache, which torch and Triton load from; nothing
is written outside it. A difference is named, and the engine compiles from scratch, or stops when strict.

Over 500 lines on purpose: what the build writes and what the load reads of the manifest stay in one module, so a
field cannot be written one way and read another; the checks themselves live beside it (manifest_check.py,
private_cache.py, triton_bundle.py, signing.py).

Trust: the directory holds compiled code (Python, shared objects, pickles: Inductor's artifacts), so it must
come from a source trusted like a checkpoint that contains pickles. Checksums detect corruption; only a
signature whose key is kept apart detects tampering. What draftgraph itself reads is not evaluated: input
paths are declared steps (input_paths.py) and graph call targets come from an allowlist (fx_allowlist.py).

Why one file of ~500 lines: writing and reading share the manifest's definition (the fields, hashes and file
layout `expected_fields` / `build_artifacts` write are exactly what `check_artifacts` compares), so they stay
side by side; the parts that stand alone are already their own modules (manifest_check, input_paths, loaded,
ranks, signing, private_cache, triton_bundle).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils import _pytree as pytree

import draftgraph
from draftgraph.artifacts.input_paths import InputPathError, parse_source
from draftgraph.artifacts.manifest_check import (
    ManifestError,
    check_directory,
    check_functions,
    check_trace_graph,
    field_mismatches,
    piece_file,
)
from draftgraph.artifacts.private_cache import CACHE, SUMMARY, PrivateCache, read_listed
from draftgraph.artifacts.ranks import (
    MANIFEST,
    ONE_PROCESS,
    layout_problem,
    mismatch,
    parallel_fields,
    this_rank,
)
from draftgraph.artifacts.signing import SignatureError, verify
from draftgraph.artifacts.sources import source_hash
from draftgraph.artifacts.triton_bundle import INDEX, TRITON_DIR, check_index, restore_kernels, save_kernels
from draftgraph.compiler.build import LOOP_VARIANTS
from draftgraph.compiler.fx_serialize import decode_module, encode_module

log = logging.getLogger("draftgraph")

FORMAT = 2  # 2: input paths as declared steps (not expressions), the config's fields
# CACHE (private_cache.py): Inductor's cache of a CPU build, the built .so files a CPU artifact does not bundle
# (without them every load would re-run the C++ compiler). `draftgraph build` points Inductor there on the CPU
# only; a CUDA artifact bundles its Triton kernels. Its files are listed in the manifest like every other.
_FUNCTIONS = ("target", "drafter", "draft_loop")


class ArtifactError(RuntimeError):
    """An artifact directory that cannot be used (missing, corrupt, or built for something else)."""


# ---- what an artifact is built for ------------------------------------------------------------------


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def config_fields(rc) -> dict[str, str]:
    """The resolved config minus what compiled code does not depend on (KV size, seed, graphs on/off, adaptive K's
    choices: views over the same compiled functions); the kernel choices one entry each (`ops.gemv`), so a mismatch
    names the choice."""
    # all_reduce: the graphs hold the same opaque op either way; its kernel is chosen when it runs
    skip = {"num_kv_blocks", "seed", "graphs_enabled", "lazy_capture", "gpu_memory_utilization", "mode_reason",
            "compile_workers", "overlap_steps", "kv_grow_in_place", "ops", "prefix_caching",
            "prefix_state_snapshots",
            "speculation_ks", "all_reduce"}  # fmt: skip
    out = {f.name: str(getattr(rc, f.name)) for f in dataclasses.fields(rc) if f.name not in skip}
    out.update({f"ops.{k}": str(v) for k, v in rc.ops.fields().items()})
    return out


def config_hash(rc) -> str:
    return _sha(json.dumps(config_fields(rc), sort_keys=True).encode())[:16]


def model_hash(model) -> str:
    cfg = getattr(model, "cfg", None)
    text = repr(cfg) + "|" + getattr(model, "kind", type(model).__name__)
    if getattr(model, "target_hidden", None) == "aux":
        text += f"|aux={model.aux_layers}"
    return _sha(text.encode())[:16]


def gpu_arch(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


def expected_fields(rc, target, drafter) -> dict:
    """What the running setup would write into a manifest (the fields a load compares)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return {
        "format": FORMAT,
        "draftgraph": draftgraph.__version__,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": str(torch.version.cuda),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "gpu_arch": gpu_arch(rc.device),
        "config_hash": config_hash(rc),
        "target_hash": model_hash(target),
        "drafter_hash": model_hash(drafter) if drafter is not None else "none",
        "source_hash": source_hash(),
        "mode": rc.mode.value,
        "capture_sizes": list(rc.capture_sizes),
        "full_capture_sizes": list(rc.full_capture_sizes),
    }


# ---- build ------------------------------------------------------------------------------------------


def build_artifacts(engine, out_dir: str, progress: bool = True, extra=None) -> dict:
    """Write the compiled code of `engine` (built with compile_model, any mode but NONE) to out_dir. `extra`:
    called with the directory before the manifest is written, for files the artifact also carries (listed and
    checked like the rest: the weights of the CLI's built-in pair, cli/artifact_cache.py BUILTIN_IN_ARTIFACTS)."""
    compiled = engine.compiled
    if compiled is None:
        raise ArtifactError(
            "mode NONE compiles nothing: build artifacts with a compiling mode (e.g. FULL_AND_PIECEWISE)"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if any(p.name != CACHE for p in out.iterdir()):
        raise ArtifactError(f"{out_dir} is not empty; artifacts go into a new or empty directory")
    t0 = time.perf_counter()
    calls = _exercise(engine)  # every trace once, recording its graph outputs and the returned value
    functions, saved = {}, {}
    for fn_name, backend in _backends(compiled).items():
        traces = []
        for i, rec in enumerate(backend.records):
            if i not in calls[fn_name]:
                raise ArtifactError(f"{fn_name} trace {i} did not run while building; cannot record its outputs")
            graph_outs, value, variant = calls[fn_name][i]
            leaves, spec = pytree.tree_flatten(value)
            leaf_map = []
            for leaf in leaves:
                hits = [j for j, g in enumerate(graph_outs) if g is leaf]
                if not hits:
                    raise ArtifactError(f"{fn_name} trace {i} returns a value that is not one of its graph outputs")
                leaf_map.append(hits[0])
            inputs = _input_paths(fn_name, i, rec["sources"])
            path = f"functions/{fn_name}.{i}.json"
            _save_split(rec["split"], out / path)
            traces.append(
                {
                    "graph": path,
                    "variant": variant,  # the fused loop: "greedy" or "sample"
                    "inputs": inputs,
                    "static_shapes": rec["static_shapes"],
                    "leaf_map": leaf_map,
                    "treespec": pytree.treespec_dumps(spec),
                    "pieces": [
                        {"name": p.name, "key": p.key, "size_at": rec["size_at"][p.name]}
                        for p in rec["split"].compute_pieces
                    ],
                }
            )
        pieces = {}
        for key, cp in backend._compiled.items():
            if key not in saved:  # a piece shared by several functions is written once
                entry = {"multi_output": cp.multi_output, "host_only": cp.host_only, "per_size": {}, "dynamic": None}
                for size, art in cp.per_size.items():
                    entry["per_size"][str(size)] = _save_piece(art, out / piece_file(fn_name, key, size))
                entry["dynamic"] = _save_piece(cp.dynamic, out / piece_file(fn_name, key, "dynamic"))
                saved[key] = entry
            pieces[key] = saved[key]
        functions[fn_name] = {"traces": traces, "pieces": pieces, "backend": backend.compile_backend}
    # draftgraph's own Triton kernels and their launchers, compiled (triton_bundle.py): no JIT at a warm start
    since = getattr(engine, "build_started", None) if engine.config.device.type == "cuda" else None
    kernels = save_kernels(out, since)
    if extra is not None:
        extra(out)
    fields = expected_fields(engine.config, engine.target, engine.drafter)
    files = {str(p.relative_to(out)): _sha(p.read_bytes()) for p in sorted(out.rglob("*")) if p.is_file()}
    manifest = {**fields, "config": config_fields(engine.config), "functions": functions, "files": files}
    manifest["parallel"] = parallel_fields(engine.config, this_rank(engine.config))  # artifacts/ranks.py
    manifest["triton_kernels"] = {k: len(v) for k, v in kernels.items()}
    manifest["build_seconds"] = round(time.perf_counter() - t0, 2)
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    (out / SUMMARY).write_text(summary_text(manifest))
    return manifest


def _input_paths(fn_name: str, i: int, sources: list) -> list:
    """Dynamo's source expressions as declared steps (input_paths.py); refused at build when outside them."""
    out = []
    for j, src in enumerate(sources):
        try:
            out.append(parse_source(src if isinstance(src, str) else repr(src)))
        except InputPathError as e:
            raise ArtifactError(f"{fn_name} trace {i} input {j}: {e}; only the call's arguments are supported") from e
    return out


def _backends(compiled) -> dict:
    out = {"target": compiled.target.backend}
    if compiled.drafter is not None:
        out["drafter"] = compiled.drafter.backend
    if compiled.loop_backend is not None:
        out["draft_loop"] = compiled.loop_backend
    return out


def _exercise(engine) -> dict:
    """Call every compiled function on padding-only inputs so each trace runs once through its Python
    entry (not a graph replay), recording (graph outputs, returned value) per trace."""
    compiled, runner = engine.compiled, engine.runner
    backends = _backends(compiled)
    calls = {name: {} for name in backends}
    for b in backends.values():
        b.recorded_outputs = {}
    saved = runner.forwards.graphs
    runner.forwards.graphs = None  # call the compiled code itself, never a whole-forward graph
    try:

        def record(name, value, tag=None):
            rec = backends[name].recorded_outputs
            for i, graph_outs in rec.items():
                calls[name][i] = (graph_outs, value, tag)
            rec.clear()

        size = engine.config.warmup_tokens
        meta, positions = runner.target_meta.build([], num_tokens_padded=size, num_reqs_padded=1)
        ids = torch.zeros(size, dtype=torch.long, device=runner.device)
        aux = getattr(runner, "aux_layers", ())
        record("target", compiled.target(ids, positions, meta, runner.target_cache.layers, aux))
        if engine.drafter is not None:
            for width in runner.proposer.hidden_widths:
                hidden = (
                    None
                    if width is None
                    else torch.zeros(size, width, dtype=engine.target.cfg.dtype, device=runner.device)
                )
                record("drafter", compiled.drafter(ids, positions, hidden, meta, runner.draft_cache.layers))
        if compiled.loops is not None:
            p = runner.proposer
            for variant, loop in zip(LOOP_VARIANTS, compiled.loops):
                x = p.dummy_loop_inputs(max(engine.config.full_capture_sizes), sampled=variant == "sample")
                record("draft_loop", loop(kv_caches=runner.draft_cache.layers, **x), variant)
    finally:
        runner.forwards.graphs = saved
        for b in backends.values():
            b.recorded_outputs = None
    return calls


def _save_split(split, path: Path) -> None:
    """The split graph with its compute pieces as plain FX graphs (the runners hold compiled code)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    module = split.module
    runners = {p.name: getattr(module, p.name) for p in split.compute_pieces}
    try:
        for p in split.compute_pieces:
            setattr(module, p.name, p.graph)
        path.write_text(json.dumps(encode_module(module)))
    finally:
        for name, r in runners.items():
            setattr(module, name, r)


def _save_piece(art, path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(art, torch.fx.GraphModule):  # compile_backend="eager"
        path.write_text(json.dumps(encode_module(art)))
        return "fx"
    art.save(path=str(path), format="binary")
    return "inductor"


def summary_text(m: dict) -> str:
    lines = [
        f"draftgraph artifacts (format {m['format']}), built in {m['build_seconds']} s",
        f"for: draftgraph {m['draftgraph']}, torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda']}, "
        f"Python {m['python']}, {m['gpu_arch']}",
        f"mode {m['mode']}; capture sizes {m['capture_sizes']}; FULL request counts {m['full_capture_sizes']}",
        f"hashes: config {m['config_hash']}, target {m['target_hash']}, drafter {m['drafter_hash']}, "
        f"sources {m['source_hash']}",
    ]
    p = m.get("parallel")
    if p and p["world_size"] > 1:
        lines.append(
            f"rank {p['rank']} of {p['world_size']}: tensor-parallel rank {p['tp_rank']} of "
            f"{p['tensor_parallel_size']}, data-parallel replica {p['dp_rank']} of {p['data_parallel_size']}"
            + (", expert parallel" if p["expert_parallel"] else "")
        )
    for name, fn in m["functions"].items():
        n_art = sum(len(p["per_size"]) + 1 for p in fn["pieces"].values())
        lines.append(
            f"{name}: {len(fn['traces'])} trace(s), {sum(len(t['pieces']) for t in fn['traces'])} compute pieces, "
            f"{len(fn['pieces'])} unique, {n_art} compiled artifacts ({fn['backend']})"
        )
    total = sum(1 for _ in m["files"])
    lines.append(f"{total} files, each with its SHA-256 in {MANIFEST}")
    return "\n".join(lines) + "\n"


# ---- load -------------------------------------------------------------------------------------------


@dataclasses.dataclass
class CheckedArtifact:
    """An artifact directory after every check (check_artifacts), before anything was copied or loaded: its
    manifest, every listed file's checked bytes, and its graphs decoded from those bytes."""

    path: str
    manifest: dict
    files: dict[str, bytes]
    graphs: dict[str, torch.fx.GraphModule]  # trace graphs and FX pieces, by file
    kernels: dict  # triton/index.json, checked ({} without one)


def read_manifest(path: str, verify_key: bytes | None = None) -> dict:
    """The manifest of `path`, its signature checked first when a `verify_key` is given (signing.py), then its
    shape: the `files` table of plain relative paths and SHA-256s. Nothing else in the directory is read."""
    root = Path(path)
    if not (root / MANIFEST).is_file():
        raise ArtifactError(
            f"{path} holds no {MANIFEST}: not an artifact directory (build one with `draftgraph build`)"
        )
    raw = (root / MANIFEST).read_bytes()
    if verify_key is not None:
        try:
            verify(path, raw, verify_key)
        except SignatureError as e:
            raise ArtifactError(str(e)) from e
    try:
        manifest = json.loads(raw)
    except ValueError as e:  # not JSON, or not UTF-8
        raise ArtifactError(f"{path}/{MANIFEST} is not valid JSON ({e}); rebuild the artifacts") from e
    if not isinstance(manifest, dict):
        raise ArtifactError(f"{path}/{MANIFEST} is not a JSON object; rebuild the artifacts")
    try:
        check_directory(manifest)
    except ManifestError as e:
        raise ArtifactError(f"artifacts in {path}: {e}; rebuild the artifacts") from e
    return manifest


def check_artifacts(
    path: str, rc, target, drafter, needs, strict: bool = True, verify_key: bytes | None = None
) -> CheckedArtifact:
    """Every check of `path`, before anything is copied, restored or loaded; ArtifactError naming the first
    problem otherwise. In order: the rank (a build for other ranks is named with the fix, ranks.py); the
    signature (with `verify_key`); the manifest's shape; every field against the running setup; the
    functions, traces and pieces against what the engine needs (`needs`: its function names); each listed
    file read once against its checksum (unlisted files: refused when `strict`, else ignored and logged);
    Triton's index; every graph decoded with its call targets from the allowlist."""
    running = parallel_fields(rc, this_rank(rc))
    problem = layout_problem(path, running)
    if problem:
        raise ArtifactError(problem)
    manifest = read_manifest(path, verify_key)
    problem = mismatch(path, manifest.get("parallel", ONE_PROCESS), running)
    if problem:
        raise ArtifactError(problem)
    diffs = field_mismatches(manifest, expected_fields(rc, target, drafter), config_fields(rc))
    if diffs:
        raise ArtifactError(f"artifacts in {path} were built for something else: " + "; ".join(diffs))
    try:
        check_functions(manifest, set(needs))
    except ManifestError as e:
        raise ArtifactError(f"artifacts in {path} do not match what the engine needs: {e}") from e
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:  # a type the checks did not expect
        raise ArtifactError(f"artifacts in {path}: the manifest is malformed ({e!r}); rebuild the artifacts") from e
    try:
        files = read_listed(Path(path), manifest["files"], strict)
    except ManifestError as e:
        raise ArtifactError(f"artifacts in {path}: {e}; rebuild the artifacts") from e
    kernels = {}
    index = f"{TRITON_DIR}/{INDEX}"
    if index in files:
        try:
            kernels = json.loads(files[index])
            check_index(kernels, files)
        except ValueError as e:
            raise ArtifactError(f"artifacts in {path}: {index} was refused: {e}; rebuild the artifacts") from e
    return CheckedArtifact(path, manifest, files, _checked_graphs(manifest, files), kernels)


def _checked_graphs(manifest: dict, files: dict[str, bytes]) -> dict:
    """Every stored FX graph decoded from its checked bytes (call targets from the allowlist), each trace
    graph matched against its manifest entry."""
    graphs = {}
    for fn_name, fn in manifest["functions"].items():
        for key, entry in fn["pieces"].items():
            stored = {**entry["per_size"], **({"dynamic": entry["dynamic"]} if entry["dynamic"] else {})}
            for size, kind in stored.items():
                if kind == "fx":
                    rel = piece_file(fn_name, key, size)
                    graphs[rel] = _read_graph(files, rel)
        for i, t in enumerate(fn["traces"]):
            module = graphs[t["graph"]] = _read_graph(files, t["graph"])
            try:
                check_trace_graph(module, t)
            except (ManifestError, ValueError, TypeError, KeyError, IndexError) as e:
                raise ArtifactError(f"function {fn_name} trace {i} ({t['graph']}): {e}; rebuild the artifacts") from e
    return graphs


def _read_graph(files: dict[str, bytes], rel: str):
    """A stored FX graph; a refused call target or malformed node is an ArtifactError naming the file."""
    try:
        return decode_module(json.loads(files[rel]))
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError) as e:
        raise ArtifactError(f"artifact graph {rel} was refused: {e}") from e


def load_functions(checked: CheckedArtifact, compiled, fns: dict) -> None:
    """Replace compiled.target / drafter / loops by LoadedFunctions over the checked code (no Dynamo, no
    Inductor compile). `fns` maps a function name to what its traces' `L['fn']` was: the bound forward, or
    the loops. The compiled code is copied from the checked bytes into a private cache (private_cache.py)
    that Inductor and Triton load from; nothing is written outside it."""
    private = PrivateCache(checked.files)
    if checked.kernels.get("kernels") or checked.kernels.get("launchers"):
        # Triton's JIT looks its kernels up at their first call (the warm-up, or a later step): the private
        # copy stays Triton's cache for the rest of the process.
        os.environ["TRITON_CACHE_DIR"] = str(private.triton)
        log.info("Triton's cache is now %s (the artifacts' kernels, private to this process)", private.triton)
        restored = restore_kernels(checked.kernels, checked.files, str(private.triton))
        compiled.counters.kernels_restored = restored
        log.info("restored %d compiled Triton kernels and launchers from %s", restored, checked.path)
    _load_functions(checked, compiled, fns, private)


class _LazyArtifact:
    """An Inductor artifact read at its first call from the private copy of its checked bytes: a warm start
    reads only the sizes its steps use, each when a step (or the capture) first runs it."""

    def __init__(self, path: Path, cache: Path):
        self.path, self.cache, self.fn = path, cache, None

    def __call__(self, *args):
        if self.fn is None:
            from torch._inductor import CompiledArtifact

            from draftgraph.compiler.inductor_options import loading_in_process
            from draftgraph.compiler.piecewise import _cache_dir

            with _cache_dir(str(self.cache)), loading_in_process():
                self.fn = CompiledArtifact.load(path=str(self.path), format="binary")
        return self.fn(*args)


def _load_functions(checked: CheckedArtifact, compiled, fns: dict, private: PrivateCache) -> None:
    from draftgraph.artifacts.loaded import LoadedFunction, LoadedTrace
    from draftgraph.compiler.piecewise import CompiledPiece

    manifest = checked.manifest
    ctx = compiled.ctx
    loaded = {}
    for fn_name, fn in manifest["functions"].items():
        pieces = {}
        for key, entry in fn["pieces"].items():

            def load(size, kind, fn_name=fn_name, key=key):
                rel = piece_file(fn_name, key, size)
                return checked.graphs[rel] if kind == "fx" else _LazyArtifact(private.root / rel, private.inductor)

            per_size = {int(s): load(s, k) for s, k in entry["per_size"].items()}
            dynamic = load("dynamic", entry["dynamic"]) if entry["dynamic"] is not None else None
            pieces[key] = CompiledPiece(per_size, dynamic, entry["multi_output"], entry["host_only"])
        traces = []
        for i, t in enumerate(fn["traces"]):
            try:
                traces.append(LoadedTrace(fn_name, checked.graphs[t["graph"]], t, pieces, ctx))
            except (ValueError, TypeError, KeyError, IndexError) as e:
                raise ArtifactError(f"function {fn_name} trace {i} ({t['graph']}): {e}; rebuild the artifacts") from e
        loaded[fn_name] = (traces, len(pieces), sum(len(t["pieces"]) for t in fn["traces"]))
    counters = compiled.counters
    counters.unique_pieces += len({key for fn in manifest["functions"].values() for key in fn["pieces"]})
    for fn_name, (traces, _unique, total) in loaded.items():
        counters.pieces += total
        if fn_name == "draft_loop":
            variants = [t["variant"] for t in manifest["functions"][fn_name]["traces"]]
            compiled.loops = tuple(
                LoadedFunction(fn_name, f, [t for t, v in zip(traces, variants) if v == name])
                for f, name in zip(fns["draft_loop"], LOOP_VARIANTS)
            )
        else:
            setattr(compiled, fn_name, LoadedFunction(fn_name, fns[fn_name], traces))
