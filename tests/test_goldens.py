"""Fresh inspections of the built-in tiny pairs (family x drafter kind x mode) against tests/golden/.

Each FULL_AND_PIECEWISE case's inspection workload (greedy; the inspection's own compile and run, no other) gives
tokens that must equal transformers' `generate()` on the same weights: every family and drafter kind in the compiled
mode against an oracle we did not write (on the CPU the mode runs its compiled pieces without CUDA graphs).

On a difference the test prints graph-diff's lines first, then the commands that review and write the goldens
(scripts/refresh_goldens.py: it writes nothing without --write).
"""

import json
import os

import pytest

import draftgraph as dg
from scripts.refresh_goldens import main as refresh
from scripts.refresh_goldens import review
from tests import goldens
from tests.goldens import REFRESH, case_hf, case_name, cases, failure_message, golden_dir, inspect_case
from tests.helpers import hf_greedy

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
TRANSFORMERS_TOKENS: dict = {}  # (family, prompts, max_tokens) -> transformers' greedy tokens


@pytest.mark.parametrize("case", cases(), ids=[case_name(*c) for c in cases()])
def test_inspection_matches_golden(case, tmp_path, monkeypatch):
    expected = golden_dir(GOLDEN, *case)
    assert os.path.exists(os.path.join(expected, "summary.json")), (
        f"no golden for {case_name(*case)}: review it with `{REFRESH} {case_name(*case)}`, then add `--write`"
    )
    runs, compile_model = [], dg.compile_model

    def compile_and_record(*args, **kwargs):  # the inspection's engine, its workload's tokens recorded
        engine = compile_model(*args, **kwargs)
        generate = engine.generate

        def recorded(prompts, params, *rest, **kw):
            outputs = generate(prompts, params, *rest, **kw)
            runs.append((prompts, params, [o.token_ids for o in outputs], engine.stats()))
            return outputs

        engine.generate = recorded
        return engine

    monkeypatch.setattr(dg, "compile_model", compile_and_record)
    hf = case_hf(case[0])
    inspect_case(*case, str(tmp_path), hf=hf)
    lines = review(expected, str(tmp_path))
    if lines is not None:
        pytest.fail(failure_message(case_name(*case), lines))
    if case[2] != "FULL_AND_PIECEWISE":
        return
    ((prompts, params, got, stats),) = runs
    assert params.temperature == 0.0 and params.ignore_eos, params  # greedy, every token counted
    key = (case[0], str(prompts), params.max_tokens)  # one family's tokens serve every drafter kind (greedy)
    if key not in TRANSFORMERS_TOKENS:
        TRANSFORMERS_TOKENS[key] = hf_greedy(hf, prompts, params.max_tokens)
    want = TRANSFORMERS_TOKENS[key]
    assert got == want, f"{case_name(*case)}: greedy tokens differ from transformers' generate()"
    assert stats["verify_steps"] > 0, stats  # the drafter proposed and the target verified


def test_refresh_shows_the_diff_and_writes_only_when_asked(tmp_path, monkeypatch, capsys):
    """The refresh script on a copy of one golden, with an inspection that gains one linear in the drafter's first
    compute piece (no model run: the inspection is replaced): the dry run prints graph-diff's line and leaves
    the file alone, --write writes it, and a second dry run finds nothing to do."""
    name = "llama-eagle-piecewise"
    case = next(c for c in cases() if case_name(*c) == name)
    with open(os.path.join(golden_dir(GOLDEN, *case), "summary.json")) as f:
        summary = json.load(f)
    root = tmp_path / "golden"
    os.makedirs(golden_dir(str(root), *case))
    golden_file = tmp_path / "golden" / case_name(*case) / "summary.json"
    golden_file.write_text(before := json.dumps(summary, indent=1, sort_keys=True))
    piece = next(p for p in summary["functions"]["drafter"]["traces"][0]["pieces"] if p["kind"] == "compute")
    piece["ops"]["torch._C._nn.linear"] = piece["ops"].get("torch._C._nn.linear", 0) + 1
    fresh = json.dumps(summary, indent=1, sort_keys=True)

    def fake_inspect(family, kind, mode, out_dir):
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            f.write(fresh)

    monkeypatch.setattr(goldens, "inspect_case", fake_inspect)
    assert refresh(["--golden-dir", str(root), name]) == 1
    out = capsys.readouterr().out
    assert f"changed {name}:" in out and "[ops] drafter" in out and "torch._C._nn.linear" in out, out
    assert "nothing written" in out and f"--write {name}" in out
    assert golden_file.read_text() == before  # the dry run wrote nothing
    assert refresh(["--golden-dir", str(root), "--write", name]) == 0
    assert golden_file.read_text() == fresh
    assert refresh(["--golden-dir", str(root), name]) == 0
    assert f"unchanged {name}" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # a name that is no case: refused, naming the cases
        refresh(["--golden-dir", str(root), "llama-nope"])
    assert "unknown case llama-nope" in capsys.readouterr().err


def test_failure_message_shows_the_diff_before_the_command():
    msg = failure_message("llama-eagle-piecewise", ["[ops] drafter#0/piece 1: torch._C._nn.linear 5 -> 6"])
    assert msg.index("[ops] drafter") < msg.index(REFRESH)
    assert f"{REFRESH} --write llama-eagle-piecewise" in msg
