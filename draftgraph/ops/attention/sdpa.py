"""Paged attention through `torch.nn.functional.scaled_dot_product_attention`: the fast path on the CPU.

The reference (reference.py) gathers every token's keys up to the longest visible length and runs a
float32 softmax per token: exact and simple, but 40-100x slower than transformers on a long prompt. This
implementation reads the batch layout once on the host and attends per run of rows (one request's
consecutive query rows; padding rows, whose visible length is 0, are skipped and stay zero):

- a long run (a prefill or a prefill chunk) gathers its request's K/V from the paged cache once, as
  contiguous [Hkv, S, D] tensors, and calls SDPA with the cheapest mask that is exact: `is_causal` for a
  whole prefill (the rows are keys 0..S-1); on the CPU, a chunk after a cached prefix as the prefix
  without a mask plus the chunk with `is_causal`, merged by log-sum-exp; else a boolean mask built from
  each row's visible length (sliding windows, other devices);
- short runs (decode, 1+K verify, draft steps) are padded into one batched SDPA call per group, bounded
  in gathered elements like the reference.

GQA is SDPA's `enable_gqa`; sliding windows and visible lengths come only from `token_kv_len`, exactly as
the reference reads them, so both accept any batch the metadata builder makes. Inputs stay 4-d (SDPA's
flash kernel on the CPU; 3-d inputs drop to its slow math path). It reads the batch layout back to the
host (one sync per call), so it never sits inside a CUDA graph.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from draftgraph.ops.attention.reference import write_kv_reference

# Runs of at most this many rows are batched together (decode 1, verify 1+K, a draft model's 1+K+1).
SHORT_RUN = 16
# SDPA's CPU flash kernel, which also returns each row's log-sum-exp (GQA included); absent: masks instead.
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
# Gathered K per batched group is [B, S, Hkv, D]; bound it near 64 Mi elements (as the reference does).
_GATHER_BUDGET = 1 << 26


def paged_attention_sdpa(
    q, k, v, k_cache, v_cache, slot_mapping, block_tables, token_req, token_kv_len, scale, window
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]. Returns [T, Hq, D]."""
    write_kv_reference(k, v, k_cache, v_cache, slot_mapping)
    out = torch.zeros_like(q)
    if q.shape[0] == 0:
        return out
    runs = _runs(token_req.cpu().numpy(), token_kv_len.cpu().numpy())
    short = [r for r in runs if r[1] - r[0] <= SHORT_RUN]
    long = [r for r in runs if r[1] - r[0] > SHORT_RUN]
    tables_host = block_tables.cpu().numpy() if long else None
    for run in long:
        _attend_run(q, k_cache, v_cache, block_tables, tables_host, run, scale, window, out)
    for group in _budget_groups(short, k_cache.shape[2] * k_cache.shape[3]):
        _attend_short(q, k_cache, v_cache, block_tables, group, scale, window, out)
    return out


def _runs(req: np.ndarray, kv_len: np.ndarray) -> list[tuple[int, int, int, np.ndarray]]:
    """Maximal runs of consecutive rows of one request that see at least one key: (start, end, request,
    visible lengths of the rows)."""
    valid = kv_len > 0
    cuts = np.flatnonzero((req[1:] != req[:-1]) | (valid[1:] != valid[:-1])) + 1
    bounds = [0, *cuts.tolist(), len(req)]
    return [(s, e, int(req[s]), kv_len[s:e]) for s, e in zip(bounds[:-1], bounds[1:]) if valid[s]]


def _budget_groups(runs: list, per_key: int) -> list[list]:
    """Split runs into groups whose padded gathered keys (count x longest length x per_key) fit the budget."""
    groups, current, longest = [], [], 0
    for run in runs:
        s_len = int(run[3].max())
        if current and (len(current) + 1) * max(longest, s_len) * per_key > _GATHER_BUDGET:
            groups.append(current)
            current, longest = [], 0
        current.append(run)
        longest = max(longest, s_len)
    return groups + [current] if current else groups


def _gather(cache: torch.Tensor, tables: torch.Tensor, first: int, last: int) -> torch.Tensor:
    """Keys first..last-1 of each table's request, contiguous: tables [B, max_blocks] -> [B, Hkv, S, D]."""
    block_size = cache.shape[1]
    b0, b1 = first // block_size, -(-last // block_size)
    blocks = cache[tables[:, b0:b1].long()]  # [B, nb, bs, Hkv, D]
    flat = blocks.flatten(1, 2)[:, first - b0 * block_size : last - b0 * block_size]  # [B, S, Hkv, D]
    return flat.transpose(1, 2)


def _request_kv(cache: torch.Tensor, table: torch.Tensor, table_host: np.ndarray, first: int, last: int):
    """One request's keys first..last-1 as [1, Hkv, S, D]: a view of the cache when its blocks there are
    consecutive (the allocator hands blocks out in order, so a long prompt's usually are), else gathered."""
    block_size = cache.shape[1]
    b0, b1 = first // block_size, -(-last // block_size)
    blocks = table_host[b0:b1]
    if (np.diff(blocks) == 1).all():
        start = int(blocks[0]) * block_size + first - b0 * block_size
        return cache.flatten(0, 1)[start : start + last - first].unsqueeze(0).transpose(1, 2)
    return _gather(cache, table[None], first, last)


