"""PyTorch reference for paged attention: the oracle every other implementation is checked against.

Plain tensor code on any device. It reads the longest visible length back to the host (one sync), so it
runs between graph pieces (PIECEWISE) but is never captured inside a FULL graph.
"""

from __future__ import annotations

import torch

# Gathered keys per chunk are [chunk, S, Hkv, D]; bound the chunk so that stays near 64 Mi elements.
_GATHER_BUDGET = 1 << 26


def write_kv_reference(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Write this step's K/V rows into the paged caches; slot -1 rows are skipped."""
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[valid].to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[valid].to(v_cache.dtype))


def paged_attention_reference(
    q, k, v, k_cache, v_cache, slot_mapping, block_tables, token_req, token_kv_len, scale, window
) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]. Returns [T, Hq, D]."""
    write_kv_reference(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    if num_tokens == 0:
        return out
    max_len = int(token_kv_len.max())
    if max_len == 0:
        return out
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    key_pos = torch.arange(max_len, device=q.device)  # [S]
    chunk = max(1, _GATHER_BUDGET // (max_len * num_kv_heads * head_dim))
    for t0 in range(0, num_tokens, chunk):
        t1 = min(num_tokens, t0 + chunk)
        tables = block_tables[token_req[t0:t1].long()].long()  # [C, max_blocks]
        slots = tables[:, key_pos // block_size] * block_size + key_pos % block_size  # [C, S]
        keys = flat_k[slots].float()  # [C, S, Hkv, D]
        vals = flat_v[slots].float()
        qc = q[t0:t1].float().view(t1 - t0, num_kv_heads, group, head_dim)  # [C, Hkv, G, D]
        scores = torch.einsum("chgd,cshd->chgs", qc, keys) * scale  # [C, Hkv, G, S]
        kv_len = token_kv_len[t0:t1].long()[:, None]  # [C, 1]
        visible = key_pos[None, :] < kv_len
        if window > 0:
            visible &= key_pos[None, :] >= kv_len - window
        scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with nothing visible -> 0
        oc = torch.einsum("chgs,cshd->chgd", probs, vals)
        out[t0:t1] = oc.reshape(t1 - t0, num_heads, head_dim).to(q.dtype)
    return out
