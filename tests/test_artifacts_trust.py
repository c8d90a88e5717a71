"""Artifacts that cannot lie: nothing read from an artifact directory is evaluated (input paths are declared
steps, graph call targets come from an allowlist), and a manifest or directory that does not match what
the engine needs is refused under strict (naming the entry) and compiled around otherwise.

Issue 40's attacks, each with a marker file an attacker's payload would write: an unlisted pickle in the
Inductor cache (never read: torch loads from a private copy of the listed files), `../` in triton/index.json
(refused, nothing written outside), an edited and re-checksummed file under a verify key (refused by the
signature), a refused graph beside a restorable Triton bundle (refused before any restore), a corrupt
treespec or manifest (a one-line ArtifactError)."""

import hashlib
import json
import os
import pickle
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

import draftgraph as dg
from draftgraph.artifacts.input_paths import InputPathError, describe, parse_source, reader
from draftgraph.artifacts.signing import SIG, sign_manifest
from draftgraph.artifacts.store import CACHE, MANIFEST, ArtifactError, build_artifacts
from draftgraph.compiler.fx_allowlist import TargetNotAllowed
from draftgraph.compiler.fx_serialize import decode_target
from draftgraph.models.causal_lm import CausalLM
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model
from tests.test_artifacts import cfg, tokens

KEY = b"k" * 32


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    target = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96))
    drafter = make_drafter("eagle", target)
    out = str(tmp_path_factory.mktemp("trust") / "a")
    engine = dg.compile_model(target, drafter, cfg(capture_sizes=(4,), full_capture_sizes=(4,)))
    build_artifacts(engine, out)
    return target, drafter, out, tokens(engine)


def _copy(out, dst, edit_manifest=None, edit_file=None):
    """A copy of the artifacts with the manifest and / or one stored file edited (its checksum updated, as
    an attacker who writes the directory would)."""
    shutil.copytree(out, dst)
    with open(os.path.join(dst, MANIFEST)) as f:
        m = json.load(f)
    if edit_file is not None:
        rel, fn = edit_file
        path = os.path.join(dst, rel)
        with open(path) as f:
            data = fn(json.load(f))
        with open(path, "w") as f:
            json.dump(data, f)
        import hashlib

        with open(path, "rb") as f:
            m["files"][rel] = hashlib.sha256(f.read()).hexdigest()
    if edit_manifest is not None:
        edit_manifest(m)
    with open(os.path.join(dst, MANIFEST), "w") as f:
        json.dump(m, f)
    return dst


def _load(built, path, strict=True, verify_key=None, **kw):
    target, drafter = built[:2]
    config = cfg(capture_sizes=(4,), full_capture_sizes=(4,), **kw)
    return dg.compile_model(target, drafter, config, artifacts=path, strict_artifacts=strict, verify_key=verify_key)


def _add_listed(root, rel, data: bytes):
    """Add a file and list it with its SHA-256 (what anyone who can write the directory can do)."""
    path = Path(root) / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    m = json.loads((Path(root) / MANIFEST).read_text())
    m["files"][rel] = hashlib.sha256(data).hexdigest()
    (Path(root) / MANIFEST).write_text(json.dumps(m))


