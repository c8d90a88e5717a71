"""A compute piece's example inputs as plain data, and fake inputs rebuilt from it in another process.

A piece is compiled from the fake tensors Dynamo traced it with: their sizes and strides are expressions in
the trace's size symbols (the unbacked token count `u0`, the request count, a backed KV block count `s3`).
A compile worker (compiler/pool/compile_pool.py) has no Dynamo trace, so the inputs travel as data: each tensor's
dtype, device, sizes, strides and storage offset (expressions written as text), each SymInt input's
expression, each plain value as is, and every symbol they mention with its kind (unbacked or backed with its
hint) and its value range. `rebuild_inputs` makes a fresh ShapeEnv with one symbol per stored symbol and
fake tensors of the same shapes, which is what Inductor compiles from.

An input of another kind (an opaque object) cannot travel: `encode_inputs` raises NotPortable and the piece
is compiled in the tracing process instead.
"""

from __future__ import annotations

import torch


class NotPortable(TypeError):
    """A piece input that cannot be written as data (the piece compiles in-process)."""


def _expr(d) -> str:
    return str(d.node.expr) if isinstance(d, torch.SymInt) else str(int(d))


def _bound(b) -> int | None:
    """A range end as an int, None when infinite (torch's int_oo, sympy's oo)."""
    try:
        return int(b) if b.is_integer and b.is_finite is not False and b.is_number else None
    except (TypeError, AttributeError, ValueError):
        return None


def symbol_hint(env, s) -> int | None:
    """A symbol's example value in its ShapeEnv (None when it has none: unbacked), across torch versions."""
    hints = getattr(env, "backed_var_to_val", None)
    hint = (hints if hints is not None else env.var_to_val).get(s)
    return None if hint is None else int(hint)


def symbol_range(env, s) -> tuple[int | None, int | None]:
    """A symbol's value range (min, max), each None when unbounded or unknown."""
    vr = env.var_to_range.get(s)
    return (None, None) if vr is None else (_bound(vr.lower), _bound(vr.upper))


def encode_inputs(fakes: list) -> dict:
    """The inputs of one piece as JSON-ready data (see the module docstring)."""
    inputs, free, env = [], set(), None

    def note(d):
        nonlocal env
        if isinstance(d, torch.SymInt):
            free.update(d.node.expr.free_symbols)
            env = env or d.node.shape_env

    for v in fakes:
        if isinstance(v, torch.SymInt):
            note(v)
            inputs.append({"kind": "sym", "expr": _expr(v)})
        elif isinstance(v, torch.Tensor):
            if v.layout != torch.strided or type(v).__name__ not in ("FakeTensor", "Tensor", "Parameter"):
                raise NotPortable(f"a {type(v).__name__} input of layout {v.layout}")
            for d in (*v.shape, *v.stride(), v.storage_offset()):
                note(d)
            inputs.append(
                {
                    "kind": "tensor",
                    "dtype": str(v.dtype).removeprefix("torch."),
                    "device": str(v.device),
                    "shape": [_expr(d) for d in v.shape],
                    "stride": [_expr(d) for d in v.stride()],
                    "offset": _expr(v.storage_offset()),
                    "requires_grad": bool(v.requires_grad),
                }
            )
        elif v is None or isinstance(v, (bool, int, float)):
            inputs.append({"kind": "value", "value": v})
        else:
            raise NotPortable(f"an input of type {type(v).__name__}")
    symbols = []
    for s in sorted(free, key=str):
        hint = symbol_hint(env, s)
        lo, hi = symbol_range(env, s)
        symbols.append({"name": str(s), "unbacked": hint is None, "hint": hint, "min": lo, "max": hi})
    return {"inputs": inputs, "symbols": symbols}


def _sympy_names() -> dict:
    """What a stored expression may name besides its symbols: torch's size functions (FloorDiv, Mod, ...)."""
    import sympy
    import torch.utils._sympy.functions as fns

    names = {n: getattr(fns, n) for n in dir(fns) if isinstance(getattr(fns, n), type)}
    names.update(Max=sympy.Max, Min=sympy.Min)
    return names


def rebuild_inputs(data: dict):
    """(fake mode, fake inputs) with the stored shapes over fresh symbols of the stored kinds and ranges."""
    import sympy  # here: a quarter second to import, never needed by an engine of mode NONE
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv
    from torch.utils._sympy.numbers import int_oo

    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    names, hints = _sympy_names(), {}
    for s in data["symbols"]:
        if s["unbacked"]:  # an input's size, not a value the graph computes: nothing binds it later
            with env.ignore_fresh_unbacked_symbols():
                sym = env.create_unbacked_symint().node.expr
        else:
            sym = env.create_symbol(s["hint"], ConstantSource(s["name"]), dynamic_dim=DimDynamic.DYNAMIC)
            hints[sym] = s["hint"]
        lo = -int_oo if s["min"] is None else s["min"]
        hi = int_oo if s["max"] is None else s["max"]
        env.constrain_symbol_range(sym, compiler_min=lo, compiler_max=hi)
        names[s["name"]] = sym

    def size(text: str):
        expr = sympy.sympify(text, locals=names)
        if expr.is_number:
            return int(expr)
        hint = None if expr.free_symbols - set(hints) else int(expr.xreplace(hints))
        return env.create_symintnode(expr, hint=hint)

    fakes = []
    with mode:
        for x in data["inputs"]:
            if x["kind"] == "value":
                fakes.append(x["value"])
            elif x["kind"] == "sym":
                fakes.append(size(x["expr"]))
            else:
                shape, stride = [size(d) for d in x["shape"]], [size(d) for d in x["stride"]]
                dtype, device = getattr(torch, x["dtype"]), torch.device(x["device"])
                offset = size(x["offset"])
                if isinstance(offset, int) and offset == 0:
                    t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
                else:  # a view into a larger buffer (e.g. RoPE's cos/sin slices): keep the offset
                    extent = offset + 1 + sum((n - 1) * st for n, st in zip(shape, stride))
                    t = torch.empty(extent, dtype=dtype, device=device).as_strided(shape, stride, offset)
                fakes.append(t.requires_grad_(x["requires_grad"]) if dtype.is_floating_point else t)
    return mode, fakes
