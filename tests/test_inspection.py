"""`draftgraph inspect` and `draftgraph graph-diff`: stable output, the diff lines, exit codes, depyf."""

import filecmp
import json
import os
import pathlib
import sys
import warnings

import pytest
import torch

from draftgraph.cli import main
from draftgraph.inspection.graph_diff import diff, load
from draftgraph.inspection.report import inspect_function
from tests import toy_models

ARGS = (torch.randn(4, 8), torch.randn(8, 8))


def toy(tmp_path, fn, name):
    out = str(tmp_path / name)
    inspect_function("toy", fn, ARGS, out)
    return out


def same_tree(a, b, skip=("depyf",)) -> bool:
    cmp = filecmp.dircmp(a, b, ignore=list(skip))
    if cmp.left_only or cmp.right_only or cmp.diff_files or cmp.funny_files:
        return False
    return all(same_tree(os.path.join(a, d), os.path.join(b, d)) for d in cmp.common_dirs)


def test_two_inspections_of_one_model_are_byte_identical(tmp_path, capsys):
    for name in ("a", "b"):
        assert (
            main(
                [
                    "inspect",
                    "--out",
                    str(tmp_path / name),
                    "--family",
                    "qwen3",
                    "--drafter-kind",
                    "eagle",
                    "--compile-backend",
                    "eager",
                    "-k",
                    "2",
                ]
            )
            == 0
        )
    assert same_tree(tmp_path / "a", tmp_path / "b")  # depyf's raw files (uuids, paths) are not ours
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    target = summary["functions"]["target"]["traces"][0]
    # built-in target: 6 layers -> 7 compute pieces (3 unique), 6 attention pieces, and the input-checks piece
    # before the piece boundary at the body's start
    assert target["compute_pieces"] == 7 and target["unique_compute_pieces"] == 3 and len(target["pieces"]) == 15
    assert [p["kind"] for p in target["pieces"][:3]] == ["checks", "boundary", "compute"]
    assert summary["functions"]["drafter"]["draft_loop"] == {
        "steps": 2,
        "graph_launches_per_proposal": 4,
        "fused": False,
    }
    text = (tmp_path / "a" / "graphs" / "target.trace0.graph.txt").read_text()
    import re

    assert not re.findall(r".{60}0x.{10}", text), re.findall(r".{60}0x.{10}", text)[:3]
    assert not re.findall(r".{80}/tmp.{30}", text), re.findall(r".{80}/tmp.{30}", text)[:3]
    assert "u0" not in text and "s0" in text
    assert main(["graph-diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "no change" in capsys.readouterr().out


def test_extra_op_and_graph_break_show_up_in_the_diff(tmp_path, capsys):
    base = toy(tmp_path, toy_models.toy_base, "base")
    extra = toy(tmp_path, toy_models.toy_extra_op, "extra")
    broken = toy(tmp_path, toy_models.toy_graph_break, "broken")
    same = toy(tmp_path, toy_models.toy_base, "same")

    assert main(["graph-diff", base, same]) == 0
    assert main(["graph-diff", base, extra]) == 1
    out = capsys.readouterr().out
    assert "[ops] toy trace 0 piece 0: torch.tanh +1" in out

    assert main(["graph-diff", base, broken]) == 1
    out = capsys.readouterr().out
    assert "[graph_break] toy: new: tests/toy_models.py:18:" in out  # the line of the .item() branch
    assert "[trace] toy: traces 1 -> 2" in out

    assert main(["graph-diff", base, broken, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["equal"] is False
    assert {c["kind"] for c in report["changes"]} >= {"graph_break", "trace"}
    changes = diff(load(base), load(broken))
    assert any(c.kind == "graph_break" and "toy_models.py:18" in c.detail for c in changes)


def test_the_fused_loop_is_inspected_when_asked_for(tmp_path):
    """FULL_AND_PIECEWISE runs the draft loop around the drafter step by default (no trace of its own: the golden
    inspection of that case, which tests/test_goldens.py keeps fresh); `--fuse-draft-loop on` traces it, and the
    inspection shows its function."""
    golden = pathlib.Path(__file__).parent / "golden" / "llama-eagle-full_and_piecewise" / "summary.json"
    functions = {"auto": json.loads(golden.read_text())["functions"]}
    out = tmp_path / "on"
    args = ["inspect", "--out", str(out), "--family", "llama", "--drafter-kind", "eagle", "--compile-backend"]
    args += ["eager", "-k", "2", "--mode", "FULL_AND_PIECEWISE", "--fuse-draft-loop", "on"]
    assert main(args) == 0
    functions["on"] = json.loads((out / "summary.json").read_text())["functions"]
    assert set(functions["auto"]) == {"target", "drafter"}
    assert set(functions["on"]) == {"target", "drafter", "draft_loop"}
    assert len(functions["on"]["draft_loop"]["traces"]) == 2  # greedy and sampled


def test_missing_directory_exits_2(tmp_path, capsys):
    assert main(["graph-diff", str(tmp_path / "nope"), str(tmp_path / "nope2")]) == 2
    assert "is not an inspection: no summary.json there" in capsys.readouterr().out


def test_depyf_files_written_when_installed(tmp_path):
    pytest.importorskip("depyf", reason="depyf is an optional dependency (the inspect extra)")
    from tests.goldens import inspect_case

    inspect_case("llama", "eagle", "PIECEWISE", str(tmp_path))
    files = os.listdir(tmp_path / "depyf")
    assert any(f.startswith("full_code_for_") for f in files)
    assert any("__compiled_fn" in f for f in files)


def test_inspection_completes_without_depyf(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "depyf", None)  # import depyf -> ImportError
    from tests.goldens import inspect_case

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = inspect_case("llama", "mtp", "PIECEWISE", str(tmp_path))
    assert any("depyf is not installed" in str(w.message) for w in caught)
    assert not (tmp_path / "depyf").exists() and (tmp_path / "summary.json").exists()
    assert report["functions"]["target"]["traces"]
