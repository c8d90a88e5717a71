"""The start-up caches of `draftgraph generate` and `serve` (issue 44): the compiled code of an engine the command
compiled, kept as artifacts (artifacts/store.py) that the next start with the same flags loads, so that a warm
start skips Dynamo's traces and Inductor's compiles, not only their cache lookups, and starts no compile workers;
and the built-in pair's random weights, kept as a checkpoint, so that a start reads them without importing
transformers (seconds).

- Where: `draftgraph-artifacts/<key>/` in Inductor's cache directory (TORCHINDUCTOR_CACHE_DIR, else
  `<tmp>/torchinductor_<user>`, as Inductor decides): empty Inductor caches mean a cold start for both.
- The key: a hash of the flags that decide what is built (the model and compile flags `generate` shares with
  `build`; not the prompts or sampling), draftgraph's version and its sources' hash (an edit starts a new entry;
  old ones stay, as Inductor's entries do). Finding the entry needs no torch, so the
  command decides before it imports torch whether to start compile workers.
- Loading is `--artifacts` without `--strict-artifacts`: every check first (versions, GPU, resolved config,
  model shapes, draftgraph's sources, checksums, only listed files); on any mismatch the engine compiles, and
  the entry is written again after the job.
- Written after the job's output, whole: into a temporary directory beside it, then renamed into place.
- Only where an artifact needs nothing outside its directory: CUDA (Inductor's binary artifacts and our bundled
  kernels), or the eager backend; `--no-artifact-cache` turns it off. With --tp / --dp the ranks draftgraph starts
  each write and load their own (`rank-R/`, as `draftgraph build` lays ranks out); ranks a launcher started
  (torchrun) use none.
- Trust: an entry holds compiled code, as Inductor's own cache entries beside it do; it is trusted as they are.
- The built-in pair (`builtin_checkpoint`): the first start builds the transformers model (seeded) and writes it
  with save_pretrained into `builtin-<key>/` (key: the spec, torch's and transformers' versions); every start,
  that one too, reads the target from there, so cold and warm starts build the same model (same weights, same
  config: their compiled code matches). A GPU start that finds no compiled code to load (`prestart_builtin`,
  before its own imports) has a process of its own import transformers and write the checkpoint beside those
  imports (seconds: transformers' import and model build), and waits for it only where it needs the checkpoint
  and finds none yet. `draftgraph build` of the built-in pair writes the same checkpoint inside
  its artifact directory (`BUILTIN_IN_ARTIFACTS`, listed in the manifest), which `generate --artifacts` reads first.
"""

from __future__ import annotations

import argparse
import getpass
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile

log = logging.getLogger("draftgraph")

SUBDIR = "draftgraph-artifacts"
COMMANDS = ("generate", "run", "serve")  # serve keeps the compiled code once its engine is built, before it serves
ENABLED = True  # tests turn it off (tests/conftest.py): each test's generate compiles what it asks for


def cache_root() -> str:
    """Inductor's cache directory (torch._inductor.runtime.cache_dir_utils: TORCHINDUCTOR_CACHE_DIR, else
    `<tmp>/torchinductor_<user>`), without importing torch, and our folder in it."""
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not root:
        try:
            user = re.sub(r'[\\/:*?"<>|]', "_", getpass.getuser())
        except (KeyError, OSError):
            user = "unknown"
        root = os.path.join(tempfile.gettempdir(), "torchinductor_" + user)
    return os.path.join(root, SUBDIR)


def _build_flags() -> list[str]:
    """The flags whose values decide what is built: those `generate` shares with `build` (parser._add_common)."""
    from draftgraph.cli.parser import _add_common

    p = argparse.ArgumentParser(add_help=False)
    _add_common(p, "")
    return sorted(a.dest for a in p._actions)


def _code() -> dict:
    """draftgraph's version and the hash of the sources compiled code depends on (artifacts/sources.py): an entry
    of other code is never looked up (the manifest check would refuse it anyway, with a warning)."""
    import draftgraph
    from draftgraph.artifacts.sources import source_hash

    return {"draftgraph": draftgraph.__version__, "sources": source_hash()}


def eligible(args) -> bool:
    """Whether this command uses the cache: `generate` (or `serve`) that compiles, no --artifacts of its own, not a
    rank a launcher started."""
    if not ENABLED or args.command not in COMMANDS or getattr(args, "no_artifact_cache", True):
        return False
    if args.artifacts or args.verify_key or args.mode == "NONE":
        return False
    if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:  # ranks a launcher started: each its own process
        return False
    return args.device != "cpu" or args.compile_backend == "eager"


