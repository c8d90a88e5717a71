"""Triton device functions the paged-attention kernels share (triton_attention.py, triton_split_kv.py; the
split-partials merge serves sparse MLA's kernel too).

`load_group_q` loads the GROUP query heads that share one KV head as a [GROUP_PAD, D_PAD] tile;
`attend_key_range` folds the keys [lo, hi) of one request (visible from `start`) into an online softmax
state (m, l, acc) through the block table. The whole-context kernel calls it once per token over
[start rounded down to a tile, kv_len); the split-KV kernel once per split over its chunk.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_group_q(
    q_ptr,
    t,
    kv_head,
    stride_qt,
    stride_qh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    heads = kv_head * GROUP + g
    q = tl.load(
        q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=(g < GROUP)[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )  # [GROUP_PAD, D_PAD]
    if DOT_F32:
        q = q.to(tl.float32)
    return q


@triton.jit
def attend_key_range(
    q,
    m_i,
    l_i,
    acc,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    req,
    kv_head,
    lo,
    hi,
    start,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    scale,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    d = tl.arange(0, D_PAD)
    d_mask = d < HEAD_DIM
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        valid = (n < hi) & (n >= start)
        block = tl.load(block_tables_ptr + req * stride_bt + n // PAGE, mask=valid, other=0).to(tl.int64)
        row = block * stride_cb + (n % PAGE) * stride_cs + kv_head * stride_ch  # [BLOCK_N]
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, D_PAD]
        s = tl.dot(q, tl.trans(k).to(q.dtype), input_precision=PRECISION) * scale  # [GROUP_PAD, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def merge_split_partials(acc_ptr, m_ptr, l_ptr, base, used, D: tl.constexpr, S_PAD: tl.constexpr, D_PAD: tl.constexpr):
    """One (token, head)'s output [D_PAD] (float32) from its `used` split partials at rows base + s of the
    scratch: unnormalised acc [.., D], running max m and sum of exponentials l, merged by log-sum-exp. Splits
    past `used` wrote nothing (their scratch is garbage); when no split saw a key every weight is 0 and the
    output is zeros."""
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_mask = s < used
    m = tl.load(m_ptr + base + s, mask=s_mask, other=float("-inf"))  # [S_PAD]
    l_s = tl.load(l_ptr + base + s, mask=s_mask, other=0.0)
    acc = tl.load(acc_ptr + (base + s)[:, None] * D + d[None, :], mask=s_mask[:, None] & (d < D)[None, :], other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    denom = tl.sum(w * l_s, 0)
    return tl.sum(w[:, None] * acc, 0) / tl.where(denom > 0, denom, 1.0)
