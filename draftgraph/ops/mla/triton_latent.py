"""Absorbed MLA attention in latent space, split over the keys: the one kernel behind dense MLA
(`mla_latent_triton`, every visible position) and sparse MLA (`sparse_mla_latent_triton`, the indexer's picks).

Grid (token, block of BH heads, split). The heads of a block share one latent stream (MLA is multi-query in
latent space): a program reads each key's latent c [r] and RoPE key [dr] once for its heads, through the block
table (slot = block_tables[req, p // B] * B + p % B), scores q_lat . c + q_pe . k_pe with an online softmax in
float32 and accumulates p c in latent space (triton_absorbed.py's `fold_latent_tile`).

The keys of a token are positions 0 .. kv_len - 1 (dense), or the first min(topk, kv_len) entries of its row
of picks (sparse: entries < 0 are skipped wherever they are; the indexer writes only -1 past them). Few tokens
(decode, small verify batches) would leave most SMs idle with one program per (token, head block) walking
the whole context, so a token's keys are split S ways (flash-decoding, as ops/attention/triton_split_kv.py:
`choose_num_splits` from host-known sizes only), each split writing float32 partials (output, running max,
sum of exponentials) that a second kernel merges by log-sum-exp (triton_common.py's `merge_split_partials`).
S = 1 writes the output directly. Launch shapes depend on T, the heads, topk or the block-table width and
the SM count only: no host sync, so the kernels sit inside CUDA graphs of any batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftgraph.ops.attention.triton_common import merge_split_partials
from draftgraph.ops.attention.triton_split_kv import SplitKVRule, choose_num_splits
from draftgraph.ops.backends import device_sm_count, triton_dot_settings
from draftgraph.ops.launch import launch
from draftgraph.ops.mla.triton_absorbed import fold_latent_tile, load_latent_queries

# At most 16 splits (the merge holds S x r float32 partials per head), 64 keys each at least.
LATENT_SPLIT_RULE = SplitKVRule(min_context=256, min_keys_per_split=64, max_splits=16)


@triton.jit
def _chunk(n_keys, split, NUM_SPLITS, BLOCK_N: tl.constexpr):
    """Keys [c0, c1) of this split's share of the first n_keys, and how many splits have any."""
    chunk = tl.maximum(tl.cdiv(tl.cdiv(n_keys, NUM_SPLITS), BLOCK_N) * BLOCK_N, BLOCK_N)
    c0 = split * chunk
    return c0, tl.minimum(c0 + chunk, n_keys), tl.cdiv(n_keys, chunk)


