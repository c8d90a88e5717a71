"""How draftgraph defines its custom ops: `@custom_op("draftgraph::name", mutates_args=...)`, straight into the
dispatcher.

`torch.library.custom_op` wraps every call of an op in Python layers (an autograd function, an ADInplaceOrView
kernel that fills defaults and bumps version counters), paid by every eager call and by every op a piecewise
runtime runs between its pieces (attention in each layer of each forward): an attention-shaped op cost 22 us a
call against 7.6 us here on the H100 machine's host, 67 against 7 on a slower CPU (scripts/bench_op_dispatch.py),
and the 1B-shaped pair's PIECEWISE draft steps ran 43 % faster at batch 1 (docs/history/benchmarks-2026-11.md,
2026-11-26). draftgraph only runs inference, so here an op is its schema (inferred from the function's annotations, as
custom_op infers it), one Python kernel registered with `torch.library.Library.impl` (for every device, as
custom_op's default, or for the device types named) and a fake: a call is the C++ dispatcher and one Python
call. Traced graphs name `torch.ops.draftgraph.<name>` exactly as before (the same schema: mutated arguments
`Tensor(a!)`, so Dynamo and Inductor functionalize them alike). No autograd: gradients never flow through
these ops.

Registering is the defining module's one import-time action (once per process, before any graph naming the
op is traced or loaded). `DEFINED_IN` records which module defines each op, for compile workers that
must import exactly those (compiler/pool/compile_pool.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

DEVICE_KEYS = {"cpu": "CPU", "cuda": "CUDA"}
DEFINED_IN: dict[str, str] = {}  # "namespace::name" -> the module that defines it
_libs: dict[str, torch.library.Library] = {}  # kept alive: a Library's registrations end with it


def _library(namespace: str) -> torch.library.Library:
    if namespace not in _libs:
        _libs[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return _libs[namespace]


class CustomOp:
    """A defined op: call it like the function it was defined from; `register_fake` as custom_op's."""

    def __init__(self, qualname: str, fn: Callable, mutates_args: Iterable[str], device_types: Iterable[str] | None):
        namespace, sep, name = qualname.partition("::")
        if not sep or not namespace or not name:
            raise ValueError(f"op {qualname!r}: name it 'namespace::name', e.g. 'draftgraph::paged_attention'")
        unknown = sorted(set(device_types or ()) - set(DEVICE_KEYS))
        if unknown:
            raise ValueError(f"op {qualname!r}: device_types {unknown} unknown; allowed: {sorted(DEVICE_KEYS)}")
        self.qualname, self.__doc__ = qualname, fn.__doc__
        lib = _library(namespace)
        schema = torch.library.infer_schema(fn, mutates_args=tuple(mutates_args))
        lib.define(name + schema)
        # Every device (and calls with no tensor, e.g. an empty list) as custom_op registers it, or those named.
        keys = [DEVICE_KEYS[d] for d in device_types] if device_types is not None else ["CompositeExplicitAutograd"]
        for key in keys:
            lib.impl(name, fn, key)
        self._lib = lib
        self._op = getattr(getattr(torch.ops, namespace), name).default
        DEFINED_IN[qualname] = fn.__module__

    def register_fake(self, fake: Callable) -> Callable:
        """`fake` computes the outputs' metadata from fake inputs (tracing, compiling); returns `fake`."""
        torch.library.register_fake(self.qualname, fake, lib=self._lib)
        return fake

    def __call__(self, *args, **kwargs):
        return self._op(*args, **kwargs)


def custom_op(qualname: str, mutates_args: Iterable[str] = (), device_types: str | Iterable[str] | None = None):
    """Decorator: define op `qualname` ("draftgraph::name") from the decorated function (its annotations give
    the schema, as torch.library.custom_op's do; the names in `mutates_args` are written in place) with the
    function as its kernel on every device, or on `device_types` ("cpu", "cuda"). Returns a `CustomOp`."""
    if isinstance(mutates_args, str):
        raise TypeError(f"mutates_args={mutates_args!r}: a tuple of argument names, e.g. ('k_cache', 'v_cache')")
    if isinstance(device_types, str):
        device_types = (device_types,)

    def define(fn: Callable) -> CustomOp:
        return CustomOp(qualname, fn, mutates_args, device_types)

    return define
