"""Triton pieces of multi-head latent attention over the paged latent cache: the cache write, and the device
functions of the absorbed form that triton_latent.py's kernel (dense and sparse MLA) is built from
(triton_decompressed.py has the decompressed form).

The heads share one latent stream (MLA is multi-query in latent space), so a program loads its heads'
absorbed queries once (`load_latent_queries`) and folds each tile of keys, read once for all its heads, into
an online softmax in latent space (`fold_latent_tile`). The same code runs under TRITON_INTERPRET=1 on CPU
tensors (CI checks it against reference.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftgraph.ops.launch import launch


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


def write_rows_triton(src: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache.view(-1, row)[slot_mapping[t]] = src[t] for every row with slot >= 0 (no host sync)."""
    num_tokens, row = src.shape
    if num_tokens == 0:
        return
    if src.stride(-1) != 1:
        src = src.contiguous()
    launch(_write_rows_kernel, (num_tokens,))(
        src, cache, slot_mapping, src.stride(0), cache.stride(1), ROW=row, ROW_PAD=triton.next_power_of_2(row)
    )