class _Payload:
    """Unpickling it creates the marker file (an attacker's code running at load)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _loaded_without_compiling(eng):
    c = eng.compiled.counters
    return not c.traces and c.inductor_compiles == 0


def test_input_paths_parse_dynamo_sources_and_refuse_code():
    for src in (
        "L['args'][3][0][1].size()[0]",
        "L['fn'].__self__._modules['layers']._modules['0']._parameters['weight']",
        "L['fn'].__closure__[2].cell_contents._buffers['d2t']",
        "L['kwargs']['slot_mapping'].stride()[0]",
    ):
        assert describe(parse_source(src)) == src
    x = torch.zeros(5, 3)
    assert reader(parse_source("L['args'][1].size()[0]"))({"args": (None, x)}) == 5
    for bad in ("__import__('os').system('true')", "L['args'][0].__class__", "L['g']", "L['args'][0].numpy()"):
        with pytest.raises(InputPathError):
            parse_source(bad)
    with pytest.raises(InputPathError, match="step 1"):  # a step list from disk is checked the same way
        reader([["local", "fn"], ["attr", "__globals__"]])


def test_targets_outside_the_allowlist_are_refused_without_importing():
    assert decode_target("op:draftgraph::paged_attention.default") is torch.ops.draftgraph.paged_attention.default
    assert decode_target("py:torch.nn.functional:silu") is torch.nn.functional.silu
    assert "this" not in sys.modules
    for key in ("py:os:system", "py:this:s", "py:builtins:eval", "py:torch:load", "py:_operator:methodcaller"):
        with pytest.raises(TargetNotAllowed, match=re.escape(repr(key))):
            decode_target(key)
    assert "this" not in sys.modules  # refused by name: nothing a file names is imported


def test_a_crafted_input_path_is_refused_and_nothing_runs(built, tmp_path):
    marker = tmp_path / "ran"

    def edit(m):
        m["functions"]["target"]["traces"][0]["inputs"][0] = f"__import__('os').system('touch {marker}')"

    bad = _copy(built[2], str(tmp_path / "b"), edit_manifest=edit)
    with pytest.raises(ArtifactError, match=re.escape("function target trace 0 input 0")):
        _load(built, bad)
    eng = _load(built, bad, strict=False)  # not strict: named, then compiled instead
    assert "function target trace 0 input 0" in eng.warm_up_report and "compiled instead" in eng.warm_up_report
    assert not marker.exists()


def test_a_crafted_graph_target_or_name_is_refused_and_nothing_runs(built, tmp_path):
    marker = tmp_path / "ran"

    def to_system(g):
        node = next(n for n in g["nodes"] if n["op"] == "call_function")
        node["target"], node["args"] = "py:os:system", {"t": [f"touch {marker}"]}
        return g

    bad = _copy(built[2], str(tmp_path / "b"), edit_file=("functions/target.0.json", to_system))
    with pytest.raises(
        ArtifactError, match=re.escape("functions/target.0.json was refused: call target 'py:os:system'")
    ):
        _load(built, bad)

    def inject(g):  # FX writes placeholder names into generated code: a default argument would run at load
        node = next(n for n in g["nodes"] if n["op"] == "placeholder")
        node["target"] = f"x=__import__('os').system('touch {marker}')"
        return g

    bad2 = _copy(built[2], str(tmp_path / "c"), edit_file=("functions/target.0.json", inject))
    with pytest.raises(ArtifactError, match="argument name .* is not a plain identifier"):
        _load(built, bad2)
    assert not marker.exists()


def test_a_removed_function_is_named_under_strict_and_compiled_around_otherwise(built, tmp_path):
    bad = _copy(built[2], str(tmp_path / "b"), edit_manifest=lambda m: m["functions"].pop("drafter"))
    with pytest.raises(ArtifactError, match="function drafter is missing from the manifest"):
        _load(built, bad)
    eng = _load(built, bad, strict=False)
    assert "function drafter is missing" in eng.warm_up_report and eng.compiled.counters.traces["target"] == 1


def test_a_bad_piece_key_is_an_artifact_error(built, tmp_path):
    def edit(m):
        m["functions"]["target"]["traces"][0]["pieces"][0]["key"] = "nope"

    bad = _copy(built[2], str(tmp_path / "b"), edit_manifest=edit)
    with pytest.raises(ArtifactError, match=r"function target trace 0 piece \w+: key 'nope' is not one of"):
        _load(built, bad)


def test_unknown_files_and_paths_outside_the_directory_are_refused(built, tmp_path):
    extra = _copy(built[2], str(tmp_path / "b"))
    (tmp_path / "b" / "pieces" / "evil.bin").write_bytes(b"x")
    with pytest.raises(ArtifactError, match=re.escape("file pieces/evil.bin is in the directory but not in the")):
        _load(built, extra)
    outside = _copy(built[2], str(tmp_path / "c"), edit_manifest=lambda m: m["files"].update({"../x": "0"}))
    with pytest.raises(ArtifactError, match=re.escape("files entry '../x' is not a plain relative path")):
        _load(built, outside)


def test_a_k_mismatch_names_the_field_and_both_values(built):
    with pytest.raises(ArtifactError, match=re.escape("num_speculative_tokens 3 != 4")):
        _load(built, built[2], num_speculative_tokens=4)


def test_an_unlisted_file_is_ignored_by_default_and_named_under_strict(built, tmp_path):
    bad = _copy(built[2], str(tmp_path / "b"))
    (tmp_path / "b" / "pieces" / "evil.bin").write_bytes(pickle.dumps(_Payload(tmp_path / "ran")))
    eng = _load(built, bad, strict=False)
    assert _loaded_without_compiling(eng) and tokens(eng) == built[3]
    assert not (tmp_path / "ran").exists()


def test_clean_artifacts_load_signed_and_unsigned_with_the_same_tokens(built, tmp_path):
    signed = _copy(built[2], str(tmp_path / "s"))
    sign_manifest(signed, KEY)
    (tmp_path / "key").write_bytes(KEY)
    for path, key in ((built[2], None), (signed, str(tmp_path / "key")), (signed, KEY)):
        eng = _load(built, path, verify_key=key)
        assert _loaded_without_compiling(eng) and tokens(eng) == built[3]
    assert sorted(os.listdir(signed)) == sorted(os.listdir(built[2]) + [SIG])  # loading wrote nothing here


def test_an_edited_file_with_recomputed_checksums_is_refused_under_a_verify_key(built, tmp_path):
    """Attack 3: a pickle for pieces/<key>/dynamic.bin, its SHA-256 recomputed in the manifest; the attacker
    keeps the old signature, drops it, or signs with a key of their own: all refused before any piece is read."""
    signed = _copy(built[2], str(tmp_path / "s"))
    sign_manifest(signed, KEY)
    marker = tmp_path / "ran"
    m = json.loads((Path(signed) / MANIFEST).read_text())
    victim = next(f for f in sorted(m["files"]) if f.startswith("pieces/") and f.endswith("dynamic.bin"))
    _add_listed(signed, victim, pickle.dumps(_Payload(marker)))  # re-checksummed, the old manifest.sig kept
    with pytest.raises(ArtifactError, match=re.escape(f"{signed}/{SIG} does not match the manifest")):
        _load(built, signed, verify_key=KEY)
    eng = _load(built, signed, strict=False, verify_key=KEY)  # not strict: named, then compiled instead
    assert "does not match the manifest" in eng.warm_up_report and eng.compiled.counters.traces["target"] == 1
    sign_manifest(signed, b"attacker" * 4)  # re-signed with another key
    with pytest.raises(ArtifactError, match="signed with another key"):
        _load(built, signed, verify_key=KEY)
    os.remove(Path(signed) / SIG)
    with pytest.raises(ArtifactError, match=re.escape(f"artifacts in {signed} are not signed (no {SIG})")):
        _load(built, signed, verify_key=KEY)
    with pytest.raises(ArtifactError, match="holds 3 bytes; a key needs at least 16"):
        _load(built, signed, verify_key=b"abc")
    assert not marker.exists()


def test_dot_dot_in_the_triton_index_is_refused_and_nothing_is_written_outside(built, tmp_path, monkeypatch):
    """Attack 2: a launcher keyed `../../...` (a `.pth` there would run at every Python start)."""
    cache = tmp_path / "home" / "triton" / "cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    escape = "../../site-packages"
    index = {"kernels": {}, "launchers": {escape: "__triton_launcher.pth"}}
    # the files listed under plain names, the index still naming `../`
    bad2 = _copy(built[2], str(tmp_path / "c"))
    _add_listed(bad2, "triton/k/__triton_launcher.pth", b"import os\n")
    _add_listed(bad2, "triton/index.json", json.dumps(index).encode())
    with pytest.raises(ArtifactError, match=re.escape("triton/index.json was refused: triton/index.json: launcher")):
        _load(built, bad2)
    eng = _load(built, bad2, strict=False)
    assert "triton/index.json was refused" in eng.warm_up_report
    assert not (tmp_path / "home" / "site-packages").exists() and not cache.exists()
    assert os.environ["TRITON_CACHE_DIR"] == str(cache)


def test_a_refused_graph_stops_the_load_before_any_kernel_is_restored(built, tmp_path, monkeypatch):
    """Attack 4: a valid Triton bundle (a launcher that would be restored) beside a graph calling os.system."""
    pytest.importorskip("triton")
    cache = tmp_path / "triton_cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    marker = tmp_path / "ran"

    def to_system(g):
        node = next(n for n in g["nodes"] if n["op"] == "call_function")
        node["target"], node["args"] = "py:os:system", {"t": [f"touch {marker}"]}
        return g

    bad = _copy(built[2], str(tmp_path / "b"), edit_file=("functions/target.0.json", to_system))
    _add_listed(bad, "triton/LAUNCHERKEY/__triton_launcher.so", b"\x7fELF not really")
    _add_listed(bad, "triton/index.json", json.dumps({"launchers": {"LAUNCHERKEY": "__triton_launcher.so"}}).encode())
    for strict in (True, False):
        if strict:
            with pytest.raises(ArtifactError, match="call target 'py:os:system'"):
                _load(built, bad)
        else:
            assert "call target 'py:os:system'" in _load(built, bad, strict=False).warm_up_report
    assert not cache.exists() and not marker.exists()  # nothing restored, nothing ran
    assert os.environ["TRITON_CACHE_DIR"] == str(cache)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda m: m["functions"]["target"]["traces"][0].update(treespec='[1, {"x": 1}]'), "treespec cannot be"),
        (lambda m: m["functions"]["target"]["traces"][0].update(treespec='{"protocol": 1}'), "treespec cannot be"),
        (lambda m: m["functions"]["target"]["traces"][0].update(leaf_map="abc"), "leaf_map 'abc' is not"),
        (lambda m: m["functions"]["target"].update(pieces=[1]), "has no 'pieces' table"),
        (lambda m: m["functions"].update(target=[]), "function target lists no traces"),
        (lambda m: m["files"].update({"functions/target.0.json": 5}), "checksum 5 is not a SHA-256"),
        (lambda m: m.update(files=[]), "no 'files' table"),
        (lambda m: m["functions"]["target"]["traces"][0]["pieces"].append(7), "piece 7 has no plain name"),
    ],
)
def test_a_corrupt_manifest_is_a_one_line_artifact_error(built, tmp_path, edit, message):
    """Attack 5 and its relatives: never a traceback from decoding, also under strict."""
    bad = _copy(built[2], str(tmp_path / "b"), edit_manifest=edit)
    with pytest.raises(ArtifactError, match=re.escape(message)) as e:
        _load(built, bad)
    assert "\n" not in str(e.value)


def test_a_manifest_that_is_not_json_is_a_one_line_artifact_error(built, tmp_path):
    bad = _copy(built[2], str(tmp_path / "b"))
    for data in (b"{not json", b"\xff\xfe\x00", b"[1, 2]"):
        (Path(bad) / MANIFEST).write_bytes(data)
        with pytest.raises(ArtifactError, match=f"{MANIFEST} is not (valid JSON|a JSON object)") as e:
            _load(built, bad)
        assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def inductor_built(built, tmp_path_factory):
    """A CPU Inductor build (target only, PIECEWISE, one size: few compiles) whose Inductor cache is inside
    the artifact, as `draftgraph build` makes one on the CPU."""
    out = tmp_path_factory.mktemp("trust_inductor") / "a"
    config = cfg(backend="inductor", mode="PIECEWISE", capture_sizes=(4,), cache_dir=str(out / CACHE))
    engine = dg.compile_model(built[0], None, config)
    build_artifacts(engine, str(out))
    return out, config, tokens(engine)


def test_an_unlisted_pickle_in_the_inductor_cache_never_runs(built, inductor_built, tmp_path):
    """Attack 1: a pickle beside each of Inductor's cache entries (torch's lookups unpickle every file of a key
    directory). Loaded from the private copy of the listed files, it is never read; strict refuses it."""
    out, config, ref = inductor_built
    bad = tmp_path / "b"
    shutil.copytree(out, bad)
    marker = tmp_path / "ran"
    cached = [f for f in (bad / CACHE).rglob("*") if f.is_file()]
    entries = sorted({f.parent for f in cached if {"fxgraph", "aotautograd"} & set(f.relative_to(bad).parts)})
    assert entries  # the build put Inductor's cache entries into the artifact
    for d in entries:
        (d / "zz_evil").write_bytes(pickle.dumps(_Payload(marker)))
    eng = dg.compile_model(built[0], None, config, artifacts=str(bad))
    assert _loaded_without_compiling(eng) and tokens(eng) == ref
    assert not marker.exists()
    with pytest.raises(ArtifactError, match=re.escape(f"file {CACHE}/") + ".*zz_evil.* is in the directory but not"):
        dg.compile_model(built[0], None, config, artifacts=str(bad), strict_artifacts=True)
    before = sorted(p.relative_to(out).as_posix() for p in out.rglob("*"))
    eng = dg.compile_model(built[0], None, config, artifacts=str(out), strict_artifacts=True)  # the clean one
    assert _loaded_without_compiling(eng) and tokens(eng) == ref and not marker.exists()
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == before  # nothing written into it
