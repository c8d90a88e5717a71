"""Programmatic dependent launch (PDL, Hopper's griddepcontrol) for draftgraph's Triton kernels: the jit helpers a
kernel calls and the launch arguments that turn it on.

A kernel launched with `launch_pdl` may start while the kernel before it in the stream is still running; it must
wait (`griddepcontrol.wait`) before it reads anything that kernel (or any before it) wrote, and it lets the kernel
after it start early (`griddepcontrol.launch_dependents`). Every kernel takes one level, `PDL` (ops/launch.py
`PdlRule`: 3 on compute capability 9.0 and up):
- 0: an ordinary launch (no griddepcontrol);
- 1: wait at the start, release the next kernel after the last load;
- 2: as 1, but a kernel with weights (the one-row GEMVs) loads its first chunk of weight, which no kernel writes,
  before the wait, so that load overlaps the kernel before's end;
- 3: as 2, and the next kernel is released at the start.
A kernel without weights calls `pdl_start` (the prologue and the wait at once) and `pdl_release` after its last
load: at level 3 the next one-row GEMV then loads its first chunk of weight while this kernel runs. Whatever a
kernel does before its wait touches no memory another kernel writes (the GEMVs' weights only), so a chain of
early starts is safe: a kernel's wait returns only once the kernel before ended, which waited for its own.
"""

from __future__ import annotations

import triton
import triton.language as tl

from draftgraph.ops.backends import triton_interpreting
from draftgraph.ops.launch import PDL_LEVELS

try:  # Triton 3.4 and later
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - an older Triton: PDL stays off
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """A kernel's first statement under PDL: level 3 releases the next kernel here; level 1 waits here (2 and 3
    wait in `pdl_wait`, after a first chunk of weight)."""
    if PDL == 3:
        gdc_launch_dependents()
    if PDL == 1:
        gdc_wait()


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """The wait of levels 2 and 3, after the loads of what no kernel writes."""
    if PDL >= 2:
        gdc_wait()


@triton.jit
def pdl_start(PDL: tl.constexpr):
    """A kernel without weights: `pdl_prologue` and `pdl_wait` at once (any level waits before the first load)."""
    pdl_prologue(PDL)
    pdl_wait(PDL)


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Levels 1 and 2 release the next kernel here, after a program's last load (3 released at the start); the next
    kernel still waits in its own prologue for this one's end."""
    if PDL == 1 or PDL == 2:
        gdc_launch_dependents()


def pdl_supported() -> bool:
    """Whether this Triton launches with PDL (griddepcontrol; not under the interpreter)."""
    return gdc_wait is not None and not triton_interpreting()


def pdl_args(pdl: int) -> dict:
    """A kernel's launch arguments at PDL level `pdl` (0: an ordinary launch)."""
    if pdl not in PDL_LEVELS:
        raise ValueError(f"pdl={pdl!r}: 0 (off), 1, 2 or 3 (ops/triton_pdl.py)")
    if not pdl:
        return {"PDL": 0}
    if not pdl_supported():
        raise ValueError(f"pdl={pdl}: programmatic dependent launch needs a CUDA GPU and Triton 3.4 or later")
    return {"PDL": int(pdl), "launch_pdl": True}
