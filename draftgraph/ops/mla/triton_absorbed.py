"""Triton kernels for multi-head latent attention over the paged latent cache: the cache write and the
absorbed form (triton_mla_decompressed.py has the decompressed one).

One program per (query token, block of BH heads): the heads share one latent stream (MLA is multi-query
in latent space), so a program reads each visible token's latent c [r] and RoPE key [d_rope] once for
all its heads, scores q_lat . c + q_pe . k_pe with an online softmax and accumulates p c in latent
space. Launch shapes depend only on the token and head counts, nothing syncs with the host: the kernels
can sit inside CUDA graphs (decode, verify, prefill and mixed batches alike). The same code runs under
TRITON_INTERPRET=1 on CPU tensors (CI checks it against mla_reference.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftgraph.ops.backends import triton_interpreting


@triton.jit
def _write_rows_kernel(src_ptr, cache_ptr, slot_ptr, stride_src, stride_slot, ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot >= 0:  # padding rows (-1) write nothing
        cols = tl.arange(0, ROW_PAD)
        mask = cols < ROW
        x = tl.load(src_ptr + t * stride_src + cols, mask=mask)
        tl.store(cache_ptr + slot.to(tl.int64) * stride_slot + cols, x.to(cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def load_latent_queries(
    q_lat_ptr, q_pe_ptr, t, h, num_heads, stride_qlt, stride_qlh, stride_qpt, stride_qph,
    R: tl.constexpr, R_PAD: tl.constexpr, DR: tl.constexpr, DR_PAD: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """Token t's absorbed queries for the heads `h` [BH]: q_lat [BH, R_PAD] and q_pe [BH, DR_PAD]."""
    r = tl.arange(0, R_PAD)
    d = tl.arange(0, DR_PAD)
    h_mask = h < num_heads
    q_lat = tl.load(
        q_lat_ptr + t * stride_qlt + h[:, None] * stride_qlh + r[None, :],
        mask=h_mask[:, None] & (r < R)[None, :],
        other=0.0,
    )
    q_pe = tl.load(
        q_pe_ptr + t * stride_qpt + h[:, None] * stride_qph + d[None, :],
        mask=h_mask[:, None] & (d < DR)[None, :],
        other=0.0,
    )
    if DOT_F32:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    return q_lat, q_pe


