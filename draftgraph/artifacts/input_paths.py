"""Where a stored trace reads each graph input from: a declared path of steps, never a Python expression.

Dynamo names each graph input by the expression it was read from over the entry point's locals `L`:
`L['args'][0]`, `L['fn'].__self__._modules['layers']._modules['0']._parameters['weight']`,
`L['kwargs']['slot_mapping'].size()[0]`. At build time that text is parsed with `ast` against a strict
grammar into a list of steps; an artifact stores only the steps, and loading runs them with the small
interpreter below. Nothing read from disk is evaluated as Python.

Steps (JSON lists):
- `["local", NAME]` (first step only; NAME is args, kwargs or fn): the call's positional arguments, its
  keyword arguments, or the function the trace was taken of;
- `["attr", NAME]`: an attribute; NAME is an identifier, and a dunder only from `_DUNDERS`;
- `["item", KEY]`: `x[KEY]`, KEY an int or a string;
- `["size", DIM]`, `["stride", DIM]`, `["storage_offset"]`: a tensor's size or stride at DIM, or its
  storage offset (checked to be a tensor at the call: nothing else is ever called).
"""

from __future__ import annotations

import ast
import operator
import re

import torch

LOCALS = ("args", "kwargs", "fn")
# What Dynamo reads through to reach a bound method's module or a closure's captured object.
_DUNDERS = frozenset({"__self__", "__func__", "__closure__", "__wrapped__"})
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TENSOR_CALLS = ("size", "stride", "storage_offset")


class InputPathError(ValueError):
    """A path that is not in the declared format (the message says which step and why)."""


# ---- build time: Dynamo's expression -> steps ----------------------------------------------------------


def parse_source(expr: str) -> list[list]:
    """Steps for one of Dynamo's source expressions; InputPathError when it is outside the grammar."""
    try:
        node = ast.parse(expr, mode="eval").body
    except SyntaxError as e:
        raise InputPathError(f"input source {expr!r} is not an expression ({e.msg})") from e
    steps = _parse(node, expr)
    validate(steps)
    return steps


def _parse(node, expr: str) -> list[list]:
    if isinstance(node, ast.Subscript):
        key = node.slice
        if isinstance(node.value, ast.Name) and node.value.id == "L":
            if isinstance(key, ast.Constant) and key.value in LOCALS:
                return [["local", key.value]]
            raise InputPathError(f"input source {expr!r} reads a local other than {LOCALS}")
        if isinstance(node.value, ast.Call) and isinstance(key, ast.Constant):  # x.size()[0], x.stride()[1]
            call = _parse(node.value, expr)
            if call[-1][0] in ("size", "stride") and call[-1][1] is None and type(key.value) is int:
                return [*call[:-1], [call[-1][0], key.value]]
        if isinstance(key, ast.Constant) and type(key.value) in (int, str):
            return [*_parse(node.value, expr), ["item", key.value]]
        raise InputPathError(f"input source {expr!r}: subscript {ast.unparse(key)!r} is not an int or string")
    if isinstance(node, ast.Attribute):
        return [*_parse(node.value, expr), ["attr", node.attr]]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _TENSOR_CALLS:
        args = [a.value for a in node.args if isinstance(a, ast.Constant) and type(a.value) is int]
        if node.keywords or len(args) != len(node.args) or len(args) > 1:
            raise InputPathError(f"input source {expr!r}: {node.func.attr}() takes at most one int here")
        base = _parse(node.func.value, expr)
        if node.func.attr == "storage_offset":
            if args:
                raise InputPathError(f"input source {expr!r}: storage_offset() takes no argument")
            return [*base, ["storage_offset"]]
        return [*base, [node.func.attr, args[0] if args else None]]
    raise InputPathError(
        f"input source {expr!r} is outside the stored grammar (L[...] then attributes, int / string "
        "subscripts, size()[i], stride()[i], storage_offset())"
    )


# ---- load time: checked steps -> a reader -------------------------------------------------------------


