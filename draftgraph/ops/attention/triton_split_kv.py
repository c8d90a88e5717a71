"""Split-KV paged attention (flash-decoding): each token's keys are split across programs, then merged.

The unsplit kernel (triton_attention.py) runs one program per (query token, KV head). At batch 1 that is
8 programs for a Llama-1B layer on a 132-SM GPU, each streaming the whole context: most of the GPU idles.
Here the grid is (token, KV head, split): split s of a token covers keys [lo + s*chunk, lo + (s+1)*chunk)
of its visible range [lo, kv_len), chunk = ceil(span / S) rounded up to a whole key tile, so every token
uses all S splits whatever its length. Each program writes its unnormalised output, running max and
sum of exponentials into float32 scratch; a second kernel merges the S partials by log-sum-exp.

Graph safety: the grid depends on host-known numbers only (T, the KV heads, S from `choose_num_splits`);
the chunk bounds are computed on the device from token_kv_len, so a captured graph replays correctly for
any lengths. A split whose chunk is empty (a short token, a padding row with kv_len 0) returns after one
load; the merge recomputes the same bounds (one helper) and skips those partials, never reading them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from draftgraph.ops.attention.triton_common import attend_key_range, load_group_q, merge_split_partials
from draftgraph.ops.backends import triton_dot_settings
from draftgraph.ops.launch import launch, pdl_level
from draftgraph.ops.triton_pdl import pdl_args, pdl_release, pdl_start


@dataclass(frozen=True)
class SplitKVRule:
    """When to split and into how many parts; from host-known sizes only. Calibrated on an H100 (132 SMs) with
    scripts/bench_decode_attention.py at 512, 1k and 8k contexts (docs/history/benchmarks-2026-11.md): the best S
    brought the grid to about 4 programs per SM (512-640) at batch 1 and 8, decode and verify; at 512 keys, 16 splits of
    32 keys still beat the unsplit kernel by 2.3x at batch 1 (launch latency, not bandwidth, bounds it)."""

    min_context: int = 256  # longest context a row can see (block-table width * block size) below which: never
    max_programs_per_sm: float = 4.0  # unsplit programs (T * KV heads) at or above this many per SM: never
    target_programs_per_sm: float = 4.0  # aim for T * KV heads * S near this many per SM
    min_keys_per_split: int = 32  # no more splits than max_context / this
    max_splits: int = 64

    def __post_init__(self):
        for name in ("min_context", "min_keys_per_split", "max_splits"):
            if getattr(self, name) < 1:
                raise ValueError(f"SplitKVRule.{name} = {getattr(self, name)} must be >= 1")
        if not 0 < self.max_programs_per_sm <= self.target_programs_per_sm:
            raise ValueError(
                f"SplitKVRule needs 0 < max_programs_per_sm ({self.max_programs_per_sm}) <= "
                f"target_programs_per_sm ({self.target_programs_per_sm}); raise the target or lower the threshold"
            )


DEFAULT_SPLIT_KV_RULE = SplitKVRule()


def choose_num_splits(
    num_tokens: int, num_kv_heads: int, max_context: int, sm_count: int | None, rule: SplitKVRule | None = None
) -> int:
    """S for the split kernel, or 1 for the unsplit one. A power of two, so few kernel variants compile."""
    rule = rule or DEFAULT_SPLIT_KV_RULE
    programs = num_tokens * num_kv_heads
    if not sm_count or programs == 0 or max_context < rule.min_context:
        return 1
    if programs >= rule.max_programs_per_sm * sm_count:
        return 1
    want = math.ceil(rule.target_programs_per_sm * sm_count / programs)
    cap = min(max_context // rule.min_keys_per_split, rule.max_splits)
    splits = min(want, cap)
    if splits < 2:
        return 1
    below = 1 << (splits.bit_length() - 1)  # powers of two: few kernel variants compile
    above = 2 * below
    return above if above <= cap and splits * splits > below * above else below  # the nearer on a log scale


@triton.jit
def _chunk_bounds(kv_len, window, split, NUM_SPLITS, BLOCK_N: tl.constexpr):
    """Keys [c0, c1) of this split, the first visible key `start`, and how many splits are non-empty."""
    start = tl.where(window > 0, tl.maximum(kv_len - window, 0), 0)
    lo = (start // BLOCK_N) * BLOCK_N
    span = kv_len - lo
    chunk = tl.cdiv(tl.cdiv(span, NUM_SPLITS), BLOCK_N) * BLOCK_N
    chunk = tl.maximum(chunk, BLOCK_N)
    c0 = lo + split * chunk
    c1 = tl.minimum(c0 + chunk, kv_len)
    return start, c0, c1, tl.cdiv(span, chunk)


@triton.jit(do_not_specialize=["NUM_SPLITS"])  # one variant for every S of the rule
def _split_kv_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    acc_ptr,  # [T, Hq, S, D] float32, unnormalised
    m_ptr,  # [T, Hq, S] float32: running max of the scores
    l_ptr,  # [T, Hq, S] float32: sum of exp(score - max)
    block_tables_ptr,
    token_req_ptr,
    token_kv_len_ptr,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    scale,
    window,
    NUM_SPLITS,
    num_heads,
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
    split = tl.program_id(2)
    pdl_start(PDL)
    kv_len = tl.load(token_kv_len_ptr + t)
    start, c0, c1, _ = _chunk_bounds(kv_len, window, split, NUM_SPLITS, BLOCK_N)
    if c0 < c1:  # empty chunks (short tokens, padding rows) write nothing: the merge skips them
        req = tl.load(token_req_ptr + t).to(tl.int64)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D_PAD)
        g_mask = g < GROUP
        heads = kv_head * GROUP + g
        q = load_group_q(q_ptr, t, kv_head, stride_qt, stride_qh, GROUP, GROUP_PAD, HEAD_DIM, D_PAD, DOT_F32)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        m_i, l_i, acc = attend_key_range(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, block_tables_ptr, req, kv_head, c0, c1, start,
            stride_cb, stride_cs, stride_ch, stride_bt, scale, HEAD_DIM, D_PAD, PAGE, BLOCK_N, PRECISION, DOT_F32,
        )  # fmt: skip
        # every non-empty chunk holds a visible key (chunk 0 starts at or before `start`), so m_i is finite
        idx = (t * num_heads + heads).to(tl.int64) * NUM_SPLITS + split  # [GROUP_PAD]
        tl.store(m_ptr + idx, m_i, mask=g_mask)
        tl.store(l_ptr + idx, l_i, mask=g_mask)
        tl.store(acc_ptr + idx[:, None] * HEAD_DIM + d[None, :], acc, mask=g_mask[:, None] & (d < HEAD_DIM)[None, :])
    pdl_release(PDL)


@triton.jit(do_not_specialize=["NUM_SPLITS"])
def _merge_kernel(
    acc_ptr,
    m_ptr,
    l_ptr,
    out_ptr,
    token_kv_len_ptr,
    stride_ot,
    stride_oh,
    window,
    NUM_SPLITS,
    num_heads,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    pdl_start(PDL)
    kv_len = tl.load(token_kv_len_ptr + t)
    _, _, _, used = _chunk_bounds(kv_len, window, 0, NUM_SPLITS, BLOCK_N)
    base = (t * num_heads + h).to(tl.int64) * NUM_SPLITS
    out = merge_split_partials(acc_ptr, m_ptr, l_ptr, base, used, HEAD_DIM, S_PAD, D_PAD)  # padding rows -> zeros
    pdl_release(PDL)
    d = tl.arange(0, D_PAD)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def attend_split_kv(q, k_cache, v_cache, block_tables, token_req, token_kv_len, scale, window, num_splits):
    """Attention of q [T, Hq, D] over the paged caches with each token's keys split `num_splits` ways.
    Same result as the unsplit kernel (float32 partials; only the summation order differs). The partials are
    merged by a second kernel: merging them in each token's last split to finish (an atomic counter per token
    and KV head) made the split kernel 9.8 us against 4.1 + 1.8 us for the two at plain decode B=1 on an H100
    (docs/history/benchmarks-2026-11.md, 2026-11-26)."""
    if num_splits < 1:
        raise ValueError(f"num_splits = {num_splits} must be >= 1 (choose_num_splits picks one)")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    acc = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    m = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    block_n = 32 if d_pad >= 256 else 64
    dot_f32, precision = triton_dot_settings(q.dtype)
    pdl = pdl_args(pdl_level(q.device))
    launch(_split_kv_kernel, (num_tokens, num_kv_heads, num_splits))(
        q,
        k_cache,
        v_cache,
        acc,
        m,
        l_sum,
        block_tables,
        token_req,
        token_kv_len,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        scale,
        window,
        num_splits,
        num_heads,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        PAGE=k_cache.shape[1],
        BLOCK_N=block_n,
        PRECISION=precision,
        DOT_F32=dot_f32,
        num_warps=4,
        **pdl,
    )
    launch(_merge_kernel, (num_tokens, num_heads))(
        acc,
        m,
        l_sum,
        out,
        token_kv_len,
        out.stride(0),
        out.stride(1),
        window,
        num_splits,
        num_heads,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        S_PAD=max(2, triton.next_power_of_2(num_splits)),
        BLOCK_N=block_n,
        num_warps=1,
        **pdl,
    )
    return out