def _ranks(args) -> int:
    """How many ranks the command's engine runs (tensor_parallel_size x data_parallel_size): an entry of several
    holds each rank's artifacts in rank-R/ (artifacts/ranks.py, as `draftgraph build` lays them out)."""
    return getattr(args, "tp", 1) * getattr(args, "dp", 1)


def entry_dir(args) -> str:
    """The cache entry for these flags (it may not exist)."""
    values = {name: getattr(args, name, None) for name in _build_flags()}
    text = json.dumps({"flags": values, **_code()}, sort_keys=True, default=str)
    return os.path.join(cache_root(), hashlib.sha256(text.encode()).hexdigest()[:20])


def lookup(args) -> str | None:
    """The cache entry to load for these flags, or None (not eligible, or none written yet)."""
    if not eligible(args):
        return None
    path = entry_dir(args)
    world = _ranks(args)
    manifests = [os.path.join(path, f"rank-{r}") for r in range(world)] if world > 1 else [path]
    return path if all(os.path.isfile(os.path.join(m, "manifest.json")) for m in manifests) else None


def builtin_enabled(args) -> bool:
    """Whether the built-in pair comes from its cached checkpoint: `generate` or `serve`, not under a launcher
    (several ranks read their shares of it, and of the drafter's checkpoint: `builtin_drafter_checkpoint`)."""
    if not ENABLED or args.command not in COMMANDS or getattr(args, "no_artifact_cache", True):
        return False
    return int(os.environ.get("WORLD_SIZE", "1") or 1) == 1


BUILTIN_IN_ARTIFACTS = "builtin-target"  # `draftgraph build` of the built-in pair: its target's checkpoint, inside


def write_builtin(spec, out) -> None:
    """`draftgraph build` of the built-in pair (one process): its target's checkpoint into the artifact directory
    `out` (listed in the manifest and checked like the compiled code), so that `generate --artifacts` reads the
    pair from there instead of building it with transformers (seconds on a start with empty caches)."""
    from draftgraph.models.builtin import builtin_hf_target

    path = os.path.join(out, BUILTIN_IN_ARTIFACTS)
    builtin_hf_target(spec).save_pretrained(path)
    with open(os.path.join(path, SPEC_FILE), "w") as f:  # which pair: a start with another --seed builds its own
        json.dump({"spec": repr(spec)}, f)


SPEC_FILE = "builtin_spec.json"


def builtin_in_artifacts(args, spec) -> str | None:
    """The built-in target's checkpoint inside `--artifacts` (written by `write_builtin`) when it is the pair of
    `spec` (the same --seed), else None. Its files are checked against the manifest with the rest when the engine
    loads the artifacts (a changed file stops or recompiles the start); safetensors holds only tensors, so reading
    them first runs nothing."""
    if not getattr(args, "artifacts", None) or getattr(args, "tp", 1) * getattr(args, "dp", 1) > 1:
        return None
    path = os.path.join(args.artifacts, BUILTIN_IN_ARTIFACTS)
    try:
        with open(os.path.join(path, SPEC_FILE)) as f:
            written = json.load(f).get("spec")
    except (OSError, ValueError):
        return None
    return path if written == repr(spec) and os.path.isfile(os.path.join(path, "config.json")) else None


def builtin_checkpoint(spec, root: str | None = None) -> str:
    """The checkpoint directory of the built-in target for `spec` under `root` (default: cache_root()), written now
    when it is not there yet (after waiting for the writer `prestart_builtin` started, if any)."""
    from importlib.metadata import version

    import torch

    root = root or cache_root()
    versions = {"torch": torch.__version__, "transformers": version("transformers")}  # their RNG and init: the weights
    text = json.dumps({"spec": repr(spec), **versions, **_code()}, sort_keys=True)
    path = os.path.join(root, "builtin-" + hashlib.sha256(text.encode()).hexdigest()[:20])
    if not os.path.isfile(os.path.join(path, "config.json")):
        _await_writer()  # (then it is there, unless the writer failed or wrote another spec's)
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    from draftgraph.models.builtin import builtin_hf_target

    os.makedirs(root, exist_ok=True)
    return _write_checkpoint(path, lambda tmp: builtin_hf_target(spec).save_pretrained(tmp))


_writer: tuple | None = None  # (the process prestart_builtin started, its stderr file)


