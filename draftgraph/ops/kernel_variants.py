"""How many compiled variants of draftgraph's own Triton kernels this process holds.

Triton compiles a kernel again for every new set of constexpr values and of integer specialisations (an
int argument equal to 1, or divisible by 16, is a different kernel). A launcher that derives a constexpr or
a specialised int from the batch size compiles once per captured size: on the 1B pair that was hundreds of
compiles, a minute of capture (docs/history/benchmarks-2026-11.md, 2026-11-23). Launchers therefore derive their
constexprs from model sizes only and mark batch-dependent ints `do_not_specialize`; `compiled_variants()` is how
scripts and the engine's stats check that it stays so.
"""

from __future__ import annotations

import sys


def jit_functions() -> dict[str, object]:
    """Every Triton JIT function defined in a loaded draftgraph module, by its qualified name (kernels and
    device functions alike; device functions never hold compiled variants). Triton is never imported here."""
    jit = sys.modules.get("triton.runtime.jit")
    if jit is None:
        return {}
    found = {}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "draftgraph" or name.startswith("draftgraph.")):
            continue
        for value in list(vars(module).values()):
            fn = value
            while fn is not None and not isinstance(fn, jit.JITFunction):
                fn = getattr(fn, "fn", None)  # autotuners and heuristics wrap the JIT function
            if fn is not None and getattr(fn, "__module__", "") == name:
                found[f"{name}.{fn.__name__}"] = fn
    return found


def compiled_variants() -> dict[str, int]:
    """{kernel: compiled variants held by this process} for draftgraph's kernels that compiled at least once."""
    out = {}
    for name, fn in sorted(jit_functions().items()):
        caches = getattr(fn, "device_caches", None) or {}
        n = sum(len(entry[0]) for entry in caches.values())  # (kernel cache, key cache, target, backend, binder)
        if n:
            out[name] = n
    return out
