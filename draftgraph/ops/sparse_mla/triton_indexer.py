"""The lightning indexer in Triton (`indexer_topk`, contract in reference.py): the index-key cache write, a
scoring kernel and a radix-select kernel. No host sync; launch shapes from T, topk, the block-table width and
the SM count only, so the op sits inside any CUDA graph (uniform batches of any 1+K, mixed batches).

1. Write: this step's keys at their slots (triton_absorbed.py's row-write kernel), before scoring, so the
   tokens of one step see each other's keys.
2. Score: grid (token, split). Split s of token t takes key tiles s, s + S, s + 2S, .. of its visible range
   [0, token_kv_len[t]) (strided, so every split has work whatever the length), reads them through the block
   table, and writes I[t, p] = sum_h w[t, h] * ReLU(scale * q[t, h] . k[p]) (one tl.dot over its Hi heads,
   float32 accumulation) into a float32 scratch [rows, span] (span = table width * block size, the most a
   request can hold); -0.0 is stored as +0.0 so integer keys order exactly as floats compare. Columns at or
   past the row's length are neither written nor read. Rows with token_kv_len <= topk are not scored at all:
   every visible position is picked.
3. Select: one program per token. A row with n = token_kv_len <= topk writes 0 .. n-1, then -1. Otherwise a
   radix select finds the topk-th largest score: its float32 bits as order-preserving uint32 keys, 4 passes of
   8-bit digits from the top, each pass a 256-bin histogram (tl.histogram) of the keys that match the digits
   chosen so far; the digit kept is the largest whose count from the top, plus the keys already above, reaches
   topk. A last pass writes, in position order, every position whose key is above the threshold, then the
   positions equal to it, lowest first, until topk are written. That is exactly the reference's set (a stable
   descending sort keeps ties in position order); the order inside a row is by position, not by score (the
   contract leaves it open).

Why a radix select and not torch.topk on the scratch: torch.topk works on whole rows of the scratch (span
columns, e.g. max_model_len, not the visible length), so every column past a row's length would have to be
filled with -inf first and sorted over, and it breaks ties in no documented order. The radix select reads only
the visible columns, 5 times (4 histogram passes and the write), so its cost is O(token_kv_len) per row, below
the scoring pass that wrote them (which reads Di bf16 values per column), and its ties are the reference's.
Its limit: one program per row, so a few rows over a long context (1 row x 128k: 5 sweeps of 512 KiB by one
SM) are latency-bound; splitting a row over programs with per-split histograms (ops/sampling/triton_probs.py
does so) is the next step where scripts/bench_sparse_mla.py shows the select dominating.

Memory: the scratch is 4 * rows * span bytes; rows are processed in chunks (a host loop over T, so a graph
captures the same kernels) so that it stays under SCORE_BUDGET elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftgraph.ops.backends import device_sm_count, triton_interpreting
from draftgraph.ops.launch import launch
from draftgraph.ops.mla.triton_absorbed import write_rows_triton

SCORE_BUDGET = 1 << 26  # float32 elements of the score scratch (256 MiB); rows are chunked to stay under it
BLOCK_N = 64  # keys per tile of the scoring kernel
SCORE_PROGRAMS_PER_SM = 4  # the scoring grid aims at this many programs per SM
BITS = 8  # radix digit of the select: 32 / BITS histogram passes
SELECT_BLOCK = 2048  # scores per step of the select passes


def choose_score_splits(rows: int, span: int, device: torch.device) -> int:
    """Programs per row of the scoring grid: about SCORE_PROGRAMS_PER_SM per SM over all rows, at most one per
    key tile of the span; 1 off CUDA (the interpreter checks correctness, not speed). Host-known sizes only."""
    sms = device_sm_count(device)
    if not sms or rows == 0:
        return 1
    return max(1, min(triton.cdiv(SCORE_PROGRAMS_PER_SM * sms, rows), triton.cdiv(span, BLOCK_N)))


@triton.jit
def _score_kernel(
    q_ptr,
    w_ptr,
    cache_ptr,
    scores_ptr,
    block_tables_ptr,
    token_req_ptr,
    token_kv_len_ptr,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_cb,
    stride_cs,
    stride_bt,
    stride_st,
    scale,
    topk,
    NUM_SPLITS,
    HI: tl.constexpr,
    HI_PAD: tl.constexpr,
    DI: tl.constexpr,
    DI_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    t = tl.program_id(0)
    split = tl.program_id(1)
    kv_len = tl.load(token_kv_len_ptr + t)
    if kv_len > topk:  # shorter rows pick every visible position: nothing to score
        req = tl.load(token_req_ptr + t).to(tl.int64)
        h = tl.arange(0, HI_PAD)
        d = tl.arange(0, DI_PAD)
        h_mask, d_mask = h < HI, d < DI
        q = tl.load(
            q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :],
            mask=h_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [HI_PAD, DI_PAD]
        if DOT_F32:
            q = q.to(tl.float32)
        w = tl.load(w_ptr + t * stride_wt + h, mask=h_mask, other=0.0).to(tl.float32)  # [HI_PAD]
        for tile in range(split, tl.cdiv(kv_len, BLOCK_N), NUM_SPLITS):
            n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            valid = n < kv_len
            block = tl.load(block_tables_ptr + req * stride_bt + n // PAGE, mask=valid, other=0).to(tl.int64)
            k = tl.load(
                cache_ptr + (block * stride_cb + (n % PAGE) * stride_cs)[:, None] + d[None, :],
                mask=valid[:, None] & d_mask[None, :],
                other=0.0,
            )  # [BLOCK_N, DI_PAD]
            dots = tl.dot(q, tl.trans(k).to(q.dtype), input_precision=PRECISION)  # [HI_PAD, BLOCK_N] float32
            s = tl.sum(tl.maximum(dots * scale, 0.0) * w[:, None], axis=0)  # [BLOCK_N]
            s = tl.where(s == 0.0, 0.0, s)  # -0.0 (negative weights times ReLU 0) -> +0.0: one key per value
            tl.store(scores_ptr + t * stride_st + n, s, mask=valid)


@triton.jit
def _keys(scores_ptr, row_off, cols, inb):
    """Order-preserving uint32 keys of float32 scores (unsigned order = float order; no -0.0 is stored)."""
    x = tl.load(scores_ptr + row_off + cols, mask=inb, other=0.0)
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (key ^ -2147483648).to(tl.uint32, bitcast=True)


@triton.jit
def _select_kernel(
    scores_ptr,
    out_ptr,
    token_kv_len_ptr,
    stride_st,
    stride_ot,
    topk,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    BINS: tl.constexpr = 1 << BITS
    PASSES: tl.constexpr = 32 // BITS
    t = tl.program_id(0)
    n = tl.load(token_kv_len_ptr + t)
    row_off = t.to(tl.int64) * stride_st
    out_row = out_ptr + t.to(tl.int64) * stride_ot
    if n <= topk:  # every visible position, then -1 (padding rows: all -1)
        for j0 in range(0, topk, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            tl.store(out_row + j, tl.where(j < n, j, -1), mask=j < topk)
    else:
        bins = tl.arange(0, BINS)
        prefix = tl.zeros((), tl.uint32)  # the threshold's digits chosen so far
        above = tl.zeros((), tl.int32)  # keys above every key matching the prefix
        for p in tl.static_range(PASSES):
            shift = 32 - BITS * (p + 1)
            hist = tl.zeros((BINS,), tl.int32)
            for start in range(0, n, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                inb = cols < n
                u = _keys(scores_ptr, row_off, cols, inb)
                if p > 0:
                    inb = inb & ((u >> (shift + BITS)) == prefix)
                hist += tl.histogram(((u >> shift) & (BINS - 1)).to(tl.int32), BINS, mask=inb)
            # the largest digit d with above + (keys with digit >= d) >= topk
            suffix = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # [BINS] keys with digit >= d
            d = tl.max(tl.where(above + suffix >= topk, bins, 0), axis=0)
            above += tl.sum(tl.where(bins > d, hist, 0), axis=0)
            prefix = (prefix << BITS) | d.to(tl.uint32)
        ties = topk - above  # keys equal to the threshold that are kept: the first `ties` by position
        written = tl.zeros((), tl.int32)
        seen = tl.zeros((), tl.int32)  # keys equal to the threshold before this block
        for start in range(0, n, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inb = cols < n
            u = _keys(scores_ptr, row_off, cols, inb)
            tie = inb & (u == prefix)
            keep = (inb & (u > prefix)) | (tie & (seen + tl.cumsum(tie.to(tl.int32), axis=0) <= ties))
            slot = written + tl.cumsum(keep.to(tl.int32), axis=0) - 1
            tl.store(out_row + slot, cols, mask=keep)
            written += tl.sum(keep.to(tl.int32), axis=0)
            seen += tl.sum(tie.to(tl.int32), axis=0)


def score_rows(index_q, index_w, index_k_cache, block_tables, token_req, token_kv_len, scale, topk, scores, splits):
    """The scoring kernel: scores[t, p] for p < token_kv_len[t] of rows with token_kv_len > topk."""
    num_tokens, num_heads, head_dim = index_q.shape
    dot_f32 = triton_interpreting() and index_q.dtype != torch.float32  # the interpreter's bf16 dot is wrong
    fp32 = index_q.dtype == torch.float32  # an IEEE float32 dot: half the tile, twice the warps (no spills)
    launch(_score_kernel, (num_tokens, splits))(
        index_q, index_w, index_k_cache, scores, block_tables, token_req, token_kv_len, index_q.stride(0),
        index_q.stride(1), index_w.stride(0), index_k_cache.stride(0), index_k_cache.stride(1),
        block_tables.stride(0), scores.stride(0), scale, topk, splits,
        HI=num_heads, HI_PAD=max(16, triton.next_power_of_2(num_heads)), DI=head_dim,
        DI_PAD=max(16, triton.next_power_of_2(head_dim)), PAGE=index_k_cache.shape[1],
        BLOCK_N=BLOCK_N // 2 if fp32 else BLOCK_N, PRECISION="ieee" if fp32 or dot_f32 else "tf32", DOT_F32=dot_f32,
        num_warps=8 if fp32 else 4,
    )  # fmt: skip


def select_rows(scores, token_kv_len, topk, out):
    """The select kernel: out[t] = the top-k positions of scores[t, :token_kv_len[t]], -1 padded."""
    block = min(SELECT_BLOCK, max(16, triton.next_power_of_2(max(scores.shape[1], topk))))
    launch(_select_kernel, (out.shape[0],))(
        scores, out, token_kv_len, scores.stride(0), out.stride(0), topk, BITS=BITS, BLOCK=block, num_warps=8
    )


def indexer_topk_triton(
    index_q, index_k, index_w, index_k_cache, slot_mapping, block_tables, token_req, token_kv_len, scale, topk,
    splits: int | None = None, score_budget: int = SCORE_BUDGET,
) -> torch.Tensor:  # fmt: skip
    """Same contract as indexer_topk_reference. `splits` (programs per row of the scoring grid) and
    `score_budget` (scratch elements, hence rows per chunk) are for tests and benchmarks."""
    if not index_k_cache.is_contiguous():
        raise ValueError("indexer_topk (triton) needs a contiguous index-key cache [blocks, block_size, Di]")
    write_rows_triton(index_k, index_k_cache, slot_mapping)
    num_tokens = index_q.shape[0]
    out = torch.empty(num_tokens, topk, dtype=torch.int32, device=index_q.device)
    if num_tokens == 0:
        return out
    index_q = index_q if index_q.stride(-1) == 1 else index_q.contiguous()
    index_w = index_w if index_w.stride(-1) == 1 else index_w.contiguous()
    span = block_tables.shape[1] * index_k_cache.shape[1]
    rows = max(1, min(num_tokens, score_budget // max(span, 1)))
    scores = torch.empty(rows, max(span, 1), dtype=torch.float32, device=index_q.device)
    s = splits or choose_score_splits(rows, span, index_q.device)
    for t0 in range(0, num_tokens, rows):
        t1 = min(num_tokens, t0 + rows)
        req, kv_len = token_req[t0:t1], token_kv_len[t0:t1]
        if span:
            score_rows(index_q[t0:t1], index_w[t0:t1], index_k_cache, block_tables, req, kv_len, scale, topk, scores, s)
        select_rows(scores, kv_len, topk, out[t0:t1])
    return out
