"""Fresh inspections of the built-in tiny pairs (family x drafter kind x mode) against tests/golden/.

On a difference the test prints graph-diff's lines and the one command that refreshes the goldens.
"""

import os

import pytest

from draftgraph.inspection.graph_diff import diff, load
from tests.goldens import REFRESH, case_name, cases, golden_dir, inspect_case

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


@pytest.mark.parametrize("case", cases(), ids=[case_name(*c) for c in cases()])
def test_inspection_matches_golden(case, tmp_path):
    expected = golden_dir(GOLDEN, *case)
    assert os.path.exists(os.path.join(expected, "summary.json")), f"no golden for {case}: run `{REFRESH}`"
    inspect_case(*case, str(tmp_path))
    fresh = (tmp_path / "summary.json").read_text()
    with open(os.path.join(expected, "summary.json")) as f:
        golden = f.read()
    if fresh != golden:
        lines = [c.line() for c in diff(load(expected), load(str(tmp_path)))] or ["(the JSON text differs only)"]
        pytest.fail(
            f"{case_name(*case)}: how the model compiles changed:\n  "
            + "\n  ".join(lines)
            + f"\nIf the change is intended, refresh the goldens with `{REFRESH}` and review `git diff tests/golden`."
        )
