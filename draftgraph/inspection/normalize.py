"""Normalized, stable text and summaries of FX graphs: no addresses, ids, uuids or temporary paths.

Symbolic sizes are renamed in order of first appearance (s0, s1, ...), so two traces of the same code
print the same text whatever numbers Dynamo gave its symbols.
"""

from __future__ import annotations

import os
import re
from collections import Counter

import sympy
import torch
from torch import fx

_ADDRESS = re.compile(r"0x[0-9a-fA-F]+")
_SYMBOL = re.compile(r"\b[us]\d+\b")


def target_name(target) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    name = name.removeprefix("_VariableFunctionsClass.")  # torch.tanh, not its C-class qualname
    return _ADDRESS.sub("0x?", f"{module}.{name}" if module else name)


class SymbolNames:
    """Maps Dynamo's symbols (u0, s77, ...) to s0, s1, ... in order of first appearance."""

    def __init__(self):
        self.names: dict[str, str] = {}  # Dynamo's symbol name -> ours

    def name(self, original: str) -> str:
        if original not in self.names:
            self.names[original] = f"s{len(self.names)}"
        return self.names[original]

    def expr(self, e) -> str:
        e = sympy.sympify(e)
        subs = {sym: sympy.Symbol(self.name(str(sym)), integer=True) for sym in sorted(e.free_symbols, key=str)}
        return str(e.xreplace(subs))

    def text(self, s: str) -> str:
        """Symbol names inside free text (Dynamo's assert messages name them)."""
        return _SYMBOL.sub(lambda m: self.name(m.group(0)), s)

    def value(self, v) -> str:
        if isinstance(v, torch.SymInt):
            return self.expr(v.node.expr)
        if isinstance(v, torch.Tensor):
            dims = ", ".join(self.expr(d.node.expr) if isinstance(d, torch.SymInt) else str(d) for d in v.shape)
            return f"{str(v.dtype).removeprefix('torch.')}[{dims}]"
        if isinstance(v, (list, tuple)):
            return "(" + ", ".join(self.value(x) for x in v) + ")"
        return type(v).__name__ if v is not None else "-"


def _arg(a, names: dict, syms: SymbolNames) -> str:
    if isinstance(a, fx.Node):
        return names[a]
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x, names, syms) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner})"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k}: {_arg(v, names, syms)}" for k, v in a.items()) + "}"
    if isinstance(a, torch.SymInt):
        return syms.value(a)
    if isinstance(a, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(a)
    if callable(a) and not isinstance(a, (int, float, str, bool)):
        return target_name(a)
    if isinstance(a, str):
        return repr(syms.text(a))
    return _ADDRESS.sub("0x?", repr(a))


def graph_text(gm: fx.GraphModule) -> str:
    """One line per node: `name = op target(args) :: value`. Placeholders named after symbols are renamed."""
    syms = SymbolNames()
    names: dict[fx.Node, str] = {}
    lines = []
    for node in gm.graph.nodes:
        ev = node.meta.get("example_value")
        name = node.name
        if node.op == "placeholder" and isinstance(ev, torch.SymInt):
            name = syms.value(ev)
        names[node] = name
        args = ", ".join(
            [_arg(a, names, syms) for a in node.args] + [f"{k}={_arg(v, names, syms)}" for k, v in node.kwargs.items()]
        )
        target = "" if node.op in ("placeholder", "output") else " " + target_name(node.target)
        lines.append(f"{name} = {node.op}{target}({args}) :: {syms.value(ev)}")
    return "\n".join(lines) + "\n"


def op_counts(gm: fx.GraphModule) -> dict[str, int]:
    counts = Counter(target_name(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method"))
    return dict(sorted(counts.items()))


def io_shapes(gm: fx.GraphModule, syms: SymbolNames) -> tuple[list[str], list[str]]:
    inputs = [syms.value(n.meta.get("example_value")) for n in gm.graph.nodes if n.op == "placeholder"]
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    vals = out.args[0] if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
    outputs = [syms.value(v.meta.get("example_value")) if isinstance(v, fx.Node) else "-" for v in vals]
    return inputs, outputs


def relative_location(filename: str, lineno: int) -> str:
    """A source location without machine-specific prefixes: path from the package or repo root."""
    parts = filename.replace("\\", "/").split("/")
    for anchor in ("draftgraph", "tests", "scripts", "site-packages"):
        if anchor in parts:
            i = len(parts) - 1 - parts[::-1].index(anchor)
            return "/".join(parts[i + (anchor == "site-packages") :]) + f":{lineno}"
    return f"{os.path.basename(filename)}:{lineno}"
