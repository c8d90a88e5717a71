"""Triton versions differ in what a kernel's source may say: the device has Triton 3.6, this machine a newer one.
Rules found the hard way are checked on the source here, where no GPU compiles it.

* No `@triton.jit` function takes a default value: Triton 3.6 hands a jit helper's defaults to the code
  generator as raw Python values, and every kernel calling it fails to compile ("'str' object has no attribute
  'type'" in the GPU tier of 2026-11-26); newer Triton wraps them. Callers name every argument."""

import ast
from pathlib import Path

import draftgraph

ROOT = Path(draftgraph.__file__).parent


def jit_functions_with_defaults(source: str) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(source)):
        jit = isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list)
        if jit and (node.args.defaults or any(d is not None for d in node.args.kw_defaults)):
            out.append((node.lineno, node.name))
    return out


def test_no_jit_function_takes_a_default():
    bad = [
        f"{path.relative_to(ROOT.parent)}:{line} {name}"
        for path in sorted(ROOT.rglob("*.py"))
        for line, name in jit_functions_with_defaults(path.read_text())
    ]
    assert not bad, "@triton.jit functions with default values (Triton 3.6 cannot call them):\n" + "\n".join(bad)


def test_the_check_sees_a_default():
    src = 'import triton\n@triton.jit\ndef f(x, C: tl.constexpr = ""):\n    pass\n@triton.jit\ndef g(x, C):\n    pass\n'
    assert jit_functions_with_defaults(src) == [(3, "f")]
