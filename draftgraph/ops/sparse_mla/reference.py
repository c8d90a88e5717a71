"""PyTorch references for DeepSeek Sparse Attention (V3.2): the lightning indexer's top-k and MLA over the
selected tokens. These are the oracles the Triton kernels are checked against; self-contained on purpose.

They read nothing back to the host: every shape comes from T (tokens), topk and the block-table width W, so
they run inside CUDA graphs (FULL and piece graphs) on any device. They scale with W * block_size (every
position a request could hold), not with the visible lengths: fine for an oracle, not for long contexts.

Shared inputs (the paged layout of ops/attention/metadata.py; one slot addresses all three caches):
- slot_mapping [T] int64: where token t's rows go (block * block_size + offset); -1 = padding, no write.
- block_tables [R, W] int32, token_req [T] int32: token t reads request token_req[t]'s blocks.
- token_kv_len [T] int32: token t sees positions 0 .. token_kv_len[t] - 1 of its request (itself included;
  a verify row j of 1+K sees its prefix and rows 0..j); 0 for padding rows.

Contract of `indexer_topk_reference` (= torch.ops.draftgraph.indexer_topk):
- index_q [T, Hi, Di] (model dtype; RoPE already on dims [0:rope_dim]), index_k [T, Di] (same dtype),
  index_w [T, Hi] float32 (weights_proj(x) * Hi^-0.5), index_k_cache [num_blocks, block_size, Di], scale
  (Di^-0.5), topk >= 1.
- First writes index_k[t] at slot_mapping[t] (rows with slot -1 write nothing), then scores with the cache
  (so tokens of one step see each other's keys).
- Score of position p for token t, in float32: I[t, p] = sum_h index_w[t, h] * ReLU(scale * q[t, h] . k[p]).
- Returns [T, topk] int32 of request-local positions (not slots). The first n = min(topk, token_kv_len[t])
  entries are the n visible positions of highest score, then -1. Ties at the boundary go to the lower
  position. The order inside the first n is not part of the contract (this reference: by score, then by
  position); consumers treat a row as a set.

Contract of `sparse_mla_reference` (= torch.ops.draftgraph.sparse_mla_attention):
- q_nope [T, H, dn], q_pe [T, H, dr] (RoPE applied), kv_c [T, r], k_pe [T, dr] (RoPE applied): this step's
  latent and RoPE key; latent_cache [num_blocks, block_size, r], rope_cache [num_blocks, block_size, dr];
  w_kv_b [H * (dn + dv), r] (kv_b's weight: per head W_UK [dn, r] then W_UV [dv, r]); topk_indices [T, k]
  int32 as returned by the indexer (entries < 0 are skipped wherever they are; the indexer puts them last).
- First writes kv_c and k_pe at slot_mapping (like mla_attention), then for each token attends over the
  selected positions p (slot block_tables[token_req[t], p // block_size] * block_size + p % block_size):
  score_h(p) = scale * (q_nope[t, h] W_UK^h . c_p + q_pe[t, h] . pe_p), softmax over the selected p in float32,
  output o[t, h] = (sum_p softmax_p c_p) W_UV^h^T. Returns [T, H, dv] in q_nope's dtype; a row with no
  selected position returns zeros. A kernel implements `sparse_mla_latent_reference` (the absorbed core,
  latent space in and out); the op does the two per-head matmuls around it.
"""

from __future__ import annotations

import torch

_SCORE_BUDGET = 1 << 25  # float32 elements of the indexer's per-chunk gather + scores
_GATHER_BUDGET = 1 << 25  # elements of the sparse attention's per-chunk gathered latents