def _visible(lens: torch.Tensor, first: int, last: int, window: int) -> torch.Tensor:
    """[..., n] visible lengths -> [..., n, S] boolean mask over keys first..last-1."""
    key_pos = torch.arange(first, last, device=lens.device)
    mask = key_pos < lens[..., None]
    if window > 0:
        mask &= key_pos >= lens[..., None] - window
    return mask


def _attend_run(q, k_cache, v_cache, block_tables, tables_host, run, scale, window, out) -> None:
    start, end, req, lens = run
    n, s_len, lo = end - start, int(lens.max()), int(lens.min())
    if window >= s_len:
        window = 0  # the window reaches past the first key for every row
    first = max(0, lo - window) if window else 0
    keys = _request_kv(k_cache, block_tables[req], tables_host[req], first, s_len).to(q.dtype)  # [1, Hkv, S, D]
    vals = _request_kv(v_cache, block_tables[req], tables_host[req], first, s_len).to(q.dtype)
    qr = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    consecutive = not window and int(lens[-1]) == s_len and bool((np.diff(lens) == 1).all())
    mask, causal = None, False
    if consecutive and n == s_len:
        causal = True  # a whole prefill: row i sees keys 0..i
    elif consecutive and n > 1 and qr.device.type == "cpu" and _CPU_FLASH is not None:
        out[start:end] = _prefix_then_causal(qr, keys, vals, s_len - n, scale)[0].transpose(0, 1)
        return
    elif not (consecutive and n == 1):
        lens_t = torch.from_numpy(lens).to(q.device)
        mask = _visible(lens_t, first, s_len, window)  # [n, S]
    o = F.scaled_dot_product_attention(
        qr, keys, vals, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=keys.shape[1] != q.shape[1]
    )
    out[start:end] = o[0].transpose(0, 1)


def _prefix_then_causal(qr, keys, vals, prefix: int, scale: float) -> torch.Tensor:
    """A chunk after `prefix` cached keys, without a mask: every row sees the whole prefix (no mask) and the
    chunk causally (a square `is_causal` block); the two partial results merge by their log-sum-exps.
    SDPA with a [n, S] boolean mask costs ~1.3x this on the CPU (the mask is expanded and read per tile)."""
    o1, l1 = _CPU_FLASH(qr, keys[:, :, :prefix], vals[:, :, :prefix], 0.0, False, scale=scale)
    o2, l2 = _CPU_FLASH(qr, keys[:, :, prefix:], vals[:, :, prefix:], 0.0, True, scale=scale)
    lse = torch.logaddexp(l1, l2)  # [1, Hq, n] float32
    w1, w2 = (l1 - lse).exp().unsqueeze(-1), (l2 - lse).exp().unsqueeze(-1)
    return (o1.float() * w1 + o2.float() * w2).to(qr.dtype)


def _attend_short(q, k_cache, v_cache, block_tables, group, scale, window, out) -> None:
    """Runs of at most SHORT_RUN rows, padded to [B, Hq, n_max, D] and attended in one call."""
    n_max = max(e - s for s, e, _, _ in group)
    s_max = max(int(lens.max()) for *_, lens in group)
    rows = np.empty((len(group), n_max), dtype=np.int64)
    lens = np.empty((len(group), n_max), dtype=np.int64)
    for i, (s, e, _, run_lens) in enumerate(group):
        rows[i, : e - s], rows[i, e - s :] = np.arange(s, e), e - 1  # padding repeats the last row
        lens[i, : e - s], lens[i, e - s :] = run_lens, run_lens[-1]
    device = q.device
    reqs = torch.tensor([r for _, _, r, _ in group], device=device)
    tables = block_tables[reqs]
    keys = _gather(k_cache, tables, 0, s_max).to(q.dtype)  # [B, Hkv, S, D]
    vals = _gather(v_cache, tables, 0, s_max).to(q.dtype)
    rows_t = torch.from_numpy(rows).to(device)
    qb = q[rows_t].transpose(1, 2)  # [B, Hq, n_max, D]
    mask = _visible(torch.from_numpy(lens).to(device), 0, s_max, window)[:, None]  # [B, 1, n_max, S]
    o = F.scaled_dot_product_attention(
        qb, keys, vals, attn_mask=mask, scale=scale, enable_gqa=keys.shape[1] != q.shape[1]
    ).transpose(1, 2)  # [B, n_max, Hq, D]
    counts = np.array([e - s for s, e, _, _ in group])
    real = torch.from_numpy(np.arange(n_max)[None, :] < counts[:, None]).to(device)  # [B, n_max]: not padding
    out[rows_t[real]] = o[real]
