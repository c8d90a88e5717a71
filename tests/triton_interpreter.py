"""A faster Triton interpreter for the CPU suite (conftest.py applies it when TRITON_INTERPRET=1).

Triton's interpreter re-patches `triton.language` (inspect.getmembers over tl, tl.tensor, tl.math, ...) at every
call of a `@triton.jit` helper from inside a kernel (`InterpretedFunction.__call__`), although the launch
(`GridExecutor.__call__`) already patched the same modules for its whole grid: about a third of an interpreted
kernel's time (the race kernel at 8 x 160: 16.1 s -> 10.6 s for two launches, 2026-11-27, a loaded 2-core
machine). Here a helper called inside a launch whose kernel patched every language module the helper sees runs
without patching again; any other call goes through Triton's own code. The values are Triton's: only repeated
patching is skipped. Where this Triton lacks the names patched here, nothing is changed (the suite is only
slower)."""

from __future__ import annotations

import threading
import types

_state = threading.local()


def _language_modules(fn) -> frozenset[int]:
    import triton.language as tl

    return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)


def install() -> bool:
    """Patch Triton's interpreter; False (and nothing changed) where its internals are not the expected ones."""
    import triton.runtime.interpreter as ti

    grid_cls, fn_cls = getattr(ti, "GridExecutor", None), getattr(ti, "InterpretedFunction", None)
    if grid_cls is None or fn_cls is None or not hasattr(ti, "_patch_lang") or not hasattr(fn_cls, "rewrite"):
        return False
    if getattr(grid_cls.__call__, "_draftgraph_tests", False):
        return True
    grid_call, fn_call = grid_cls.__call__, fn_cls.__call__

    import triton.language as tl

    # Triton's own helpers (tl.max, tl.sum, tl.zeros, tl.cumsum: triton/language/standard.py) see
    # triton.language.core, not triton.language: a kernel's launch patches only the latter, so each of their calls
    # patched core again (thousands per launch of a reduction kernel). The launch patches core too, once, and
    # undoes it when it ends (Triton's helper calls never undo theirs).
    core_only = types.FunctionType((lambda: None).__code__, {"core": tl.core})

    def launch(self, *args, **kwargs):
        outer = getattr(_state, "patched", None)
        covered = _language_modules(self.fn)  # what the launch's own patch covers (ti._patch_lang)
        scope = None
        if outer is None and id(tl.core) not in covered:
            scope = ti._patch_lang(core_only)
            if hasattr(scope, "restore"):
                covered |= {id(tl.core)}
        _state.patched = covered
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            _state.patched = outer
            if hasattr(scope, "restore"):
                scope.restore()  # after the launch's own restore: core's originals come back last

    def helper(self, *args, **kwargs):
        patched = getattr(_state, "patched", None)
        if patched is None or not _language_modules(self.fn) <= patched:
            return fn_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # as Triton's own call reports it
            raise ti.InterpreterError(repr(e)) from e

    launch._draftgraph_tests = True
    grid_cls.__call__, fn_cls.__call__ = launch, helper
    return True
