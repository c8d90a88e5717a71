"""RoPE on q and k and the copy of v in one Triton kernel: a program per token and head (q's heads, then the KV
heads: key and value).

The inputs are the strided views of a fused QKV projection's output ([T, heads, D] with a row stride of the
whole projection); the outputs are contiguous. Each head row's two halves x1, x2 become x1 c - x2 s and
x2 c + x1 s in float32 (rotated heads: q's and k's), rounded once to the input dtype; v's heads are copied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftgraph.ops.launch import launch
from draftgraph.ops.rope.op import kernel_takes


@triton.jit
def _rotate(src, dst, c, s, d, HALF: tl.constexpr):
    x1 = tl.load(src + d)
    x2 = tl.load(src + HALF + d)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(dst + d, (a * c - b * s).to(x1.dtype))
    tl.store(dst + HALF + d, (b * c + a * s).to(x1.dtype))


@triton.jit
def _rope_qkv_kernel(q, k, v, cos, sin, q_out, k_out, v_out, sqt, sqh, skt, skh, svt, svh, sct, sst, HQ, HKV,
                     HALF: tl.constexpr):  # fmt: skip
    """Program (t, h): query head h of token t for h < HQ, else KV head h - HQ's key (rotated) and value."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, HALF)
    c = tl.load(cos + t * sct + d).to(tl.float32)
    s = tl.load(sin + t * sst + d).to(tl.float32)
    if h < HQ:
        _rotate(q + t * sqt + h * sqh, q_out + (t * HQ + h) * (2 * HALF), c, s, d, HALF)
    else:
        g = h - HQ
        _rotate(k + t * skt + g * skh, k_out + (t * HKV + g) * (2 * HALF), c, s, d, HALF)
        dst = v_out + (t * HKV + g) * (2 * HALF)
        tl.store(dst + d, tl.load(v + t * svt + g * svh + d))
        tl.store(dst + HALF + d, tl.load(v + t * svt + g * svh + HALF + d))


def rope_qkv_triton(q, k, v, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k and v [T, Hkv, D] with a unit stride on D (views of a QKV output); cos, sin [T, D/2]."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    half = d // 2
    if not kernel_takes(d):
        raise ValueError(f"rope_qkv_triton: head_dim {d}: twice a power of two (64, 128, 256, ...)")
    q, k, v, cos, sin = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, cos, sin))
    q_out, k_out, v_out = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))
    if t:
        launch(_rope_qkv_kernel, (t, hq + hkv))(
            q, k, v, cos, sin, q_out, k_out, v_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), cos.stride(0), sin.stride(0), hq, hkv, HALF=half, num_warps=1,
        )  # fmt: skip
    return q_out, k_out, v_out
