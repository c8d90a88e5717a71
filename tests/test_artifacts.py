"""Ahead-of-time artifacts on the CPU: build, load with zero traces and zero Inductor compiles, identical
outputs; every mismatch field named (then compiled instead, or stopped when strict); a corrupted file
caught by its checksum and never run; the CLI in a fresh process."""

import json
import os
import re
import subprocess
import sys

import pytest

import draftgraph as dg
from draftgraph.artifacts.store import MANIFEST, ArtifactError, build_artifacts
from draftgraph.models.causal_lm import CausalLM
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model
from tests.test_engine import ragged


@pytest.fixture(scope="module")
def target():
    return CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96))


def cfg(backend="eager", **kw):
    base = dict(
        mode="FULL_AND_PIECEWISE",
        num_speculative_tokens=3,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        capture_sizes=(1, 4, 16, 64),
        compile_backend=backend,
        progress=False,
        fuse_draft_loop=True,  # the fused loop's traces travel in artifacts too (the default runs it unfused)
    )
    base.update(kw)
    return dg.CompileConfig(**base)


def tokens(engine):
    prompts, params, arrivals = ragged(16)
    return [o.token_ids for o in engine.generate(prompts, params, arrivals)]


@pytest.fixture(scope="module")
def built(target, tmp_path_factory):
    """An eagle3 pair (two drafter traces) built into a directory, with its reference outputs."""
    drafter = make_drafter("eagle3", target)
    engine = dg.compile_model(target, drafter, cfg())
    ref = tokens(engine)
    out = str(tmp_path_factory.mktemp("art") / "a")
    manifest = build_artifacts(engine, out)
    return drafter, out, manifest, ref, engine.compiled.counters


def test_load_runs_no_trace_and_no_compile(target, built):
    drafter, out, manifest, ref, built_counters = built
    assert {"target", "drafter", "draft_loop"} <= set(manifest["functions"])
    assert len(manifest["functions"]["drafter"]["traces"]) == 2  # hidden width 3H at step 1, H later
    eng = dg.compile_model(target, drafter, cfg(), artifacts=out, strict_artifacts=True)
    c = eng.compiled.counters
    assert not c.traces and c.inductor_compiles == 0
    assert (c.pieces, c.unique_pieces) == (built_counters.pieces, built_counters.unique_pieces)
    assert "no trace, no Inductor compile" in eng.warm_up_report
    assert tokens(eng) == ref
    hits = eng.stats()["fallbacks_by_key"]  # the CPU has no graphs: the dispatch keys of forwards run without
    assert any(k.startswith("step/") for k in hits) and any("/piecewise/" in k for k in hits)
    with open(os.path.join(out, "summary.txt")) as f:
        summary = f.read()
    assert "drafter: 2 trace(s)" in summary and "SHA-256" in summary


def _edit_manifest(src, dst, **fields):
    import shutil

    shutil.copytree(src, dst)
    path = os.path.join(dst, MANIFEST)
    with open(path) as f:
        m = json.load(f)
    m.update(fields)
    with open(path, "w") as f:
        json.dump(m, f)
    return dst


@pytest.mark.parametrize(
    "field,value",
    [
        ("torch", "2.11.0+cu130"),
        ("triton", "3.6.0"),
        ("cuda", "13.0"),
        ("gpu_arch", "sm_90"),
        ("python", "3.12"),
        ("draftgraph", "0.0.1"),
        ("config_hash", "0123456789abcdef"),
        ("target_hash", "0123456789abcdef"),
        ("drafter_hash", "0123456789abcdef"),
        ("source_hash", "0123456789abcdef"),
    ],
)
def test_each_mismatch_is_named(target, built, tmp_path, field, value):
    drafter, out, manifest, ref, _ = built
    bad = _edit_manifest(out, str(tmp_path / "b"), **{field: value})
    with pytest.raises(ArtifactError, match=re.escape(f"{field}: built for '{value}', running")):
        dg.compile_model(target, drafter, cfg(), artifacts=bad, strict_artifacts=True)
    if field == "torch":  # not strict: says why, then compiles instead (the same path for every field)
        eng = dg.compile_model(target, drafter, cfg(), artifacts=bad)
        assert eng.compiled.counters.traces["target"] == 1
        assert f"{field}: built for '{value}'" in eng.warm_up_report and "compiled instead" in eng.warm_up_report


def test_a_real_config_change_is_caught(target, built):
    drafter, out, *_ = built
    with pytest.raises(ArtifactError, match=re.escape("config: num_speculative_tokens 3 != 4")):
        dg.compile_model(target, drafter, cfg(num_speculative_tokens=4), artifacts=out, strict_artifacts=True)
    bigger = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96, num_hidden_layers=4))
    with pytest.raises(ArtifactError, match="target_hash: built for"):
        dg.compile_model(bigger, make_drafter("eagle3", bigger), cfg(), artifacts=out, strict_artifacts=True)


