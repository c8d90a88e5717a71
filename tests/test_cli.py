"""The `draftgraph` command line, run in-process (no subprocess, nothing compiled): every flag has help,
--version, the "auto" defaults, and bad values refused before any model is built."""

import argparse
import os

import pytest
import torch

import draftgraph as dg
from draftgraph.cli import main
from draftgraph.cli.parser import build_parser

COMMANDS = ("generate", "run", "build", "inspect", "graph-diff", "serve")


def _parsers():
    parser = build_parser(dict.fromkeys(("generate", "build", "inspect", "graph-diff", "serve"), lambda args: 0))
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return parser, sub.choices


def test_every_flag_of_every_command_has_help():
    parser, commands = _parsers()
    assert set(commands) == set(COMMANDS)
    for name, p in [("draftgraph", parser), *commands.items()]:
        for action in p._actions:
            what = f"{name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help and action.help != argparse.SUPPRESS and action.help.strip(), f"{what} has no help"


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith(f"draftgraph {dg.__version__} (torch ")


def test_defaults_are_auto_and_the_new_flags_reach_the_config():
    from draftgraph.cli.flags import config as _config

    parser, _ = _parsers()
    for command in ("generate", "build", "inspect"):
        args = parser.parse_args([command] + (["--out", "x"] if command != "generate" else []))
        assert args.mode == "auto" and args.gpu_memory_utilization is None
    args = parser.parse_args(["generate", "--max-model-len", "128", "--gpu-memory-utilization", "0.5"])
    config = _config(args)
    assert config.mode == "auto" and config.max_model_len == 128 and config.gpu_memory_utilization == 0.5
    assert config.overlap_steps and not _config(parser.parse_args(["generate", "--no-overlap-steps"])).overlap_steps
    assert config.prefix_caching
    assert config.speculation == "auto"
    assert _config(parser.parse_args(["generate", "--speculation", "adaptive"])).speculation == "adaptive"
    args = parser.parse_args(["generate", "--drafter", "ngram", "--ngram-min", "2", "--ngram-max", "4"])
    assert args.drafter == "ngram" and (_config(args).ngram_min, _config(args).ngram_max) == (2, 4)
    for command in ("generate", "serve", "build"):  # the commands that build an engine
        extra = {"generate": [], "serve": [], "build": ["--out", "x"]}[command]
        assert not _config(parser.parse_args([command, "--no-prefix-caching", *extra])).prefix_caching
    # --capture auto: lazy for generate (a one-off job), eager for serve, build and adaptive speculation
    capture = {
        ("generate",): "lazy", ("run",): "lazy", ("serve",): "eager", ("build", "--out", "x"): "eager",
        ("generate", "--speculation", "adaptive"): "eager", ("generate", "--capture", "eager"): "eager",
        ("serve", "--capture", "lazy"): "lazy", ("generate", "--tp", "2"): "lazy",
        ("generate", "--dp", "2"): "eager",
    }  # fmt: skip
    for argv, want in capture.items():
        assert _config(parser.parse_args(list(argv))).capture == want, argv


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--temperature", "-1"], "temperature=-1.0 must be >= 0"),
        (["--top-p", "0"], r"top_p=0.0 must lie in (0, 1]"),
        (["--top-k", "-2"], "top_k=-2 must be >= 1"),
        (["--max-tokens", "0"], "max_tokens=0 must be at least 1"),
        (["--num-prompts", "0"], "--num-prompts=0 must be at least 1"),
        (["--max-num-seqs", "0"], "max_num_seqs=0 must be at least 1"),
        (["--gpu-memory-utilization", "1.5"], "gpu_memory_utilization=1.5 must lie in (0, 1)"),
        (["--block-size", "12"], "block_size=12 must be a power of two"),
        (["--drafter", "ngram", "--ngram-max", "0"], "1 <= ngram_min <= ngram_max <= 16"),
    ],
)
def test_bad_values_fail_before_anything_is_built(flags, message, capsys, monkeypatch):
    import draftgraph
    from draftgraph.models import builtin

    def built(*args, **kwargs):
        raise AssertionError("a model was built or compiled before the bad value was refused")

    for module, name in ((builtin, "builtin_pair"), (builtin, "builtin_hf_pair"), (draftgraph, "compile_model")):
        monkeypatch.setattr(module, name, built)
    assert main(["generate", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("draftgraph: error: ") and message in err


@pytest.mark.parametrize(
    "argv, prestarts",
    [
        (["generate", "--device", "cuda"], (8, "cuda:0")),
        (["run", "--device", "cuda", "--compile-workers", "3"], (3, "cuda:0")),
        (["generate", "--device", "cpu"], None),
        (["generate", "--device", "cuda", "--mode", "NONE"], None),
        (["generate", "--device", "cuda", "--artifacts", "somewhere"], None),
        (["generate", "--device", "cuda", "--compile-workers", "0"], None),
        (["generate", "--device", "cuda", "--compile-backend", "eager"], None),
        (["generate", "--device", "cuda", "--tp", "2"], None),
        (["build", "--device", "cuda", "--out", "x"], None),
    ],
)
def test_compile_workers_start_before_torch_only_when_the_build_will_use_them(argv, prestarts, monkeypatch):
    """cli._prestart_workers: `generate` on a GPU that compiles with workers starts them first; the rest not."""
    from draftgraph.cli import commands as cli
    from draftgraph.compiler.pool import pool_lifetime

    started = []
    monkeypatch.setattr(pool_lifetime, "prestart", lambda n, device: started.append((n, device)))
    monkeypatch.setattr(pool_lifetime, "auto_workers", lambda device_type: 8)
    parser, _ = _parsers()
    cli._prestart_workers(parser.parse_args(argv))
    assert started == ([prestarts] if prestarts else [])


@pytest.mark.parametrize(
    "argv, gpu, compiles",
    [
        (["generate"], True, True),  # auto: FULL_AND_PIECEWISE on a GPU
        (["generate"], False, False),  # auto: NONE on the CPU
        (["generate", "--device", "cpu", "--mode", "PIECEWISE"], False, True),
        (["generate", "--device", "cuda", "--mode", "NONE"], True, False),
        (["serve", "--device", "cuda"], True, True),
        (["build", "--device", "cpu", "--out", "x", "--mode", "PIECEWISE"], False, True),
        (["build", "--device", "cpu", "--out", "x"], False, True),  # auto: a build always compiles
        (["inspect", "--out", "x"], True, False),
    ],
)
def test_a_compiling_command_imports_the_compiler_with_the_rest(argv, gpu, compiles, monkeypatch):
    """cli._compiles: the commands whose engine runs compiled code import Dynamo (and Inductor's compile path) with
    the start's other imports, before `run` freezes them out of the collector's sight; mode NONE imports neither."""
    from draftgraph.cli import commands as cli

    real = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: gpu if p == "/dev/nvidiactl" else real(p))
    parser, _ = _parsers()
    assert cli._compiles(parser.parse_args(argv)) is compiles


def test_the_artifact_cache_loads_what_the_last_start_with_the_same_flags_compiled(tmp_path, monkeypatch, capsys):
    """cli/artifact_cache.py: a `generate` that compiled keeps its code; the next start with the same flags loads it
    (no trace, no compile) and generates the same tokens; with an entry there, no compile workers are started. The
    built-in pair is read from its cached checkpoint, equal to the one built in memory."""
    from draftgraph.cli import artifact_cache
    from draftgraph.cli import commands as cli
    from draftgraph.compiler.pool import pool_lifetime

    monkeypatch.setattr(artifact_cache, "ENABLED", True)  # (conftest turns it off for every other test)
    monkeypatch.setattr(artifact_cache, "cache_root", lambda: str(tmp_path / "cache"))
    argv = ["generate", "--device", "cpu", "--mode", "PIECEWISE", "--compile-backend", "eager"]
    argv += ["--capture-sizes", "1,4", "--max-tokens", "4", "--num-prompts", "2", "--no-drafter"]  # one trace
    outs = []
    for _ in range(2):
        assert cli.main(argv) == 0
        outs.append(capsys.readouterr().out)
    parser, _ = _parsers()
    entry = artifact_cache.entry_dir(parser.parse_args(argv))
    assert os.path.isfile(os.path.join(entry, "manifest.json")) and "no trace" not in outs[0]
    assert f"loaded compiled code from {entry}" in outs[1] and "no trace, no Inductor compile" in outs[1]
    requests = [[line for line in out.splitlines() if line.startswith("request ")] for out in outs]
    assert len(requests[0]) == 2 and requests[0] == requests[1]
    # The sampling flags are not in the key; the model and compile flags are.
    assert artifact_cache.entry_dir(parser.parse_args([*argv, "--max-tokens", "9"])) == entry
    assert artifact_cache.entry_dir(parser.parse_args([*argv, "-k", "2"])) != entry
    # The built-in pair came from its cached checkpoint (no transformers import at a warm start): the same model
    # as the one built in memory, weights and config.
    from draftgraph.models.builtin import BuiltinSpec, builtin_pair
    from draftgraph.models.causal_lm import CausalLM

    spec = BuiltinSpec()
    cached, built = CausalLM.from_pretrained(artifact_cache.builtin_checkpoint(spec)), builtin_pair(spec)[0]
    assert os.path.dirname(artifact_cache.builtin_checkpoint(spec)) == str(tmp_path / "cache")
    assert cached.cfg == built.cfg and cached.state_dict().keys() == built.state_dict().keys()
    assert all(torch.equal(v, built.state_dict()[k]) for k, v in cached.state_dict().items())
    # On a GPU, an entry to load means nothing to compile: the compile workers are not started.
    started = []
    monkeypatch.setattr(pool_lifetime, "prestart", lambda n, device: started.append((n, device)))
    gpu = parser.parse_args(["generate", "--device", "cuda"])
    os.makedirs(artifact_cache.entry_dir(gpu))
    open(os.path.join(artifact_cache.entry_dir(gpu), "manifest.json"), "w").close()
    cli._prestart_workers(gpu)
    assert started == []


def test_a_cold_gpu_start_has_a_process_of_its_own_write_the_builtin_checkpoint(tmp_path, monkeypatch):
    """artifact_cache.prestart_builtin: a GPU `generate` of the built-in pair that finds no compiled code to load
    starts, before its imports, a process that writes the pair's checkpoint under this process's cache root;
    builtin_checkpoint waits for it and reads what it wrote (this process cannot build the pair here), the same
    weights as the pair built in memory. Not with --target, a CPU device, or compiled code to load."""
    from draftgraph.cli import artifact_cache
    from draftgraph.models import builtin
    from draftgraph.models.causal_lm import CausalLM

    monkeypatch.setattr(artifact_cache, "ENABLED", True)  # (conftest turns it off for every other test)
    monkeypatch.setattr(artifact_cache, "cache_root", lambda: str(tmp_path / "cache"))
    parser, _ = _parsers()
    gpu = parser.parse_args(["generate", "--device", "cuda"])
    assert not artifact_cache.prestart_builtin(parser.parse_args(["generate", "--device", "cpu"]))
    assert not artifact_cache.prestart_builtin(parser.parse_args(["generate", "--device", "cuda", "--target", "x"]))
    assert artifact_cache.prestart_builtin(gpu)
    build = builtin.builtin_hf_target

    def not_here(spec, *args, **kwargs):
        raise AssertionError("the writer process builds the pair, not this one")

    monkeypatch.setattr(builtin, "builtin_hf_target", not_here)
    path = artifact_cache.builtin_checkpoint(builtin.BuiltinSpec())
    assert os.path.dirname(path) == str(tmp_path / "cache") and artifact_cache._writer is None
    cached = CausalLM.from_pretrained(path)
    monkeypatch.setattr(builtin, "builtin_hf_target", build)
    built = builtin.builtin_pair(builtin.BuiltinSpec())[0]
    assert cached.cfg == built.cfg and cached.state_dict().keys() == built.state_dict().keys()
    assert all(torch.equal(v, built.state_dict()[k]) for k, v in cached.state_dict().items())
    # compiled code to load for these flags: a warm start, no writer
    os.makedirs(artifact_cache.entry_dir(gpu))
    open(os.path.join(artifact_cache.entry_dir(gpu), "manifest.json"), "w").close()
    assert not artifact_cache.prestart_builtin(gpu)


def test_a_failed_builtin_writer_is_named_and_the_start_writes_the_checkpoint_itself(tmp_path, monkeypatch, caplog):
    """artifact_cache._await_writer: a writer process that failed is logged with its exit status and the end of its
    stderr; builtin_checkpoint then writes the checkpoint in this process."""
    import subprocess
    import sys
    import tempfile

    from draftgraph.cli import artifact_cache
    from draftgraph.models.builtin import BuiltinSpec

    err = tempfile.TemporaryFile()  # noqa: SIM115 - _await_writer closes it
    fail = "import sys; sys.stderr.write('disk full'); sys.exit(3)"
    proc = subprocess.Popen([sys.executable, "-c", fail], stderr=err)
    monkeypatch.setattr(artifact_cache, "_writer", (proc, err))
    with caplog.at_level("WARNING", logger="draftgraph"):
        path = artifact_cache.builtin_checkpoint(BuiltinSpec(), str(tmp_path))
    assert "writer process failed (3): disk full" in caplog.text
    assert os.path.isfile(os.path.join(path, "config.json")) and artifact_cache._writer is None


def test_the_artifact_cache_at_two_ranks_keeps_each_ranks_code(tmp_path, monkeypatch, capsys):
    """With --tp 2 each rank draftgraph started writes its compiled code into the entry's rank-R/ after the job
    (workers/worker.py `write_artifacts`), and the next start with the same flags loads it there: no trace on any
    rank, the same tokens. Ranks a launcher started (WORLD_SIZE) use no cache."""
    from draftgraph.cli import artifact_cache
    from draftgraph.cli import commands as cli

    monkeypatch.setattr(artifact_cache, "ENABLED", True)  # (conftest turns it off for every other test)
    monkeypatch.setattr(artifact_cache, "cache_root", lambda: str(tmp_path / "cache"))
    argv = ["generate", "--device", "cpu", "--mode", "PIECEWISE", "--compile-backend", "eager", "--tp", "2"]
    argv += ["--capture-sizes", "1,4", "--max-tokens", "4", "--num-prompts", "2", "--no-drafter"]
    parser, _ = _parsers()
    args = parser.parse_args(argv)
    entry = artifact_cache.entry_dir(args)
    assert artifact_cache.lookup(args) is None
    outs = []
    for _ in range(2):
        assert cli.main(argv) == 0
        outs.append(capsys.readouterr().out)
        if not outs[1:]:  # after the first start: both ranks' artifacts, the entry found
            assert all(os.path.isfile(os.path.join(entry, f"rank-{r}", "manifest.json")) for r in range(2))
            assert artifact_cache.lookup(args) == entry
    assert "no trace" not in outs[0]
    assert f"loaded compiled code from {entry}/rank-0" in outs[1] and "no trace, no Inductor compile" in outs[1]
    requests = [[line for line in out.splitlines() if line.startswith("request ")] for out in outs]
    assert len(requests[0]) == 2 and requests[0] == requests[1]
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert artifact_cache.lookup(args) is None and not artifact_cache.eligible(args)


def test_ranks_read_the_built_in_pair_from_its_cached_checkpoints(tmp_path, monkeypatch):
    """At several ranks the built-in pair comes from the start-up cache as two checkpoints (no transformers build):
    the target's, and the drafter's written from it, the tensors and config of builtin_hf_pair's drafter."""
    from draftgraph.cli import artifact_cache, flags
    from draftgraph.models.builtin import builtin_hf_pair
    from draftgraph.models.weights import read_checkpoint, read_config

    monkeypatch.setattr(artifact_cache, "ENABLED", True)  # (conftest turns it off for every other test)
    monkeypatch.setattr(artifact_cache, "cache_root", lambda: str(tmp_path / "cache"))
    parser, _ = _parsers()
    target, drafter, where = flags.models(parser.parse_args(["generate", "--tp", "2"]))
    spec = flags.builtin_spec(parser.parse_args(["generate"]))
    assert where == "built-in pair, checkpoints" and target == artifact_cache.builtin_checkpoint(spec)
    assert drafter == artifact_cache.builtin_drafter_checkpoint(spec, target) == f"{target}-draft{spec.draft_layers}"
    _, hf_drafter = builtin_hf_pair(spec)
    want, got = hf_drafter.state_dict(), read_checkpoint(drafter)
    assert got.keys() <= want.keys() and {k for k in want if k not in got} <= {"lm_head.weight"}  # (tied: not stored)
    assert all(torch.equal(v, want[k]) for k, v in got.items())
    config = read_config(drafter)
    assert config["num_hidden_layers"] == spec.draft_layers == hf_drafter.config.num_hidden_layers
    assert flags.models(parser.parse_args(["generate", "--tp", "2", "--no-drafter"]))[1] is None


def test_ranks_are_prestarted_only_where_the_command_spawns_gpu_ranks(monkeypatch):
    """cli/commands.py `_prestart_ranks`: `generate` / `serve` with several ranks on GPUs spawn them before the
    imports (workers/prestart.py); one rank, the CPU (forked ranks) and ranks a launcher started do not."""
    from draftgraph.cli import commands as cli
    from draftgraph.workers import prestart

    started = []
    monkeypatch.setattr(prestart, "prestart_ranks", lambda n, cuda: started.append((n, cuda)))
    parser, _ = _parsers()
    cases = {
        ("generate", "--device", "cuda", "--tp", "2"): [(2, True)],
        ("serve", "--device", "cuda", "--tp", "2", "--dp", "2"): [(4, True)],
        ("generate", "--device", "cuda"): [],
        ("generate", "--device", "cpu", "--tp", "2"): [],
        ("build", "--device", "cuda", "--tp", "2", "--out", "x"): [],
    }
    for argv, want in cases.items():
        started.clear()
        cli._prestart_ranks(parser.parse_args(list(argv)))
        assert started == want, argv
    monkeypatch.setenv("WORLD_SIZE", "2")
    cli._prestart_ranks(parser.parse_args(["generate", "--device", "cuda", "--tp", "2"]))
    assert started == []


def test_the_built_in_pair_inside_artifacts_is_used_only_for_its_own_seed(tmp_path):
    """`draftgraph build` of the built-in pair writes the pair's target inside the artifact (cli/artifact_cache.py);
    `generate --artifacts` reads it only for the same pair: another --seed builds its own weights."""
    from draftgraph.cli import artifact_cache
    from draftgraph.models.builtin import BuiltinSpec

    artifact_cache.write_builtin(BuiltinSpec(seed=0), str(tmp_path))
    args = argparse.Namespace(artifacts=str(tmp_path), tp=1, dp=1)
    path = artifact_cache.builtin_in_artifacts(args, BuiltinSpec(seed=0))
    assert path == str(tmp_path / artifact_cache.BUILTIN_IN_ARTIFACTS)
    assert artifact_cache.builtin_in_artifacts(args, BuiltinSpec(seed=1)) is None
    ranks = argparse.Namespace(artifacts=str(tmp_path), tp=2, dp=1)  # several ranks load their shares instead
    assert artifact_cache.builtin_in_artifacts(ranks, BuiltinSpec(seed=0)) is None


@pytest.mark.parametrize("ending", ["command", "rank", "interpreter"])
def test_private_directories_of_loaded_artifacts_are_removed_after_the_process(ending, tmp_path):
    """artifacts/private_cache.py: every load's private directory goes at exit. The command (`finish`) and a spawned
    worker rank told to stop (workers/process_end.py, without the interpreter's teardown) hand them to an `rm` that
    outlives them (their end does not wait for the removal); any other process removes them in its exit handler."""
    import subprocess
    import sys
    import time

    code = (
        "import os, sys\n"
        "from draftgraph.artifacts.private_cache import PrivateCache\n"
        "caches = [PrivateCache({'pieces/a.bin': b'x' * 1000}) for _ in range(2)]\n"
        "print(' '.join(str(c.root) for c in caches), flush=True)\n"
        "if sys.argv[1] == 'command':\n"
        "    from draftgraph.cli.commands import finish\n"
        "    finish(0)\n"
        "if sys.argv[1] == 'rank':\n"
        "    from draftgraph.workers.process_end import exit_now, run_exit_handlers\n"
        "    run_exit_handlers()\n"
        "    exit_now(0)\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code, ending], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    roots = done.stdout.split()
    assert len(roots) == 2 and all(r.startswith(str(tmp_path)) for r in roots)
    deadline = time.monotonic() + 60  # the detached removal may still run when the process is gone
    while any(os.path.exists(r) for r in roots) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(os.path.exists(r) for r in roots)
