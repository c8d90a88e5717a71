"""FX graph modules to JSON and back, node by node (no re-tracing on load).

Pickling a GraphModule stores its Python code and re-traces it on load with symbolic tracing, which fails
on Dynamo graphs (in-place `setitem` on a proxy, symbolic sizes). Here each node is stored as its op,
name, target and arguments; functions are stored by import path and checked to resolve to the same object
before anything is written. A split graph is stored with its submodules (the pieces) recursively.
"""

from __future__ import annotations

import importlib

import torch
from torch import fx


def encode_target(fn) -> str:
    if isinstance(fn, torch._ops.OpOverload):
        return "op:" + fn.name() + ("" if "." in fn.name().split("::")[1] else ".default")
    if isinstance(fn, torch._ops.OpOverloadPacket):
        return "packet:" + fn._qualified_op_name
    module, name = getattr(fn, "__module__", None), getattr(fn, "__name__", None)
    if not module or not name:
        raise TypeError(f"cannot store call target {fn!r}: it has no import path")
    key = f"py:{module}:{name}"
    if decode_target(key) is not fn:
        raise TypeError(f"cannot store call target {fn!r}: {module}.{name} resolves to something else")
    return key


def decode_target(key: str):
    kind, _, rest = key.partition(":")
    if kind == "op":
        ns, _, name = rest.partition("::")
        op, _, overload = name.partition(".")
        return getattr(getattr(getattr(torch.ops, ns), op), overload)
    if kind == "packet":
        ns, _, op = rest.partition("::")
        return getattr(getattr(torch.ops, ns), op)
    if kind == "py":
        module, _, name = rest.partition(":")
        parts = module.split(".")
        obj = importlib.import_module(parts[0])
        for p in parts[1:] + [name]:
            obj = getattr(obj, p)
        return obj
    raise ValueError(f"unknown call target {key!r}")


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
        return a
    if "n" in a:
        return nodes[a["n"]]
    if "t" in a:
        return tuple(_dec(x, nodes) for x in a["t"])
    if "l" in a:
        return [_dec(x, nodes) for x in a["l"]]
    if "d" in a:
        return {k: _dec(v, nodes) for k, v in a["d"]}
    if "slice" in a:
        return slice(*(_dec(x, nodes) for x in a["slice"]))
    if "ellipsis" in a:
        return Ellipsis
    if "dtype" in a:
        return getattr(torch, a["dtype"])
    if "device" in a:
        return torch.device(a["device"])
    if "torch" in a:
        return getattr(torch, a["torch"])
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
    root = torch.nn.Module()
    for name, sub in data["submodules"].items():
        root.add_module(name, decode_module(sub))
    graph = fx.Graph()
    nodes: dict[str, fx.Node] = {}
    for d in data["nodes"]:
        args, kwargs = _dec(d["args"], nodes), _dec(d["kwargs"], nodes)
        op, target = d["op"], d["target"]
        if op == "call_function":
            target = decode_target(target)
        elif op not in ("placeholder", "output", "call_method", "call_module"):
            raise ValueError(f"unsupported stored node op {op!r}")
        nodes[d["name"]] = graph.create_node(op, target, args, kwargs, name=d["name"])
    return fx.GraphModule(root, graph)