def validate(steps) -> None:
    """Raise InputPathError unless `steps` is a path in the declared format."""
    if not isinstance(steps, list) or not steps:
        raise InputPathError(f"input path {steps!r} is not a non-empty list of steps")
    for i, step in enumerate(steps):
        if not isinstance(step, list) or not step or not isinstance(step[0], str):
            raise InputPathError(f"step {i} {step!r} is not a list [kind, argument]")
        kind, args = step[0], step[1:]
        if (kind == "local") != (i == 0):
            raise InputPathError(f"step {i} {step!r}: a path starts with one 'local' step and has no other")
        if kind == "local":
            ok = len(args) == 1 and args[0] in LOCALS
        elif kind == "attr":
            name = args[0] if len(args) == 1 else None
            ok = isinstance(name, str) and bool(_IDENT.match(name)) and (not name.startswith("__") or name in _DUNDERS)
        elif kind == "item":
            ok = len(args) == 1 and type(args[0]) in (int, str)
        elif kind in ("size", "stride"):
            ok = len(args) == 1 and type(args[0]) is int
        elif kind == "storage_offset":
            ok = not args
        else:
            ok = False
        if not ok:
            raise InputPathError(
                f"step {i} {step!r} is not allowed: steps are ['local', {'|'.join(LOCALS)}], ['attr', identifier "
                f"(dunders: {', '.join(sorted(_DUNDERS))})], ['item', int|str], ['size'|'stride', int], "
                "['storage_offset']"
            )


def describe(steps) -> str:
    """The path as readable text (for messages only; never evaluated)."""
    out = ""
    for kind, *a in steps:
        if kind == "local":
            out = f"L[{a[0]!r}]"
        elif kind == "attr":
            out += f".{a[0]}"
        elif kind == "item":
            out += f"[{a[0]!r}]"
        elif kind == "storage_offset":
            out += ".storage_offset()"
        else:
            out += f".{kind}()[{a[0]}]"
    return out


def _tensor_call(kind: str, dim, where: str):
    def read(x):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{where}: {kind}() of a {type(x).__name__}, not a tensor")
        return x.storage_offset() if kind == "storage_offset" else getattr(x, kind)(dim)

    return read


def _step_fn(kind: str, a: list, where: str):
    if kind == "attr":
        return operator.attrgetter(a[0])
    if kind == "item":
        return operator.itemgetter(a[0])
    return _tensor_call(kind, a[0] if a else None, where)


def reader(steps):
    """A function of the call's locals dict that follows one (validated) path."""
    read_all = readers([steps])
    return lambda local: read_all(local)[0]


def readers(paths: list):
    """A function of the call's locals dict returning every path's value, each (validated) path's prefix
    shared with the others (a weight path walks `L['fn'].__self__._modules[...]` once per call, not once
    per weight)."""
    for steps in paths:
        validate(steps)
    slots: dict[tuple, int] = {}  # path prefix -> slot of its value
    program = []  # (parent slot, step function, slot), in order: a parent is always computed first
    leaves = []
    for steps in paths:
        prefix = (steps[0][1],)
        if prefix not in slots:
            slots[prefix] = len(slots)
            program.append((None, steps[0][1], slots[prefix]))
        for k in range(1, len(steps)):
            key = prefix + (tuple(steps[k]),)
            if key not in slots:
                slots[key] = len(slots)
                program.append((slots[prefix], _step_fn(steps[k][0], steps[k][1:], describe(steps)), slots[key]))
            prefix = key
        leaves.append(slots[prefix])
    n = len(slots)

    def read(local: dict) -> list:
        values = [None] * n
        for parent, f, slot in program:
            values[slot] = local[f] if parent is None else f(values[parent])
        return [values[i] for i in leaves]

    return read


def from_call_args(steps) -> bool:
    """Whether the path starts at the caller's arguments (not at the function's own module)."""
    return steps[0] in (["local", "args"], ["local", "kwargs"])
