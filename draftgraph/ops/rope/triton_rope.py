"""RoPE on q and k and the copy of v in one Triton kernel: a program per token, all its heads at once.

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
def _rope_qkv_kernel(q, k, v, cos, sin, q_out, k_out, v_out, sqt, sqh, skt, skh, svt, svh, sct, sst, HQ, HKV,
                     HALF: tl.constexpr, HQ_PAD: tl.constexpr, HKV_PAD: tl.constexpr):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF)
    c = tl.load(cos + t * sct + d).to(tl.float32)[None, :]
    s = tl.load(sin + t * sst + d).to(tl.float32)[None, :]
    hq = tl.arange(0, HQ_PAD)[:, None]
    mq = hq < HQ
    src = q + t * sqt + hq * sqh + d[None, :]
    x1 = tl.load(src, mask=mq, other=0.0)
    x2 = tl.load(src + HALF, mask=mq, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    dst = q_out + t * (HQ * 2 * HALF) + hq * (2 * HALF) + d[None, :]
    tl.store(dst, (a * c - b * s).to(x1.dtype), mask=mq)
    tl.store(dst + HALF, (b * c + a * s).to(x1.dtype), mask=mq)
    hk = tl.arange(0, HKV_PAD)[:, None]
    mk = hk < HKV
    src = k + t * skt + hk * skh + d[None, :]
    x1 = tl.load(src, mask=mk, other=0.0)
    x2 = tl.load(src + HALF, mask=mk, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    dst = k_out + t * (HKV * 2 * HALF) + hk * (2 * HALF) + d[None, :]
    tl.store(dst, (a * c - b * s).to(x1.dtype), mask=mk)
    tl.store(dst + HALF, (b * c + a * s).to(x1.dtype), mask=mk)
    src = v + t * svt + hk * svh + d[None, :]
    dst = v_out + t * (HKV * 2 * HALF) + hk * (2 * HALF) + d[None, :]
    tl.store(dst, tl.load(src, mask=mk, other=0.0), mask=mk)
    tl.store(dst + HALF, tl.load(src + HALF, mask=mk, other=0.0), mask=mk)


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
        launch(_rope_qkv_kernel, (t,))(
            q, k, v, cos, sin, q_out, k_out, v_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), cos.stride(0), sin.stride(0), hq, hkv, HALF=half, HQ_PAD=triton.next_power_of_2(hq),
            HKV_PAD=triton.next_power_of_2(hkv), num_warps=4,
        )  # fmt: skip
    return q_out, k_out, v_out
