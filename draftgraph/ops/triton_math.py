"""Triton math as torch's CUDA kernels compute it: libdevice's expf / logf / rsqrtf when `ACCURATE` (on CUDA), so
a kernel's values match the torch ops it replaces to the bit; Triton's own functions under the interpreter, which
has no libdevice (`ACCURATE=not ops.backends.triton_interpreting()` at the launch)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def exp(x, ACCURATE: tl.constexpr):
    if ACCURATE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def log(x, ACCURATE: tl.constexpr):
    if ACCURATE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def rsqrt(x, ACCURATE: tl.constexpr):
    if ACCURATE:
        return libdevice.rsqrt(x)
    else:
        return 1.0 / tl.sqrt(x)
