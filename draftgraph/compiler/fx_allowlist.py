"""The call targets a stored FX graph may name: the only functions and methods an artifact's graphs can call.

A stored graph names each `call_function` target by a key (fx_serialize.py). Resolving a key never imports
anything: it looks the name up in the modules below, and the object found must be on the list:
- `torch.ops` operators (`op:` / `packet:` keys) of the namespaces in `OP_NAMESPACES` (draftgraph's own
  ops among them);
- `operator`'s arithmetic, comparison, logical and item functions (`OPERATOR_NAMES`), `math`'s functions,
  and a few builtins (`BUILTIN_NAMES`; `getattr` only with a plain public attribute name);
- torch's tensor functions: those `torch.overrides` lists as overridable (the math Dynamo puts in graphs),
  plus the factories and checks in `TORCH_EXTRA`.
A `call_method` target must be a public tensor method (or an arithmetic dunder), minus `METHOD_DENY`.
Everything else is refused with an error naming the target.
"""

from __future__ import annotations

import builtins
import functools
import math
import operator
import re

import torch

OP_NAMESPACES = frozenset({"aten", "prims", "draftgraph", "_c10d_functional", "c10d_functional"})
# fmt: off
OPERATOR_NAMES = frozenset({
    "abs", "add", "and_", "contains", "eq", "floordiv", "ge", "getitem", "gt", "iadd", "iand", "ifloordiv",
    "ilshift", "imatmul", "imod", "imul", "index", "inv", "invert", "ior", "ipow", "irshift", "is_", "is_not",
    "isub", "itruediv", "ixor", "le", "lshift", "lt", "matmul", "mod", "mul", "ne", "neg", "not_", "or_", "pos",
    "pow", "rshift", "setitem", "sub", "truediv", "truth", "xor",
})
BUILTIN_NAMES = frozenset({
    "abs", "bool", "float", "getattr", "int", "len", "max", "min", "pow", "round", "slice", "sum", "tuple", "list",
    "range",
})
TORCH_EXTRA = frozenset({
    "arange", "empty", "empty_strided", "full", "ones", "zeros", "tensor", "scalar_tensor", "_assert", "_check",
    "_check_is_size", "sym_float", "sym_int", "sym_ite", "sym_max", "sym_min", "sym_not", "sym_sum", "Size",
})
# Tensor methods that reach storage, hooks, autograd, other processes or Python objects.
METHOD_DENY = frozenset({
    "apply_", "backward", "map_", "map2_", "numpy", "pin_memory", "record_stream", "register_hook",
    "register_post_accumulate_grad_hook", "share_memory_", "storage", "untyped_storage", "__array__",
    "__array_wrap__", "__deepcopy__", "__dlpack__", "__reduce_ex__", "__setstate__", "__format__",
})
# fmt: on
_MODULES = {
    "_operator": operator,
    "operator": operator,
    "math": math,
    "builtins": builtins,
    "torch": torch,
    "torch.functional": torch.functional,
    "torch.nn.functional": torch.nn.functional,
    "torch._C._nn": torch._C._nn,
    "torch._C._VariableFunctions": torch._C._VariableFunctions,
    "torch._C._linalg": torch._C._linalg,
    "torch._C._special": torch._C._special,
    "torch._C._fft": torch._C._fft,
    "torch.linalg": torch.linalg,
    "torch.special": torch.special,
    "torch.fft": torch.fft,
}
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class TargetNotAllowed(ValueError):
    """A call target outside the allowlist (the message names it)."""


@functools.cache
def _torch_functions() -> frozenset[int]:
    from torch.overrides import get_overridable_functions

    ids = {id(f) for key, fns in get_overridable_functions().items() if key is not torch.Tensor for f in fns}
    ids.update(id(getattr(torch, n)) for n in TORCH_EXTRA if hasattr(torch, n))
    return frozenset(ids)


@functools.cache
def _tensor_methods() -> frozenset[str]:
    from torch.overrides import get_overridable_functions

    names = {getattr(f, "__name__", None) for f in get_overridable_functions()[torch.Tensor]}
    names.update(n for n in dir(torch.Tensor) if n.startswith("new_"))
    return frozenset(n for n in names if isinstance(n, str) and _IDENT.match(n) and n not in METHOD_DENY)


def _refuse(key: str, why: str):
    raise TargetNotAllowed(
        f"call target {key!r} is not allowed in a stored graph ({why}); artifacts may call torch.ops of "
        f"{sorted(OP_NAMESPACES)}, operator, math, a few builtins and torch's tensor functions "
        "(draftgraph/compiler/fx_allowlist.py)"
    )


def resolve_op(key: str, ns: str, op: str, overload: str | None):
    """torch.ops.NS.OP(.OVERLOAD), for an allowed namespace and plain names only."""
    names = [ns, op] + ([overload] if overload is not None else [])
    if not all(isinstance(n, str) and _IDENT.match(n) and not n.startswith("__") for n in names):
        _refuse(key, "not a plain operator name")
    if ns not in OP_NAMESPACES:
        _refuse(key, f"namespace {ns!r} is not on the list")
    try:
        packet = getattr(getattr(torch.ops, ns), op)
        target = packet if overload is None else getattr(packet, overload)
    except (AttributeError, RuntimeError) as e:
        raise TargetNotAllowed(f"call target {key!r} names no registered operator ({e})") from e
    wanted = torch._ops.OpOverloadPacket if overload is None else torch._ops.OpOverload
    if not isinstance(target, wanted):
        _refuse(key, f"it resolves to a {type(target).__name__}")
    return target


def resolve_function(key: str, module: str, name: str):
    """MODULE.NAME, when MODULE is one of `_MODULES` and the object found is on the list."""
    mod = _MODULES.get(module)
    if mod is None:
        _refuse(key, f"module {module!r} is not on the list")
    if not isinstance(name, str) or not _IDENT.match(name) or name.startswith("__"):
        _refuse(key, "not a plain function name")
    obj = getattr(mod, name, None)
    if obj is None:
        _refuse(key, f"{module} has no {name}")
    if mod is operator:
        ok = name in OPERATOR_NAMES
    elif mod is math:
        ok = not name.startswith("_") and callable(obj)
    elif mod is builtins:
        ok = name in BUILTIN_NAMES
    else:
        ok = id(obj) in _torch_functions()
    if not ok:
        _refuse(key, "not a tensor, arithmetic or math function")
    return obj


def check_method(name) -> str:
    """A call_method target: a tensor method on the list."""
    if not isinstance(name, str) or name not in _tensor_methods():
        _refuse(repr(name) if not isinstance(name, str) else "method:" + name, "not an allowed tensor method")
    return name


def check_getattr_args(args) -> None:
    """builtins.getattr(x, NAME) only for a plain public attribute name."""
    if len(args) < 2 or not isinstance(args[1], str) or not _IDENT.match(args[1]) or args[1].startswith("_"):
        raise TargetNotAllowed(f"getattr with attribute {args[1:2]!r} is not allowed in a stored graph")
