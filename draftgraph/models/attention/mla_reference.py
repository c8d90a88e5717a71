"""PyTorch reference for multi-head latent attention (MLA) over the paged latent cache: the oracle.

The cache holds, per token, the normed latent c [r] and the RoPE key k_pe [d_rope]; the keys of every
head are (c W_UK^h, k_pe) and the values c W_UV^h. In the absorbed form the queries arrive already
multiplied by W_UK (q_lat = q_nope W_UK^h, [T, H, r]), so a score is q_lat . c + q_pe . k_pe and the
output stays in latent space (sum_s p_s c_s, [T, H, r]); the caller applies W_UV. Like the paged
reference it reads the longest visible length back to the host (one sync): never inside a FULL graph.
"""

from __future__ import annotations

import torch

from draftgraph.models.attention.reference import write_kv_reference

_GATHER_BUDGET = 1 << 26


def mla_attention_reference(
    q_lat, q_pe, kv_c, k_pe, latent_cache, rope_cache, slot_mapping, block_tables, token_req, token_kv_len, scale
) -> torch.Tensor:
    """q_lat [T, H, r], q_pe [T, H, dr], kv_c [T, r], k_pe [T, dr]; caches [blocks, block_size, r | dr].
    Returns the latent output [T, H, r]; padding rows (token_kv_len 0) give zeros."""
    write_kv_reference(kv_c, k_pe, latent_cache, rope_cache, slot_mapping)  # any per-token entry shape
    num_tokens, num_heads, rank = q_lat.shape
    block_size = latent_cache.shape[1]
    out = torch.zeros(q_lat.shape, dtype=q_lat.dtype, device=q_lat.device)  # contiguous, as the fake says
    if num_tokens == 0:
        return out
    max_len = int(token_kv_len.max())
    if max_len == 0:
        return out
    flat_c = latent_cache.view(-1, rank)
    flat_pe = rope_cache.view(-1, rope_cache.shape[-1])
    key_pos = torch.arange(max_len, device=q_lat.device)
    chunk = max(1, _GATHER_BUDGET // (max_len * (rank + flat_pe.shape[-1]) * max(1, num_heads // 8)))
    for t0 in range(0, num_tokens, chunk):
        t1 = min(num_tokens, t0 + chunk)
        tables = block_tables[token_req[t0:t1].long()].long()
        slots = tables[:, key_pos // block_size] * block_size + key_pos % block_size  # [C, S]
        c = flat_c[slots].float()  # [C, S, r]
        pe = flat_pe[slots].float()  # [C, S, dr]
        scores = torch.einsum("chr,csr->chs", q_lat[t0:t1].float(), c)
        scores = (scores + torch.einsum("chd,csd->chs", q_pe[t0:t1].float(), pe)) * scale
        visible = key_pos[None, :] < token_kv_len[t0:t1].long()[:, None]
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[t0:t1] = torch.einsum("chs,csr->chr", probs, c).to(q_lat.dtype)
    return out
