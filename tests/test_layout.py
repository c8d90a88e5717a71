"""Imports flow one way (DESIGN.md):

    ops <- models <- passes <- compiler (core; compiler/pool beside it) <- artifacts <- runtime <- build
        <- workers <- api <- inspection <- serve <- cli

A stage never imports a later one: at module level, inside a function, through `import draftgraph as dg` (whose
attributes are the public names of api / compiler.config / runtime.request, draftgraph/__init__.py), or by name
(`importlib.import_module("draftgraph....")`). Inside compiler/, the compile pool (compiler/pool/) imports of the
core only the data formats a worker process needs. The compile workers import only ops/ modules (the ones that
define our custom ops) besides the compiler: nothing of the runtime."""

import ast
import importlib
import pkgutil
import sys
from pathlib import Path

import pytest

import draftgraph

ROOT = Path(draftgraph.__file__).parent
ORDER = [
    "ops",
    "models",
    "passes",
    "compiler",
    "artifacts",
    "runtime",
    "build",
    "workers",
    "api",
    "inspection",
    "serve",
    "cli",
]
# top-level modules that are not stages of their own: the stage they belong to
MEMBER_OF = {"envs": "compiler", "timeline": "ops", "__main__": "cli", "__init__": "api"}
# what a compile pool module may take from the compiler core (the formats jobs travel in)
POOL_MAY_IMPORT = {"fx_serialize", "fx_allowlist", "inductor_options", "piece_inputs"}


def stage_of(module: str) -> str | None:
    """'draftgraph.runtime.engine' -> 'runtime'; None outside draftgraph."""
    parts = module.split(".")
    if parts[0] != "draftgraph" or len(parts) < 2:
        return None
    return MEMBER_OF.get(parts[1], parts[1])


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every draftgraph module `path` imports, however it imports it."""
    tree = ast.parse(path.read_text())
    out = []
    aliases = set()  # names bound to the draftgraph package itself
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "draftgraph":
                    aliases.add(a.asname or "draftgraph")
                else:
                    out.append((node.lineno, a.name))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "draftgraph":  # `from draftgraph import compile_model` is api's
                out += [(node.lineno, public_home(a.name)) for a in node.names]
            else:
                out.append((node.lineno, node.module))
        elif (  # importlib.import_module("draftgraph.x.y")
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.append((node.lineno, node.args[0].value))
    for node in ast.walk(tree):  # dg.compile_model -> draftgraph.api
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            out.append((node.lineno, public_home(node.attr)))
    return [(line, m) for line, m in out if m.startswith("draftgraph")]


def public_home(name: str) -> str:
    """The module behind `draftgraph.<name>`: a public name's own module (draftgraph/__init__.py), the package for
    its metadata (__version__, __file__)."""
    where = draftgraph._WHERE.get(name)
    if where is None:
        return "draftgraph"
    return where[0] if isinstance(where, tuple) else where


def backward_imports(path: Path) -> list[str]:
    rel = path.relative_to(ROOT.parent)
    own = stage_of(".".join(rel.with_suffix("").parts))
    if own not in ORDER:
        return [f"{rel}: not in a known stage; add it to tests/test_layout.py ORDER or MEMBER_OF"]
    bad = []
    for line, name in imported_modules(path):
        stage = stage_of(name)
        if stage is not None and stage in ORDER and ORDER.index(stage) > ORDER.index(own):
            bad.append(f"{rel}:{line} imports {name} ({stage} comes after {own})")
        if rel.parts[1:3] == ("compiler", "pool") and name.startswith("draftgraph.compiler."):
            sub = name.split(".")[2]
            if sub != "pool" and sub not in POOL_MAY_IMPORT:
                bad.append(f"{rel}:{line} imports {name} (the compile pool takes only {sorted(POOL_MAY_IMPORT)})")
    return bad


def all_package_files() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", all_package_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_a_later_stage(path):
    bad = backward_imports(path)
    assert not bad, "imports must flow " + " <- ".join(ORDER) + ":\n" + "\n".join(bad)


def test_the_compile_workers_import_no_runtime_module():
    """The workers import compile_worker's own imports and the modules in ops/registry.DEFINED_IN (every module
    that defines a draftgraph op, once the whole package is imported): all must be below the runtime."""
    for m in pkgutil.walk_packages(draftgraph.__path__, "draftgraph."):
        if not m.name.endswith("__main__"):
            importlib.import_module(m.name)
    from draftgraph.ops.registry import DEFINED_IN

    assert DEFINED_IN, "no op defined"
    ours = {op: mod for op, mod in DEFINED_IN.items() if op.startswith("draftgraph::")}  # tests define others
    outside = {op: mod for op, mod in ours.items() if stage_of(mod) != "ops"}
    assert not outside, f"ops defined outside draftgraph/ops (compile workers would import them): {outside}"
    worker = ROOT / "compiler" / "pool" / "compile_worker.py"
    assert {stage_of(m) for _, m in imported_modules(worker)} <= {"ops", "compiler"}


@pytest.mark.parametrize(
    "source, found",
    [
        ("def f():\n    from draftgraph.runtime.engine import Engine\n", "draftgraph.runtime.engine"),
        ("import draftgraph as dg\n\ndef f():\n    return dg.compile_model\n", "draftgraph.api"),
        ("from draftgraph import compile_model\n", "draftgraph.api"),
        ("import importlib\nimportlib.import_module('draftgraph.runtime.sampler')\n", "draftgraph.runtime.sampler"),
    ],
)
def test_the_check_sees_every_form_of_a_backward_import(tmp_path, source, found):
    f = tmp_path / "x.py"
    f.write_text(source)
    assert found in [m for _, m in imported_modules(f)]


def test_a_put_back_arrow_fails(tmp_path, monkeypatch):
    """Each back-arrow the tree once had is caught when put back: the worker importing the api, inspection
    reaching compile_model through `dg`, an op defined in the runtime, the pool importing the piecewise core."""
    cases = {
        "workers/worker.py": "from draftgraph.api import build_engine\n",
        "inspection/report.py": "import draftgraph as dg\nx = dg.compile_model\n",
        "runtime/sampler.py": "from draftgraph.build import engine\n",
        "compiler/piecewise.py": "from draftgraph.artifacts.store import load_functions\n",
        "compiler/pool/compile_worker.py": "from draftgraph.compiler.piecewise import PieceCache\n",
        "models/layers.py": "from draftgraph.compiler.config import ResolvedConfig\n",
    }
    fake_root = tmp_path / "draftgraph"
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake_root)
    for rel, source in cases.items():
        path = fake_root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
        if rel.startswith("inspection"):  # inspection is above the api: dg is fine there, not in a lower stage
            lower = fake_root / "runtime" / "report.py"
            lower.parent.mkdir(parents=True, exist_ok=True)
            lower.write_text(source)
            assert backward_imports(lower), source
            continue
        assert backward_imports(path), f"{rel}: {source}"