@triton.jit(do_not_specialize=["NUM_SPLITS"])  # one variant for every S of the rule
def _latent_kernel(
    q_lat_ptr,
    q_pe_ptr,
    latent_ptr,
    rope_ptr,
    idx_ptr,  # [T, topk] picks (PICKS), else unused
    out_ptr,  # [T, H, R] (NUM_SPLITS == 1) or the partials [T, H, S, R] float32
    m_ptr,  # [T, H, S] float32: running max (NUM_SPLITS > 1)
    l_ptr,  # [T, H, S] float32: sum of exp(score - max)
    block_tables_ptr,
    token_req_ptr,
    token_kv_len_ptr,
    stride_qlt,
    stride_qlh,
    stride_qpt,
    stride_qph,
    stride_it,
    stride_ot,
    stride_oh,
    stride_lb,
    stride_ls,
    stride_rb,
    stride_rs,
    stride_bt,
    scale,
    num_heads,
    topk,  # picks per row (PICKS), else the block-table span (>= every kv_len)
    span,
    NUM_SPLITS,
    R: tl.constexpr,
    R_PAD: tl.constexpr,
    DR: tl.constexpr,
    DR_PAD: tl.constexpr,
    BH: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    SPLIT: tl.constexpr,
    PICKS: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    split = tl.program_id(2)
    n_keys = tl.minimum(tl.load(token_kv_len_ptr + t), topk)
    c0, c1, _ = _chunk(n_keys, split, NUM_SPLITS, BLOCK_N)
    r = tl.arange(0, R_PAD)
    h_mask, r_mask = h < num_heads, r < R
    if (c0 < c1) | (split == 0):  # other empty splits write nothing: the merge skips them
        req = tl.load(token_req_ptr + t).to(tl.int64)
        q_lat, q_pe = load_latent_queries(
            q_lat_ptr, q_pe_ptr, t, h, num_heads, stride_qlt, stride_qlh, stride_qpt, stride_qph, R, R_PAD, DR,
            DR_PAD, DOT_F32,
        )  # fmt: skip
        m_i = tl.full([BH], float("-inf"), tl.float32)
        l_i = tl.zeros([BH], tl.float32)
        acc = tl.zeros([BH, R_PAD], tl.float32)
        for n0 in range(c0, c1, BLOCK_N):
            j = n0 + tl.arange(0, BLOCK_N)
            if PICKS:
                pos = tl.load(idx_ptr + t * stride_it + j, mask=j < c1, other=-1)
                valid = pos >= 0
                pos = tl.minimum(tl.maximum(pos, 0), span - 1)  # the reference's clamp; keeps any entry in bounds
            else:
                pos = j
                valid = j < c1
            block = tl.load(block_tables_ptr + req * stride_bt + pos // PAGE, mask=valid, other=0).to(tl.int64)
            m_i, l_i, acc = fold_latent_tile(
                q_lat, q_pe, m_i, l_i, acc, latent_ptr, rope_ptr, block, pos % PAGE, valid, stride_lb, stride_ls,
                stride_rb, stride_rs, scale, R, R_PAD, DR, DR_PAD, PRECISION, DOT_F32,
            )  # fmt: skip
        hr_mask = h_mask[:, None] & r_mask[None, :]
        if SPLIT:
            idx = (t * num_heads + h).to(tl.int64) * NUM_SPLITS + split  # [BH]
            tl.store(m_ptr + idx, m_i, mask=h_mask)
            tl.store(l_ptr + idx, l_i, mask=h_mask)
            tl.store(out_ptr + idx[:, None] * R + r[None, :], acc, mask=hr_mask)
        else:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no key (padding rows) -> zeros
            offs = t * stride_ot + h[:, None] * stride_oh + r[None, :]
            tl.store(out_ptr + offs, out.to(out_ptr.dtype.element_ty), mask=hr_mask)


@triton.jit(do_not_specialize=["NUM_SPLITS"])
def _merge_kernel(
    acc_ptr,
    m_ptr,
    l_ptr,
    out_ptr,
    token_kv_len_ptr,
    stride_ot,
    stride_oh,
    num_heads,
    topk,
    NUM_SPLITS,
    R: tl.constexpr,
    R_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    _, _, used = _chunk(tl.minimum(tl.load(token_kv_len_ptr + t), topk), 0, NUM_SPLITS, BLOCK_N)
    base = (t * num_heads + h).to(tl.int64) * NUM_SPLITS
    out = merge_split_partials(acc_ptr, m_ptr, l_ptr, base, used, R, S_PAD, R_PAD)  # no key -> zeros
    r = tl.arange(0, R_PAD)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + r, out.to(out_ptr.dtype.element_ty), mask=r < R)


def latent_attention_triton(
    q_lat, q_pe, latent_cache, rope_cache, picks, block_tables, token_req, token_kv_len, scale,
    num_splits: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """[T, H, r] attention output in latent space; the caches already hold this step's rows. `picks`: None for
    every visible position (dense MLA), or [T, topk] positions as the indexer writes them (sparse MLA).
    num_splits: S for tests and benchmarks (default: `choose_num_splits` with LATENT_SPLIT_RULE)."""
    if not (latent_cache.is_contiguous() and rope_cache.is_contiguous()):
        raise ValueError("MLA attention (triton) needs contiguous caches [blocks, block_size, r | d_rope]")
    num_tokens, num_heads, rank = q_lat.shape
    out = torch.empty_like(q_lat, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    q_lat = q_lat if q_lat.stride(-1) == 1 else q_lat.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    page = latent_cache.shape[1]
    span = block_tables.shape[1] * page
    if picks is None:
        topk, idx = max(span, 1), token_req  # idx: any int tensor, never read
    else:
        idx = picks if picks.stride(-1) == 1 else picks.contiguous()
        topk = picks.shape[1]
    r_pad = max(16, triton.next_power_of_2(rank))
    bh = 16 if num_heads <= 16 or r_pad >= 512 else 32
    head_blocks = triton.cdiv(num_heads, bh)
    block_n = 32 if r_pad >= 256 else 64
    if num_splits is None:
        sms = device_sm_count(q_lat.device)
        num_splits = choose_num_splits(num_tokens, head_blocks, min(topk, span), sms, LATENT_SPLIT_RULE)
    if num_splits < 1:
        raise ValueError(f"num_splits = {num_splits} must be >= 1 (choose_num_splits picks one)")
    split = num_splits > 1
    dev = q_lat.device
    acc = torch.empty(num_tokens, num_heads, num_splits, rank, dtype=torch.float32, device=dev) if split else out
    m = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=dev) if split else out
    l_sum = torch.empty_like(m) if split else out
    dot_f32, precision = triton_dot_settings(q_lat.dtype)
    launch(_latent_kernel, (num_tokens, head_blocks, num_splits))(
        q_lat, q_pe, latent_cache, rope_cache, idx, acc, m, l_sum, block_tables, token_req, token_kv_len,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), idx.stride(0), out.stride(0),
        out.stride(1), latent_cache.stride(0), latent_cache.stride(1), rope_cache.stride(0), rope_cache.stride(1),
        block_tables.stride(0), scale, num_heads, topk, max(span, 1), num_splits,
        R=rank, R_PAD=r_pad, DR=q_pe.shape[-1], DR_PAD=max(16, triton.next_power_of_2(q_pe.shape[-1])), BH=bh,
        PAGE=page, BLOCK_N=block_n, PRECISION=precision, DOT_F32=dot_f32, SPLIT=split, PICKS=picks is not None,
        num_warps=8 if r_pad >= 256 else 4,
    )  # fmt: skip
    if split:
        launch(_merge_kernel, (num_tokens, num_heads))(
            acc, m, l_sum, out, token_kv_len, out.stride(0), out.stride(1), num_heads, topk, num_splits,
            R=rank, R_PAD=r_pad, S_PAD=max(2, triton.next_power_of_2(num_splits)), BLOCK_N=block_n,
            num_warps=4,
        )  # fmt: skip
    return out


def mla_latent_triton(
    q_lat, q_pe, latent_cache, rope_cache, block_tables, token_req, token_kv_len, scale, num_splits: int | None = None
) -> torch.Tensor:
    """Dense MLA in latent space, mla_latent_reference's contract (the caches already hold this step's rows)."""
    return latent_attention_triton(
        q_lat, q_pe, latent_cache, rope_cache, None, block_tables, token_req, token_kv_len, scale, num_splits
    )
