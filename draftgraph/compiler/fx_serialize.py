"""FX graph modules to JSON and back, node by node (no re-tracing on load).

Pickling a GraphModule stores its Python code and re-traces it on load with symbolic tracing, which fails
on Dynamo graphs (in-place `setitem` on a proxy, symbolic sizes). Here each node is stored as its op,
name, target and arguments; functions are stored by module and name and checked to resolve to the same
object before anything is written. A split graph is stored with its submodules (the pieces) recursively.

Reading never imports a module a file names: call targets resolve only within fx_allowlist.py's list,
method names must be allowed tensor methods, and a stored value (a dtype, a node reference) that is not
what its tag says is refused. Errors are ValueError (fx_allowlist.TargetNotAllowed for a target).
"""

from __future__ import annotations

import builtins

import torch
from torch import fx

from draftgraph.compiler import fx_allowlist


def encode_target(fn) -> str:
    if isinstance(fn, torch._ops.OpOverload):
        return "op:" + fn.name() + ("" if "." in fn.name().split("::")[1] else ".default")
    if isinstance(fn, torch._ops.OpOverloadPacket):
        return "packet:" + fn._qualified_op_name
    module, name = getattr(fn, "__module__", None), getattr(fn, "__name__", None)
    if not module or not name:
        raise TypeError(f"cannot store call target {fn!r}: it has no import path")
    key = f"py:{module}:{name}"
    try:
        found = decode_target(key)
    except fx_allowlist.TargetNotAllowed as e:
        raise TypeError(f"cannot store call target {fn!r}: {e}") from e
    if found is not fn:
        raise TypeError(f"cannot store call target {fn!r}: {module}.{name} resolves to something else")
    return key


def decode_target(key: str):
    """The function a stored key names, from the allowlist only (TargetNotAllowed otherwise)."""
    if not isinstance(key, str):
        raise fx_allowlist.TargetNotAllowed(f"call target {key!r} is not a string")
    kind, _, rest = key.partition(":")
    if kind in ("op", "packet"):
        ns, _, name = rest.partition("::")
        if kind == "packet":
            return fx_allowlist.resolve_op(key, ns, name, None)
        op, _, overload = name.partition(".")
        return fx_allowlist.resolve_op(key, ns, op, overload)
    if kind == "py":
        module, _, name = rest.partition(":")
        return fx_allowlist.resolve_function(key, module, name)
    raise fx_allowlist.TargetNotAllowed(f"call target {key!r} has an unknown kind {kind!r} (op, packet or py)")


def _enc(a):
    if isinstance(a, fx.Node):
        return {"n": a.name}
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    if isinstance(a, tuple):
        return {"t": [_enc(x) for x in a]}
    if isinstance(a, list):
        return {"l": [_enc(x) for x in a]}
    if isinstance(a, dict):
        return {"d": [[k, _enc(v)] for k, v in a.items()]}
    if isinstance(a, slice):
        return {"slice": [_enc(a.start), _enc(a.stop), _enc(a.step)]}
    if a is Ellipsis:
        return {"ellipsis": True}
    if isinstance(a, torch.dtype):
        return {"dtype": str(a).removeprefix("torch.")}
    if isinstance(a, torch.device):
        return {"device": str(a)}
    if isinstance(a, (torch.memory_format, torch.layout)):
        return {"torch": str(a).removeprefix("torch.")}
    raise TypeError(f"cannot store graph argument {a!r} of type {type(a).__name__}")


def _dec(a, nodes: dict):
    if not isinstance(a, dict):
        if a is None or isinstance(a, (bool, int, float, str)):
            return a
        raise ValueError(f"stored argument {a!r} is not a value a graph holds")
    if len(a) != 1:
        raise ValueError(f"stored argument {a!r} has more than one tag")
    ((tag, v),) = a.items()
    if tag == "n":
        if v not in nodes:
            raise ValueError(f"stored argument refers to node {v!r}, which is not defined before it")
        return nodes[v]
    if tag in ("t", "l", "slice") and isinstance(v, list):
        items = [_dec(x, nodes) for x in v]
        return tuple(items) if tag == "t" else items if tag == "l" else slice(*items)
    if tag == "d" and isinstance(v, list) and all(isinstance(kv, list) and len(kv) == 2 for kv in v):
        return {k: _dec(x, nodes) for k, x in v}
    if tag == "ellipsis":
        return Ellipsis
    if tag in ("dtype", "torch") and isinstance(v, str):
        value = getattr(torch, v, None)
        kinds = (torch.dtype,) if tag == "dtype" else (torch.memory_format, torch.layout)
        if isinstance(value, kinds):
            return value
    if tag == "device" and isinstance(v, str):
        return torch.device(v)
    raise ValueError(f"unknown stored argument {a!r}")


def encode_module(gm: fx.GraphModule) -> dict:
    nodes = []
    for n in gm.graph.nodes:
        target = encode_target(n.target) if n.op == "call_function" else n.target
        nodes.append({"op": n.op, "name": n.name, "target": target, "args": _enc(n.args), "kwargs": _enc(n.kwargs)})
    subs = {}
    for name, child in gm.named_children():
        if not isinstance(child, fx.GraphModule):
            raise TypeError(f"cannot store submodule {name} of type {type(child).__name__}")
        subs[name] = encode_module(child)
    if any(n.op == "get_attr" for n in gm.graph.nodes):
        raise TypeError("cannot store a graph that reads attributes (get_attr); its tensors would be lost")
    return {"nodes": nodes, "submodules": subs}


def decode_module(data: dict) -> fx.GraphModule:
    """A GraphModule from stored JSON. Every name that FX writes into the code it generates (node names,
    placeholder and method names, keyword names, submodules) is checked to be a plain identifier first."""
    root = torch.nn.Module()
    for name, sub in data["submodules"].items():
        if not _plain(name) or hasattr(root, name):
            raise ValueError(f"stored submodule name {name!r} is not a plain identifier")
        root.add_module(name, decode_module(sub))
    graph = fx.Graph()
    nodes: dict[str, fx.Node] = {}
    for d in data["nodes"]:
        args, kwargs = _dec(d["args"], nodes), _dec(d["kwargs"], nodes)
        op, target, name = d["op"], d["target"], d["name"]
        if not _plain(name) or name in nodes:
            raise ValueError(f"stored node name {name!r} is not a new plain identifier")
        if not isinstance(kwargs, dict) or not all(_plain(k) for k in kwargs):
            raise ValueError(f"stored node {name}: keyword names {list(kwargs)!r} are not plain identifiers")
        if op == "call_function":
            target = decode_target(target)
            if target is builtins.getattr:
                fx_allowlist.check_getattr_args(args)
        elif op == "call_method":
            fx_allowlist.check_method(target)
        elif op == "call_module":
            if target not in data["submodules"]:
                raise ValueError(f"stored node {name} calls submodule {target!r}, which the file does not hold")
        elif op == "placeholder":
            if not _plain(target):
                raise ValueError(f"stored placeholder {name}: argument name {target!r} is not a plain identifier")
        elif op != "output":
            raise ValueError(f"unsupported stored node op {op!r}")
        nodes[name] = graph.create_node(op, target, args, kwargs, name=name)
    return fx.GraphModule(root, graph)


def _plain(name) -> bool:
    return isinstance(name, str) and name.isidentifier() and not name.startswith("__")
