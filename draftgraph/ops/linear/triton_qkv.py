"""A Llama layer's input norm, QKV projection, RoPE and KV-cache write for one row, in one kernel.

At batch 1 a decode step runs, per layer, the add + RMSNorm + QKV GEMV (triton_gemv.py's `_norm_gemv_kernel`) and then
RoPE with the keys' and values' write into the paged caches (ops/rope/triton_rope.py): two launches, the second a
~2 us kernel that reads back the few kilobytes the first wrote. Here the GEMV's epilogue does the second's work: each
program owns BLOCK_N / 2 positions j of one head's first half and the same positions of its second half (columns
head * D + j and head * D + D / 2 + j of the QKV output), so it holds both halves of its rotation pairs:
- query heads: rotated (x1 c - x2 s, x2 c + x1 s in float32, rounded once) into q_out [Hq, D];
- key heads: rotated into the key cache at the token's slot; value heads: copied into the value cache there
  (slot < 0: a padding row, nothing written).
Values equal the two kernels' bit for bit: the GEMV's sums are `norm_row_gemv`'s (the same tile shape and K chunks as
`_norm_gemv_kernel` at `choose_config(1, K, norm=True)`), rounded to x's dtype with the bias, then rotated as
triton_rope.py rotates them. Used by `draftgraph::add_rms_norm_qkv_rope_write` (ops/linear/op.py) for one row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftgraph.ops.backends import triton_interpreting
from draftgraph.ops.launch import launch
from draftgraph.ops.linear.triton_gemv import GemvConfig, norm_row_gemv
from draftgraph.ops.rope.op import kernel_takes
from draftgraph.ops.triton_pdl import pdl_args


@triton.jit
def _norm_gemv_rope_kernel(x, r, nw, w, b, s_out, q_out, k_cache, v_cache, cos, sin, slots, K, swn, eps, kv_row, HQ,
                           HKV, HAS_BIAS: tl.constexpr, HALF: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, ROW: tl.constexpr, ACCURATE: tl.constexpr,
                           PDL: tl.constexpr):  # fmt: skip
    """Program pid: head pid // (HALF / J) of the QKV output (query heads, then key heads, then value heads), its
    positions j = (pid % (HALF / J)) * J + [0, J) of each half, J = BLOCK_N / 2."""
    J: tl.constexpr = BLOCK_N // 2
    pid = tl.program_id(0)
    head = pid // (HALF // J)
    j = (pid % (HALF // J)) * J + tl.arange(0, J)
    i = tl.arange(0, BLOCK_N)
    cols = head * (2 * HALF) + (pid % (HALF // J)) * J + tl.where(i < J, i, HALF + i - J)  # first half, then second
    out = norm_row_gemv(x, r, nw, w, s_out, cols, i < BLOCK_N, K, swn, eps, BLOCK_N, BLOCK_K, ROW, ACCURATE, PDL)
    if HAS_BIAS:
        out += tl.load(b + cols).to(tl.float32)
    dt = x.dtype.element_ty
    y1, y2 = tl.split(tl.trans(tl.reshape(out.to(dt), (2, J))))  # the QKV output as the GEMV rounds it
    if head < HQ + HKV:  # a query or key head: rotated
        c = tl.load(cos + j).to(tl.float32)
        s = tl.load(sin + j).to(tl.float32)
        a, bv = y1.to(tl.float32), y2.to(tl.float32)
        y1, y2 = (a * c - bv * s).to(dt), (bv * c + a * s).to(dt)
    if head < HQ:
        tl.store(q_out + head * (2 * HALF) + j, y1)
        tl.store(q_out + head * (2 * HALF) + HALF + j, y2)
    else:
        slot = tl.load(slots).to(tl.int64)
        if slot >= 0:
            if head < HQ + HKV:
                dst = k_cache + slot * kv_row + (head - HQ) * (2 * HALF)
            else:
                dst = v_cache + slot * kv_row + (head - HQ - HKV) * (2 * HALF)
            tl.store(dst + j, y1.to(dst.dtype.element_ty))
            tl.store(dst + HALF + j, y2.to(dst.dtype.element_ty))


def norm_gemv_rope_write_triton(
    x: torch.Tensor,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    config: GemvConfig,
    pdl: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One row: (s, q) with s = x + residual [1, K]; the QKV projection of rms_norm(s) (weight [(Hq + 2 Hkv) D, K]),
    its queries rotated into q [1, Hq, D], its keys rotated and its values written into the paged caches [blocks,
    block size, Hkv, D] at slot_mapping[0]; cos, sin [1, D / 2]. `config`: the norm GEMV's (its block_n columns a
    program, even, at most D); `pdl`: the programmatic-dependent-launch level (ops/triton_pdl.py)."""
    k = x.shape[-1]
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    half, n = d // 2, weight.shape[0]
    ok = x.shape == residual.shape == (1, k) and norm_weight.shape == (k,) and weight.shape[1] == k
    ok = ok and n == (num_heads + 2 * hkv) * d and cos.shape == sin.shape == (1, half) and slot_mapping.numel() == 1
    ok = ok and k_cache.is_contiguous() and v_cache.is_contiguous() and v_cache.shape == k_cache.shape
    if not ok:
        raise ValueError(
            f"norm_gemv_rope_write_triton takes x and residual [1, K], norm weight [K], weight [(Hq + 2 Hkv) D, K], "
            f"cos and sin [1, D/2], one slot and contiguous caches [blocks, block size, Hkv, D]; got x "
            f"{tuple(x.shape)}, weight {tuple(weight.shape)}, {num_heads} query heads, caches {tuple(k_cache.shape)}, "
            f"cos {tuple(cos.shape)}, slots {slot_mapping.numel()}"
        )
    bn = config.block_n
    if bn < 2 or not kernel_takes(d) or half % (bn // 2):
        raise ValueError(f"norm_gemv_rope_write_triton: {bn} columns a program for head_dim {d}: an even count whose "
                         "half divides D / 2, D / 2 a power of two")  # fmt: skip
    x, residual, weight, cos, sin = (
        t if t.stride(-1) == 1 else t.contiguous() for t in (x, residual, weight, cos, sin)
    )
    s = torch.empty_like(x, memory_format=torch.contiguous_format)
    q = torch.empty((1, num_heads, d), dtype=x.dtype, device=x.device)
    programs = (num_heads + 2 * hkv) * (half // (bn // 2))
    launch(_norm_gemv_rope_kernel, (programs,))(
        x, residual, norm_weight, weight, bias if bias is not None else weight, s, q, k_cache, v_cache, cos, sin,
        slot_mapping, k, weight.stride(0), eps, k_cache.stride(1), num_heads, hkv, HAS_BIAS=bias is not None,
        HALF=half, BLOCK_N=bn, BLOCK_K=config.block_k, ROW=triton.next_power_of_2(k),
        ACCURATE=not triton_interpreting(), num_warps=config.num_warps, **pdl_args(pdl),
    )  # fmt: skip
    return s, q
