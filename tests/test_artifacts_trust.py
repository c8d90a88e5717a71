"""Artifacts that cannot lie: nothing read from an artifact directory is evaluated (input paths are declared
steps, graph call targets come from an allowlist), and a manifest or directory that does not match what
the engine needs is refused under strict (naming the entry) and compiled around otherwise."""

import json
import os
import re
import shutil
import sys

import pytest
import torch

import draftgraph as dg
from draftgraph.artifacts.input_paths import InputPathError, describe, parse_source, reader
from draftgraph.artifacts.store import MANIFEST, ArtifactError, build_artifacts
from draftgraph.compiler.fx_allowlist import TargetNotAllowed
from draftgraph.compiler.fx_serialize import decode_target
from draftgraph.models.causal_lm import CausalLM
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model
from tests.test_artifacts import cfg


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    target = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96))
    drafter = make_drafter("eagle", target)
    out = str(tmp_path_factory.mktemp("trust") / "a")
    build_artifacts(dg.compile_model(target, drafter, cfg(capture_sizes=(4,), full_capture_sizes=(4,))), out)
    return target, drafter, out


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


def _load(built, path, strict=True, **kw):
    target, drafter, _ = built
    return dg.compile_model(
        target, drafter, cfg(capture_sizes=(4,), full_capture_sizes=(4,), **kw), artifacts=path, strict_artifacts=strict
    )


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
