"""RMSNorm in one Triton kernel: a program per row, the row in registers (hidden sizes up to 16k).

Inductor compiles a decoder layer's norms as a reduction kernel then a pointwise kernel each, and the residual add
as a third (docs/history/benchmarks-2026-11.md, 2026-11-26: five 1.0-1.4 us kernels per layer at batch 1, the
step's GEMMs being the rest). Here the add (optional), the sum of squares and the scaled product are one launch,
with the values torch's eager code gives: the sum rounded to the input dtype before the norm reads it, the norm
in float32, the normalised row rounded to the input dtype, then multiplied by the weight and rounded again.

Rows are the input's leading dims: [N, H] or [T, heads, H] (q/k norms over a strided view of the QKV output).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftgraph.ops import triton_math
from draftgraph.ops.backends import triton_interpreting
from draftgraph.ops.launch import launch


@triton.jit
def _rms_norm_kernel(x, res, w, sum_out, y_out, sx0, sx1, sr0, sr1, n1, H, eps, HAS_RES: tl.constexpr,
                     BLOCK: tl.constexpr, ACCURATE: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    a, b = row // n1, row % n1  # the row's two leading indices ([N, H] inputs: n1 = 1)
    cols = tl.arange(0, BLOCK)
    m = cols < H
    xv = tl.load(x + a * sx0 + b * sx1 + cols, mask=m, other=0.0)
    if HAS_RES:
        rv = tl.load(res + a * sr0 + b * sr1 + cols, mask=m, other=0.0)
        xv = (xv.to(tl.float32) + rv.to(tl.float32)).to(xv.dtype)  # the residual stream, in its own dtype
        tl.store(sum_out + row * H + cols, xv, mask=m)
    xf = xv.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    y = (xf * triton_math.rsqrt(var + eps, ACCURATE)).to(xv.dtype)
    wv = tl.load(w + cols, mask=m, other=0.0)
    tl.store(y_out + row * H + cols, (wv.to(tl.float32) * y.to(tl.float32)).to(xv.dtype), mask=m)


def _rows(t: torch.Tensor) -> tuple[int, int, int]:
    """(stride of dim 0, stride of dim 1, size of dim 1) addressing t's rows; the last dim must be contiguous."""
    if t.dim() == 2:
        return t.stride(0), 0, 1
    if t.dim() == 3:
        return t.stride(0), t.stride(1), t.shape[1]
    raise ValueError(f"rms_norm takes [N, H] or [T, heads, H]; got shape {tuple(t.shape)}")


def rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(x + residual or None, the weighted norm of it), both contiguous, in x's dtype."""
    h = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual is not None and (residual.stride(-1) != 1 or residual.shape != x.shape):
        residual = residual.expand_as(x).contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty_like(y) if residual is not None else None
    rows = x.numel() // h if h else 0
    if rows:
        sx0, sx1, n1 = _rows(x)
        sr0, sr1, _ = _rows(residual) if residual is not None else (0, 0, 1)
        block = triton.next_power_of_2(h)
        warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
        launch(_rms_norm_kernel, (rows,))(x, residual if residual is not None else x, weight, s if s is not None else y,
                                          y, sx0, sx1, sr0, sr1, n1, h, eps, HAS_RES=residual is not None,
                                          BLOCK=block, ACCURATE=not triton_interpreting(), num_warps=warps)  # fmt: skip
    return s, y