def prestart_builtin(args) -> bool:
    """Before this process imports torch: where the command runs the built-in pair from the start-up cache and finds
    no compiled code to load (a cold start, or new flags), start a process that writes the pair's checkpoint
    (`builtin_checkpoint`, under this process's cache root) while this one imports; `builtin_checkpoint` waits for
    it where the checkpoint is not there yet. Where it is there, the process finds it and ends. Returns whether one
    was started. On a GPU host only (its cores): on a 2-core CPU machine the second process's imports of torch and
    transformers (3 s) cost more than building the pair in this process once torch is in (1.2 s)."""
    global _writer
    if getattr(args, "target", None) or not builtin_enabled(args) or not eligible(args) or lookup(args) is not None:
        return False
    if args.device == "cpu" or (args.device == "auto" and not os.path.exists("/dev/nvidiactl")):
        return False
    import subprocess
    import sys

    err = tempfile.TemporaryFile()  # noqa: SIM115 - closed by _await_writer
    main = "import sys; from draftgraph.cli.artifact_cache import write_builtin_main as m; sys.exit(m(sys.argv[1:]))"
    cmd = [sys.executable, "-c", main, str(args.seed), cache_root()]
    _writer = (subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err), err)
    return True


def _await_writer(timeout: float = 300.0) -> None:
    """Wait for the writer `prestart_builtin` started (once); its failure is logged (the caller writes instead)."""
    global _writer
    if _writer is None:
        return
    proc, err = _writer
    _writer = None
    try:
        rc = proc.wait(timeout)
    except Exception:  # noqa: BLE001 - (a timeout: the caller writes the checkpoint itself)
        proc.kill()
        rc = f"killed after {timeout:.0f} s"
    if rc != 0:
        err.seek(0)
        tail = err.read().decode(errors="replace").strip().splitlines()[-5:]
        log.warning("the built-in pair's writer process failed (%s): %s", rc, " | ".join(tail))
    err.close()


def write_builtin_main(argv: list[str]) -> int:
    """The process prestart_builtin starts (argv: the seed, the cache root)."""
    from draftgraph.cli.flags import builtin_spec  # (the spec the command's start reads: one place decides it)

    seed, root = argv
    builtin_checkpoint(builtin_spec(argparse.Namespace(seed=int(seed))), root)
    return 0


def _write_checkpoint(path: str, write) -> str:
    """`write(tmp)` into a new directory beside `path`, then renamed into place (the same file system: atomic); a
    start that wrote it meanwhile wins."""
    tmp = tempfile.mkdtemp(prefix=".writing-", dir=os.path.dirname(path))
    try:
        write(tmp)
        os.replace(tmp, path)
    except OSError:
        if not os.path.isfile(os.path.join(path, "config.json")):  # (not another start that wrote it meanwhile)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def builtin_drafter_checkpoint(spec, target: str) -> str:
    """The built-in drafter as a checkpoint of its own, beside the target's (`target`, from builtin_checkpoint): the
    target's first `spec.draft_layers` layers with its embedding, final norm and head, the same tensors (what
    models/builtin.py builtin_hf_pair builds with transformers), for ranks that read their shares of it. Written from
    the target's files (no transformers) when it is not there yet."""
    path = f"{target}-draft{spec.draft_layers}"
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    from safetensors.torch import save_file

    from draftgraph.models.weights import read_checkpoint

    with open(os.path.join(target, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = spec.draft_layers
    if config.get("layer_types"):
        config["layer_types"] = config["layer_types"][: spec.draft_layers]
    kept = {
        name: t.contiguous()
        for name, t in read_checkpoint(target).items()
        if (m := _LAYER.match(name)) is None or int(m.group(1)) < spec.draft_layers
    }

    def write(tmp: str) -> None:
        save_file(kept, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)

    return _write_checkpoint(path, write)


def store(args, engine) -> str | None:
    """After the job: write the engine's compiled code as the entry for these flags, when this process compiled it
    (an engine that loaded the entry traced nothing); returns the entry written, or None. A failure is logged,
    never raised: the job's output is already out."""
    if not eligible(args):
        return None
    ranked = hasattr(engine, "write_artifacts")  # several ranks (workers/ranked.py): each writes rank-R/
    if ranked:
        if not engine.traced():
            return None
    elif engine.compiled is None or not engine.compiled.counters.traces:
        return None
    if engine.config.device.type != "cuda" and args.compile_backend != "eager":
        return None  # a CPU Inductor artifact needs its Inductor cache inside it: only `draftgraph build` does that
    from draftgraph.artifacts.store import build_artifacts

    final = entry_dir(args)
    try:
        os.makedirs(cache_root(), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".writing-", dir=cache_root())  # the same file system: the rename is atomic
        try:
            if ranked:
                engine.write_artifacts(os.path.join(tmp, "entry"))
            else:
                build_artifacts(engine, os.path.join(tmp, "entry"), progress=False)
            shutil.rmtree(final, ignore_errors=True)  # a stale entry (it failed its checks at this start)
            os.replace(os.path.join(tmp, "entry"), final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception as e:  # noqa: BLE001 - caching is an optimisation: the next start compiles instead
        log.warning("the compiled code was not cached for the next start (%s: %s)", type(e).__name__, e)
        return None
    log.info("compiled code cached for the next start with these flags: %s", final)
    return final
