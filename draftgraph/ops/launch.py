"""How draftgraph launches its Triton kernels: `launch(kernel, grid)(*args, **constexprs)`, which is
`kernel[grid](...)`, except inside `compiling_ahead()`.

There the same call is `kernel.warmup(...)`: Triton compiles the variant these arguments select (or, under
Triton's AsyncCompileMode, queues its compile on the mode's executor) and launches nothing. Running an op on
stand-in inputs inside `compiling_ahead()` therefore names every kernel variant the op would launch, without
running any of them; compiler/pool/kernels_ahead.py compiles them side by side that way before the traced code's
first calls. Launch sites never read a launched kernel's output on the host, so an op's Python runs alike in
both modes.
"""

from __future__ import annotations

import contextlib
import functools
from contextvars import ContextVar

_AHEAD: ContextVar[bool] = ContextVar("draftgraph_compiling_ahead", default=False)


def launch(kernel, grid):
    """`kernel[grid]`, or inside `compiling_ahead()` a compile of the variant without a launch."""
    if _AHEAD.get():
        return functools.partial(kernel.warmup, grid=grid)
    return kernel[grid]


@contextlib.contextmanager
def compiling_ahead():
    """Within this block (this thread or task only), `launch` compiles and launches nothing."""
    token = _AHEAD.set(True)
    try:
        yield
    finally:
        _AHEAD.reset(token)


def ahead_now() -> bool:
    """Whether this thread is inside `compiling_ahead()` (an op that would launch one variant of many, chosen by
    a size the trace leaves symbolic, compiles them all there)."""
    return _AHEAD.get()