def write_rows_reference(src: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache.view(-1, row)[slot_mapping[t]] = src[t] for rows with slot >= 0, without a host read: padding
    rows rewrite the first valid row's slot with that row's value (or slot 0 with its own value when no row
    is valid), so duplicate indices always carry equal values and the result is deterministic."""
    flat = cache.view(-1, *cache.shape[2:])
    if src.shape[0] == 0:
        return
    valid = slot_mapping >= 0  # [T]
    first = torch.argmax(valid.int()).view(1)  # the first valid row, 0 when none is (a tensor index: no sync)
    any_valid = valid[first]  # [1]
    fill_slot = torch.where(any_valid, slot_mapping[first], 0)  # [1]
    shape = (-1,) + (1,) * (src.dim() - 1)
    fill_row = torch.where(any_valid.view(shape), src[first].to(cache.dtype), flat[:1])  # [1, ...]
    slots = torch.where(valid, slot_mapping, fill_slot)
    rows = torch.where(valid.view(shape), src.to(cache.dtype), fill_row)
    flat.index_copy_(0, slots, rows)


def _slots(block_tables, req, positions, block_size):
    """Slots of request-local `positions` [C, N] (any value; negatives read block 0) of requests `req` [C]."""
    tables = block_tables[req.long()].long()  # [C, W]
    pos = positions.clamp(min=0, max=tables.shape[1] * block_size - 1)
    return tables.gather(1, pos // block_size) * block_size + pos % block_size


def indexer_topk_reference(
    index_q, index_k, index_w, index_k_cache, slot_mapping, block_tables, token_req, token_kv_len, scale, topk
) -> torch.Tensor:
    """The lightning indexer: write this step's keys, score every visible position, keep the top `topk`."""
    write_rows_reference(index_k, index_k_cache, slot_mapping)
    num_tokens, num_heads, head_dim = index_q.shape
    block_size = index_k_cache.shape[1]
    span = block_tables.shape[1] * block_size  # every position a request can hold
    out = torch.full((num_tokens, topk), -1, dtype=torch.int32, device=index_q.device)
    if num_tokens == 0 or span == 0:
        return out
    keep = min(topk, span)
    flat = index_k_cache.view(-1, head_dim)
    pos = torch.arange(span, device=index_q.device)
    chunk = max(1, _SCORE_BUDGET // (span * (head_dim + num_heads)))
    for t0 in range(0, num_tokens, chunk):
        t1 = min(num_tokens, t0 + chunk)
        keys = flat[_slots(block_tables, token_req[t0:t1], pos.expand(t1 - t0, span), block_size)].float()
        dots = torch.einsum("chd,cnd->chn", index_q[t0:t1].float(), keys)  # [C, Hi, N]
        scores = torch.relu(dots * scale)
        index = torch.matmul(index_w[t0:t1].float().unsqueeze(1), scores).squeeze(1)  # [C, N]: sum over heads
        kv_len = token_kv_len[t0:t1].long()[:, None]
        index = index.masked_fill(pos[None, :] >= kv_len, float("-inf"))
        # Stable descending sort: equal scores keep ascending positions, so ties go to the lower position.
        order = torch.sort(index, dim=-1, descending=True, stable=True).indices[:, :keep]
        # Visible positions sort before the masked ones, so the first min(topk, kv_len) entries are the picks.
        picked = torch.arange(keep, device=index_q.device)[None, :] < kv_len
        out[t0:t1, :keep] = torch.where(picked, order, -1).to(torch.int32)
    return out


def sparse_mla_latent_reference(
    q_lat, q_pe, latent_cache, rope_cache, topk_indices, block_tables, token_req, scale
) -> torch.Tensor:
    """Absorbed sparse MLA core. q_lat [T, H, r] (q_nope W_UK), q_pe [T, H, dr]; caches already hold this
    step's rows. Returns sum_p softmax_p c_p over the selected positions, [T, H, r] in q_lat's dtype."""
    num_tokens, num_heads, rank = q_lat.shape
    block_size = latent_cache.shape[1]
    out = torch.zeros(q_lat.shape, dtype=q_lat.dtype, device=q_lat.device)
    if num_tokens == 0 or topk_indices.shape[1] == 0:
        return out
    flat_c = latent_cache.view(-1, rank)
    flat_pe = rope_cache.view(-1, rope_cache.shape[-1])
    k = topk_indices.shape[1]
    chunk = max(1, _GATHER_BUDGET // (k * (rank + flat_pe.shape[-1] + num_heads)))
    for t0 in range(0, num_tokens, chunk):
        t1 = min(num_tokens, t0 + chunk)
        idx = topk_indices[t0:t1].long()  # [C, k]
        valid = idx >= 0
        slots = _slots(block_tables, token_req[t0:t1], idx, block_size)
        c = torch.where(valid[..., None], flat_c[slots].float(), 0.0)  # [C, k, r]
        pe = torch.where(valid[..., None], flat_pe[slots].float(), 0.0)  # [C, k, dr]
        scores = torch.einsum("chr,ckr->chk", q_lat[t0:t1].float(), c)
        scores = (scores + torch.einsum("chd,ckd->chk", q_pe[t0:t1].float(), pe)) * scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with nothing selected -> zeros
        out[t0:t1] = torch.einsum("chk,ckr->chr", probs, c).to(q_lat.dtype)
    return out


def absorb_split(w_kv_b: torch.Tensor, num_heads: int, head_nope: int, rank: int):
    """kv_b's weight [H * (dn + dv), r] -> W_UK [H, dn, r], W_UV [H, dv, r]."""
    w = w_kv_b.view(num_heads, -1, rank)
    return w.split([head_nope, w.shape[1] - head_nope], dim=1)


def sparse_mla_reference(
    q_nope, q_pe, kv_c, k_pe, latent_cache, rope_cache, w_kv_b, topk_indices, slot_mapping, block_tables,
    token_req, token_kv_len, scale,
) -> torch.Tensor:  # fmt: skip
    """The whole sparse MLA op: write the latent and RoPE rows, absorb, attend the selection, un-absorb.
    token_kv_len is part of the signature for kernels (valid entries are the first min(k, kv_len)); the
    reference relies on the -1 padding alone."""
    write_rows_reference(kv_c, latent_cache, slot_mapping)
    write_rows_reference(k_pe, rope_cache, slot_mapping)
    num_tokens, num_heads, head_nope = q_nope.shape
    w_uk, w_uv = absorb_split(w_kv_b, num_heads, head_nope, latent_cache.shape[-1])  # [H, dn, r], [H, dv, r]
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, r]
    lat = sparse_mla_latent_reference(
        q_lat, q_pe, latent_cache, rope_cache, topk_indices, block_tables, token_req, scale
    )  # [T, H, r]
    return torch.bmm(lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1).contiguous()  # [T, H, dv]
