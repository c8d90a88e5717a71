"""How draftgraph launches its Triton kernels: `launch(kernel, grid)(*args, **constexprs)`, which is
`kernel[grid](...)`, except inside `compiling_ahead()`.

There the same call is `kernel.warmup(...)`: Triton compiles the variant these arguments select (or, under
Triton's AsyncCompileMode, queues its compile on the mode's executor) and launches nothing. Running an op on
stand-in inputs inside `compiling_ahead()` therefore names every kernel variant the op would launch, without
running any of them; compiler/pool/kernels_ahead.py compiles them side by side that way before the traced code's
first calls. Launch sites never read a launched kernel's output on the host, so an op's Python runs alike in
both modes.

`PDL_RULE` is the programmatic-dependent-launch level a kernel of a decode step launches at (ops/triton_pdl.py);
`pdl_level(device)` reads it where the device has the launch. Kernels read it as they launch (and so as a CUDA
graph captures them): a benchmark swaps the module's rule to compare levels in one process.
"""

from __future__ import annotations

import contextlib
import functools
from contextvars import ContextVar
from dataclasses import dataclass

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


PDL_LEVELS = (0, 1, 2, 3)  # ops/triton_pdl.py: 0 off, 1-3


@dataclass(frozen=True)
class PdlRule:
    """The programmatic-dependent-launch level of the kernels that take one (ops/triton_pdl.py: 0 off, 1-3) on GPUs
    that have the launch (CUDA, compute capability 9.0 and up, a Triton with griddepcontrol): the one-row GEMVs
    (ops/linear), RoPE (ops/rope), split-KV attention and its merge (ops/attention), the peer all-reduces
    (ops/collectives/push.py). Level 3 measured best on the GEMVs: 0.9-1.0 us a launch saved on an H200 over 32
    layers of the 1B and 8B shapes and the 8B's TP 2 share (`scripts/bench_gemv.py --pdl`, 2026-11-28)."""

    level: int = 3

    def __post_init__(self):
        if self.level not in PDL_LEVELS:
            raise ValueError(f"PdlRule.level={self.level!r}: 0 (off), 1, 2 or 3 (ops/triton_pdl.py)")


PDL_RULE = PdlRule()


def pdl_level(device) -> int:
    """`PDL_RULE.level` where `device` (a torch.device) has programmatic dependent launch, else 0."""
    level = PDL_RULE.level
    if not level or device.type != "cuda":
        return 0
    import torch

    return level if _has_pdl(device.index if device.index is not None else torch.cuda.current_device()) else 0


@functools.cache
def _has_pdl(index: int) -> bool:
    import torch

    from draftgraph.ops.triton_pdl import pdl_supported

    return torch.cuda.get_device_capability(index) >= (9, 0) and pdl_supported()