def test_a_corrupted_file_is_never_run(target, built, tmp_path):
    import shutil

    drafter, out, manifest, ref, _ = built
    bad = str(tmp_path / "c")
    shutil.copytree(out, bad)
    victim = next(f for f in sorted(manifest["files"]) if f.startswith("pieces/"))
    with open(os.path.join(bad, victim), "r+b") as f:  # truncate one compiled piece
        f.truncate(os.path.getsize(os.path.join(bad, victim)) // 2)
    with pytest.raises(ArtifactError, match=re.escape(f"artifact file {victim} does not match its checksum")):
        dg.compile_model(target, drafter, cfg(), artifacts=bad, strict_artifacts=True)
    eng = dg.compile_model(target, drafter, cfg(), artifacts=bad)
    assert eng.compiled.counters.traces["target"] == 1  # compiled from scratch: the bad file was not read
    assert tokens(eng) == ref
    os.remove(os.path.join(bad, MANIFEST))
    with pytest.raises(ArtifactError, match="holds no manifest.json: not an artifact directory"):
        dg.compile_model(target, drafter, cfg(), artifacts=bad, strict_artifacts=True)


def test_inductor_artifacts_load_and_match(target, tmp_path):
    drafter = make_drafter("eagle", target)
    config = cfg(backend="inductor", capture_sizes=(4,), full_capture_sizes=(4,))  # few sizes: few compiles
    engine = dg.compile_model(target, drafter, config)
    ref = tokens(engine)
    manifest = build_artifacts(engine, str(tmp_path / "a"))
    pieces = [p for fn in manifest["functions"].values() for p in fn["pieces"].values()]
    # every piece with kernels is one Inductor artifact (no per-size ones); the input-checks pieces are FX
    assert {p["dynamic"] for p in pieces if not p["host_only"]} == {"inductor"}
    assert {p["dynamic"] for p in pieces if p["host_only"]} == {"fx"} and not any(p["per_size"] for p in pieces)
    eng = dg.compile_model(target, drafter, config, artifacts=str(tmp_path / "a"), strict_artifacts=True)
    assert not eng.compiled.counters.traces and eng.compiled.counters.inductor_compiles == 0
    assert tokens(eng) == ref


def test_cli_build_then_generate_in_a_fresh_process(tmp_path, capsys):
    """`draftgraph build`, then `generate --artifacts` in a fresh process (what a deployment does), against
    `generate` compiling for itself; and a mismatch refused. Only the loading run needs a process of its own: the
    build and the references run the same CLI entry point here (each process imports torch: seconds on CI)."""
    from draftgraph.cli import main

    out = str(tmp_path / "art")
    common = ["--mode", "FULL_AND_PIECEWISE", "--compile-backend", "eager", "--capture-sizes", "1,4,16"]
    common += ["--fuse-draft-loop", "on"]  # the fused loop's traces travel too (the flag reaches the config)
    key = tmp_path / "key"
    key.write_bytes(os.urandom(32))  # `head -c 32 /dev/urandom > key`
    assert main(["build", "--out", out, "--sign-key", str(key), *common]) == 0
    built = capsys.readouterr().out
    assert "draft_loop: 2 trace(s)" in built and "SHA-256" in built
    assert f"signed {out}/manifest.sig" in built
    assert main(["generate", *common, "--max-tokens", "16"]) == 0
    compiled = capsys.readouterr().out
    loaded = subprocess.run(  # -v: the start-up timeline too (draftgraph/timeline.py)
        [sys.executable, "-m", "draftgraph", "-v", "generate", *common, "--max-tokens", "16", "--artifacts", out,
         "--strict-artifacts", "--verify-key", str(key), "--no-artifact-cache"],  # conftest's switch stays here
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        timeout=600,
    )  # fmt: skip
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert "no trace, no Inductor compile" in loaded.stdout
    # the timeline's phases, each once and in the order a start passes them (CPU: no CUDA init, no compile
    # workers, no KV sizing from device memory); loading artifacts, it loads kernels instead of compiling
    timeline = loaded.stderr[loaded.stderr.index("start-up timeline") :].splitlines()[1:]
    phases = [row.split(" s  ", 2)[2].split(":")[0].strip() for row in timeline]
    seconds = [float(row.split(" s ")[0]) for row in timeline]
    expected = ["imports", "models", "weight load", "kernel loads", "tracing", "compiles", "capture", "engine ready"]
    assert phases == [*expected, "first token", "exit", "exit handlers"], timeline  # (-v: the handlers' cost last)
    frozen = int(timeline[0].split("imports: ")[1].split()[0])  # the command's process froze its imports (gc)
    assert frozen > 10_000, timeline[0]
    ready = next(row for row in timeline if "engine ready" in row)  # and what the engine's build made, once built
    assert int(ready.split("engine ready: ")[1].split()[0]) > 1_000, ready
    # the built-in pair's weights travel inside the artifact (listed, signed), read from there: no transformers model
    listed = json.loads((tmp_path / "art" / "manifest.json").read_text())["files"]
    assert "builtin-target/model.safetensors" in listed and "models: built-in pair, from the artifacts" in timeline[1]
    assert seconds == sorted(seconds) and 0 < seconds[0] < seconds[-1], timeline  # order, not speed
    first = [line for line in compiled.splitlines() if line.startswith("request ")]
    assert first and first == [line for line in loaded.stdout.splitlines() if line.startswith("request ")]
    assert main(["generate", *common, "-k", "2", "--artifacts", out, "--strict-artifacts"]) == 2
    assert "num_speculative_tokens 3 != 2" in capsys.readouterr().err