@triton.jit
def fold_latent_tile(
    q_lat, q_pe, m_i, l_i, acc, latent_ptr, rope_ptr, block, offset, valid,
    stride_lb, stride_ls, stride_rb, stride_rs, scale,
    R: tl.constexpr, R_PAD: tl.constexpr, DR: tl.constexpr, DR_PAD: tl.constexpr,
    PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """Fold one tile of keys (cache block and offset per key, `valid` mask) into the online softmax state:
    scores q_lat . c + q_pe . k_pe, accumulation of p c in latent space. A tile with no valid key (sparse
    picks of -1 only) leaves the state as it was."""
    r = tl.arange(0, R_PAD)
    d = tl.arange(0, DR_PAD)
    c = tl.load(
        latent_ptr + (block * stride_lb + offset * stride_ls)[:, None] + r[None, :],
        mask=valid[:, None] & (r < R)[None, :],
        other=0.0,
    )  # [BLOCK_N, R_PAD]
    pe = tl.load(
        rope_ptr + (block * stride_rb + offset * stride_rs)[:, None] + d[None, :],
        mask=valid[:, None] & (d < DR)[None, :],
        other=0.0,
    )  # [BLOCK_N, DR_PAD]
    if DOT_F32:
        c = c.to(tl.float32)
        pe = pe.to(tl.float32)
    s = tl.dot(q_lat, tl.trans(c).to(q_lat.dtype), input_precision=PRECISION)
    s += tl.dot(q_pe, tl.trans(pe).to(q_pe.dtype), input_precision=PRECISION)
    s = tl.where(valid[None, :], s * scale, float("-inf"))  # [BH, BLOCK_N]
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no valid key yet: no NaN
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _mla_kernel(
    q_lat_ptr,
    q_pe_ptr,
    latent_ptr,
    rope_ptr,
    out_ptr,
    block_tables_ptr,
    token_req_ptr,
    token_kv_len_ptr,
    stride_qlt,
    stride_qlh,
    stride_qpt,
    stride_qph,
    stride_ot,
    stride_oh,
    stride_lb,
    stride_ls,
    stride_rb,
    stride_rs,
    stride_bt,
    scale,
    num_heads,
    R: tl.constexpr,
    R_PAD: tl.constexpr,
    DR: tl.constexpr,
    DR_PAD: tl.constexpr,
    BH: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    kv_len = tl.load(token_kv_len_ptr + t)
    req = tl.load(token_req_ptr + t).to(tl.int64)
    r = tl.arange(0, R_PAD)
    h_mask, r_mask = h < num_heads, r < R
    q_lat, q_pe = load_latent_queries(
        q_lat_ptr, q_pe_ptr, t, h, num_heads, stride_qlt, stride_qlh, stride_qpt, stride_qph, R, R_PAD, DR, DR_PAD,
        DOT_F32,
    )  # fmt: skip
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, R_PAD], tl.float32)
    for n0 in range(0, kv_len, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = n < kv_len
        block = tl.load(block_tables_ptr + req * stride_bt + n // PAGE, mask=valid, other=0).to(tl.int64)
        m_i, l_i, acc = fold_latent_tile(
            q_lat, q_pe, m_i, l_i, acc, latent_ptr, rope_ptr, block, n % PAGE, valid, stride_lb, stride_ls,
            stride_rb, stride_rs, scale, R, R_PAD, DR, DR_PAD, PRECISION, DOT_F32,
        )  # fmt: skip
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # kv_len == 0 (padding) -> zeros
    tl.store(
        out_ptr + t * stride_ot + h[:, None] * stride_oh + r[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=h_mask[:, None] & r_mask[None, :],
    )


def write_rows_triton(src: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache.view(-1, row)[slot_mapping[t]] = src[t] for every row with slot >= 0 (no host sync)."""
    num_tokens, row = src.shape
    if num_tokens == 0:
        return
    if src.stride(-1) != 1:
        src = src.contiguous()
    _write_rows_kernel[(num_tokens,)](
        src, cache, slot_mapping, src.stride(0), cache.stride(1), ROW=row, ROW_PAD=triton.next_power_of_2(row)
    )


def mla_latent_triton(
    q_lat, q_pe, latent_cache, rope_cache, block_tables, token_req, token_kv_len, scale
) -> torch.Tensor:
    """Same contract as mla_latent_reference (the caches already hold this step's rows)."""
    if not (latent_cache.is_contiguous() and rope_cache.is_contiguous()):
        raise ValueError("MLA attention (triton) needs contiguous caches [blocks, block_size, r | d_rope]")
    num_tokens, num_heads, rank = q_lat.shape
    out = torch.empty_like(q_lat, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    q_lat = q_lat if q_lat.stride(-1) == 1 else q_lat.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    r_pad = max(16, triton.next_power_of_2(rank))
    bh = 16 if num_heads <= 16 or r_pad >= 512 else 32
    dot_f32 = triton_interpreting() and q_lat.dtype != torch.float32
    precision = "ieee" if q_lat.dtype == torch.float32 or dot_f32 else "tf32"
    _mla_kernel[(num_tokens, triton.cdiv(num_heads, bh))](
        q_lat,
        q_pe,
        latent_cache,
        rope_cache,
        out,
        block_tables,
        token_req,
        token_kv_len,
        q_lat.stride(0),
        q_lat.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        out.stride(0),
        out.stride(1),
        latent_cache.stride(0),
        latent_cache.stride(1),
        rope_cache.stride(0),
        rope_cache.stride(1),
        block_tables.stride(0),
        scale,
        num_heads,
        R=rank,
        R_PAD=r_pad,
        DR=q_pe.shape[-1],
        DR_PAD=max(16, triton.next_power_of_2(q_pe.shape[-1])),
        BH=bh,
        PAGE=latent_cache.shape[1],
        BLOCK_N=32 if r_pad >= 256 else 64,
        PRECISION=precision,
        DOT_F32=dot_f32,
        num_warps=8 if r_pad >= 256 else 4,
    )
    return out
