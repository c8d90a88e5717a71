"""Triton kernels for paged attention: a KV-cache write and a variable-length causal attention.

Launch shapes depend only on the token count and the head layout, never on sequence lengths read from
the device, and nothing syncs with the host: both kernels can be captured inside a CUDA graph.

Layout: one program per (query token, KV head). The program loads the GROUP query heads that share the
KV head as a [GROUP_PAD, D] tile and streams the token's visible keys through the block table with an
online softmax. Decode, verify, chunked prefill and mixed batches are the same code: each token knows
its request (token_req) and how many keys it sees (token_kv_len). Prefill re-reads keys once per query
token, which is fine for this stage's correctness goal; a query-tiled prefill kernel is future work.
Few query tokens over long contexts (batch-1 decode: 8 programs for 8 KV heads) instead split each token's
keys across programs (triton_split_kv.py); `attend_triton` picks by a rule on host-known sizes.

Under TRITON_INTERPRET=1 the same kernels run on CPU tensors (CI checks them against the reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftgraph.ops.attention.triton_common import attend_key_range, load_group_q
from draftgraph.ops.attention.triton_split_kv import attend_split_kv, choose_num_splits
from draftgraph.ops.backends import device_sm_count, triton_dot_settings
from draftgraph.ops.launch import launch, pdl_level
from draftgraph.ops.triton_pdl import pdl_args, pdl_release, pdl_start


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_vt,
    stride_cache_slot,
    ROW: tl.constexpr,
    ROW_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:
        cols = tl.arange(0, ROW_PAD)
        mask = cols < ROW
        k = tl.load(k_ptr + t * stride_kt + cols, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + cols, mask=mask)
        dst = slot.to(tl.int64) * stride_cache_slot + cols
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    token_req_ptr,
    token_kv_len_ptr,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    scale,
    window,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    PDL: tl.constexpr,  # programmatic dependent launch's level (ops/triton_pdl.py)
):
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    pdl_start(PDL)
    kv_len = tl.load(token_kv_len_ptr + t)
    req = tl.load(token_req_ptr + t).to(tl.int64)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    heads = kv_head * GROUP + g
    q = load_group_q(q_ptr, t, kv_head, stride_qt, stride_qh, GROUP, GROUP_PAD, HEAD_DIM, D_PAD, DOT_F32)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    start = tl.where(window > 0, tl.maximum(kv_len - window, 0), 0)
    lo = (start // BLOCK_N) * BLOCK_N
    m_i, l_i, acc = attend_key_range(
        q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_tables_ptr, req, kv_head, lo, kv_len, start,
        stride_cb, stride_cs, stride_ch, stride_bt, scale, HEAD_DIM, D_PAD, PAGE, BLOCK_N, PRECISION, DOT_F32,
    )  # fmt: skip
    pdl_release(PDL)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # kv_len == 0 (padding) -> zeros
    tl.store(
        out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=(g < GROUP)[:, None] & (d < HEAD_DIM)[None, :],
    )


def write_kv_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    row = k_cache.shape[2] * k_cache.shape[3]
    k2 = k.reshape(num_tokens, row)
    v2 = v.reshape(num_tokens, row)
    launch(_write_kv_kernel, (num_tokens,))(
        k2,
        v2,
        k_cache,
        v_cache,
        slot_mapping,
        k2.stride(0),
        v2.stride(0),
        k_cache.stride(1),
        ROW=row,
        ROW_PAD=triton.next_power_of_2(row),
    )


def paged_attention_triton(
    q, k, v, k_cache, v_cache, slot_mapping, block_tables, token_req, token_kv_len, scale, window
) -> torch.Tensor:
    """Same contract as paged_attention_reference; q: [T, Hq, D] with a unit stride on D."""
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("paged attention (triton) needs contiguous KV caches [blocks, block_size, Hkv, D]")
    write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    return attend_triton(q, k_cache, v_cache, block_tables, token_req, token_kv_len, scale, window)


def attend_triton(
    q, k_cache, v_cache, block_tables, token_req, token_kv_len, scale, window, num_splits: int | None = None
) -> torch.Tensor:
    """The attention half (caches already written). num_splits: None = `choose_num_splits` (host-known sizes
    only, so graph-safe); 1 = the unsplit kernel; S > 1 = triton_split_kv.py's split-KV kernel."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_splits is None:
        max_context = block_tables.shape[1] * k_cache.shape[1]
        if window > 0:
            max_context = min(max_context, window)
        num_splits = choose_num_splits(num_tokens, num_kv_heads, max_context, device_sm_count(q.device))
    if num_splits > 1:
        return attend_split_kv(q, k_cache, v_cache, block_tables, token_req, token_kv_len, scale, window, num_splits)
    group = num_heads // num_kv_heads
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    d_pad = max(16, triton.next_power_of_2(head_dim))
    block_n = 32 if d_pad >= 256 else 64
    dot_f32, precision = triton_dot_settings(q.dtype)
    launch(_paged_attention_kernel, (num_tokens, num_kv_heads))(
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        token_req,
        token_kv_len,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        scale,
        window,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        PAGE=k_cache.shape[1],
        BLOCK_N=block_n,
        PRECISION=precision,
        DOT_F32=dot_f32,
        num_warps=4,
        **pdl_args(pdl_level(q.device)),
    )
    return out
