"""RoPE on q and k and the copy of v in one Triton kernel: a program per token and head (q's heads, then the KV
heads: key and value).

The inputs are the strided views of a fused QKV projection's output ([T, heads, D] with a row stride of the
whole projection); the outputs are contiguous. Each head row's two halves x1, x2 become x1 c - x2 s and
x2 c + x1 s in float32 (rotated heads: q's and k's), rounded once to the input dtype; v's heads are copied. The
same kernel (`TO_CACHE`) can put the keys and values straight into the paged caches at the tokens' slots
(`rope_qkv_write_triton`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftgraph.ops.launch import launch, pdl_level
from draftgraph.ops.rope.op import kernel_takes
from draftgraph.ops.triton_pdl import pdl_args, pdl_release, pdl_start


@triton.jit
def _rotate(src, dst, c, s, d, HALF: tl.constexpr):
    """One head: its halves rotated in float32, rounded to the input dtype, stored in dst's (a cache's) dtype."""
    x1 = tl.load(src + d)
    x2 = tl.load(src + HALF + d)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(dst + d, (a * c - b * s).to(x1.dtype).to(dst.dtype.element_ty))
    tl.store(dst + HALF + d, (b * c + a * s).to(x1.dtype).to(dst.dtype.element_ty))


@triton.jit
def _copy(src, dst, d, HALF: tl.constexpr):
    """One head copied, in dst's dtype."""
    tl.store(dst + d, tl.load(src + d).to(dst.dtype.element_ty))
    tl.store(dst + HALF + d, tl.load(src + HALF + d).to(dst.dtype.element_ty))


@triton.jit
def _rope_qkv_kernel(q, k, v, cos, sin, q_out, k_dst, v_dst, slots, sqt, sqh, skt, skh, svt, svh, sct, sst, kv_row,
                     HQ, HALF: tl.constexpr, TO_CACHE: tl.constexpr, PDL: tl.constexpr):  # fmt: skip
    """Program (t, h): query head h of token t rotated into q_out for h < HQ; else KV head h - HQ's key rotated and
    value copied into row t of k_dst / v_dst ([T, Hkv, D] outputs), or with TO_CACHE into the paged caches at the
    token's slot (slot < 0: a padding row, skipped). `kv_row`: elements from one row (token or slot) to the next.
    PDL: programmatic dependent launch's level (ops/triton_pdl.py)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, HALF)
    pdl_start(PDL)
    c = tl.load(cos + t * sct + d).to(tl.float32)
    s = tl.load(sin + t * sst + d).to(tl.float32)
    if h < HQ:
        _rotate(q + t * sqt + h * sqh, q_out + (t * HQ + h) * (2 * HALF), c, s, d, HALF)
    else:
        g = h - HQ
        if TO_CACHE:
            row = tl.load(slots + t).to(tl.int64)
        else:
            row = t
        if row >= 0:
            at = row * kv_row + g * (2 * HALF)
            _rotate(k + t * skt + g * skh, k_dst + at, c, s, d, HALF)
            _copy(v + t * svt + g * svh, v_dst + at, d, HALF)
    pdl_release(PDL)


def _launch(name, q, k, v, cos, sin, k_dst, v_dst, slots, kv_row, to_cache) -> torch.Tensor:
    """Check and launch `_rope_qkv_kernel`; returns the rotated queries."""
    t, hq, d = q.shape
    if not kernel_takes(d):
        raise ValueError(f"{name}: head_dim {d}: twice a power of two (64, 128, 256, ...)")
    q, k, v, cos, sin = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, cos, sin))
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if t:
        launch(_rope_qkv_kernel, (t, hq + k.shape[1]))(
            q, k, v, cos, sin, q_out, k_dst, v_dst, slots, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), cos.stride(0), sin.stride(0), kv_row, hq, HALF=d // 2, TO_CACHE=to_cache,
            num_warps=1, **pdl_args(pdl_level(q.device)),
        )  # fmt: skip
    return q_out


def rope_qkv_triton(q, k, v, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k and v [T, Hkv, D] with a unit stride on D (views of a QKV output); cos, sin [T, D/2]."""
    k_out, v_out = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (k, v))
    q_out = _launch("rope_qkv_triton", q, k, v, cos, sin, k_out, v_out, q, k.shape[1] * k.shape[2], False)
    return q_out, k_out, v_out


def rope_qkv_write_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> torch.Tensor:
    """`rope_qkv_triton` with the keys and values written into the paged caches [blocks, block size, Hkv, D] at
    `slot_mapping` instead of returned; returns the rotated queries."""
    hkv, d = k.shape[1], q.shape[2]
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape[2:] != (hkv, d):
        raise ValueError(
            f"rope_qkv_write_triton needs contiguous caches [blocks, block size, {hkv}, {d}]; got "
            f"{tuple(k_cache.shape)}"
        )
    return _launch("rope_qkv_write_triton", q, k, v, cos, sin, k_cache, v_cache, slot_mapping, k_cache.stride(1), True)
