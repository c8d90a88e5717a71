"""Imports flow one way (DESIGN.md): ops <- models <- passes <- compiler <- runtime <- api / cli / workers. A stage
never imports a later one, at module level or inside a function."""

import ast
from pathlib import Path

import pytest

import draftgraph

ROOT = Path(draftgraph.__file__).parent
ORDER = ["ops", "models", "passes", "compiler", "runtime"]
LATER = {
    stage: [*ORDER[i + 1 :], "api", "cli", "cli_parser", "preflight", "inspection", "workers"]
    for i, stage in enumerate(ORDER)
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


@pytest.mark.parametrize("stage", ORDER)
def test_no_stage_imports_a_later_one(stage):
    forbidden = tuple(f"draftgraph.{later}" for later in LATER[stage])
    bad = [
        f"{path.relative_to(ROOT.parent)}:{line} imports {name}"
        for path in sorted((ROOT / stage).rglob("*.py"))
        for line, name in imported_modules(path)
        if ".".join(name.split(".")[:2]) in forbidden
    ]
    assert not bad, "imports must flow ops <- models <- passes <- compiler <- runtime <- api/cli:\n" + "\n".join(bad)


def test_the_check_sees_a_backward_import(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def f():\n    from draftgraph.runtime.engine import Engine\n")
    assert imported_modules(f) == [(2, "draftgraph.runtime.engine")]
