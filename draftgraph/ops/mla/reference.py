"""PyTorch references for multi-head latent attention (MLA): the oracles for the Triton kernels.

The paged cache holds, per token, the normed latent c [r] and the RoPE key k_pe [d_rope]; the keys of
head h are (c W_UK^h, k_pe) and its values c W_UV^h (W_UK, W_UV: kv_b's two halves). Two forms compute
the same attention (forms.py chooses between them):

- absorbed (`mla_latent_reference`): queries arrive multiplied by W_UK (q_lat = q_nope W_UK^h, [T, H, r]),
  a score is q_lat . c + q_pe . k_pe and the output stays in latent space (sum_s p_s c_s, [T, H, r]);
- decompressed (`mla_decompressed_reference`): per-head keys and values were rebuilt from the latents
  once (flat [L, H, dn] / [L, H, dv] plus the shared [L, dr] RoPE keys), and each query token attends to
  its own contiguous key range: plain multi-head attention with head dims dn + dr and dv.

Both read the longest visible length back to the host (one sync): never inside a FULL graph.
"""

from __future__ import annotations

import torch

_GATHER_BUDGET = 1 << 26


def mla_latent_reference(
    q_lat, q_pe, latent_cache, rope_cache, block_tables, token_req, token_kv_len, scale
) -> torch.Tensor:
    """q_lat [T, H, r], q_pe [T, H, dr]; caches [blocks, block_size, r | dr], already holding this step's
    rows. Returns the latent output [T, H, r]; padding rows (token_kv_len 0) give zeros."""
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


def mla_decompressed_reference(
    q_nope, q_pe, k_nope, k_pe, v, token_key_start, token_kv_len, scale, q_blocks=None
) -> torch.Tensor:
    """q_nope [T, H, dn], q_pe [T, H, dr]; k_nope [L, H, dn], k_pe [L, dr], v [L, H, dv]. Token t attends to
    keys token_key_start[t] .. + token_kv_len[t] - 1. Returns [T, H, dv] (rows with no key: zeros).
    `q_blocks` (the Triton kernel's tiling) is accepted and unused, so both share one signature."""
    num_tokens, num_heads, _ = q_nope.shape
    out = torch.zeros(num_tokens, num_heads, v.shape[-1], dtype=q_nope.dtype, device=q_nope.device)
    if num_tokens == 0:
        return out
    max_len = int(token_kv_len.max())
    if max_len == 0:
        return out
    key_pos = torch.arange(max_len, device=q_nope.device)
    width = num_heads * (k_nope.shape[-1] + v.shape[-1]) + k_pe.shape[-1]
    chunk = max(1, _GATHER_BUDGET // (max_len * width))
    for t0 in range(0, num_tokens, chunk):
        t1 = min(num_tokens, t0 + chunk)
        visible = key_pos[None, :] < token_kv_len[t0:t1].long()[:, None]  # [C, S]
        rows = torch.where(visible, token_key_start[t0:t1].long()[:, None] + key_pos[None, :], 0)
        scores = torch.einsum("chd,cshd->chs", q_nope[t0:t1].float(), k_nope[rows].float())
        scores = (scores + torch.einsum("chd,csd->chs", q_pe[t0:t1].float(), k_pe[rows].float())) * scale
        scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[t0:t1] = torch.einsum("chs,cshd->chd", probs, v[rows].float()).to(q_nope.dtype)
    return out
