"""Sparse MLA in Triton (`sparse_mla_attention`, contract in reference.py): the latent / RoPE-key cache write
(triton_absorbed.py's kernel), then the absorbed form over the indexer's picks only: ops/mla/triton_latent.py's
split kernel, the one dense MLA runs over every visible position. Entries < 0 are skipped wherever they are;
a row's loop stops at min(topk, token_kv_len), past which the indexer writes only -1 (its contract: valid
entries first), so a short row costs its length, not topk. Cost O(T * min(topk, kv_len) * H * (r + dr)),
independent of how many tokens are cached.
"""

from __future__ import annotations

import torch

from draftgraph.ops.mla.triton_absorbed import write_rows_triton
from draftgraph.ops.mla.triton_latent import latent_attention_triton
from draftgraph.ops.sparse_mla.reference import absorb_split


def sparse_mla_latent_triton(
    q_lat, q_pe, latent_cache, rope_cache, topk_indices, block_tables, token_req, token_kv_len, scale,
    num_splits: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """sparse_mla_latent_reference's result for picks laid out as the indexer writes them (valid entries
    within the first min(topk, token_kv_len)); the caches already hold this step's rows. num_splits: S for
    tests and benchmarks (default: `choose_num_splits` with ops/mla/triton_latent.py's LATENT_SPLIT_RULE)."""
    return latent_attention_triton(
        q_lat, q_pe, latent_cache, rope_cache, topk_indices, block_tables, token_req, token_kv_len, scale, num_splits
    )


def sparse_mla_triton(
    q_nope, q_pe, kv_c, k_pe, latent_cache, rope_cache, w_kv_b, topk_indices, slot_mapping, block_tables,
    token_req, token_kv_len, scale,
) -> torch.Tensor:  # fmt: skip
    """The whole op (sparse_mla_reference's contract): write the latent and RoPE rows, absorb W_UK (one
    batched matmul over heads), attend the picks in latent space, apply W_UV."""
    write_rows_triton(kv_c, latent_cache, slot_mapping)
    write_rows_triton(k_pe, rope_cache, slot_mapping)
    num_tokens, num_heads, head_nope = q_nope.shape
    w_uk, w_uv = absorb_split(w_kv_b, num_heads, head_nope, latent_cache.shape[-1])  # [H, dn, r], [H, dv, r]
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, r], strided
    lat = sparse_mla_latent_triton(
        q_lat, q_pe, latent_cache, rope_cache, topk_indices, block_tables, token_req, token_kv_len, scale
    )  # [T, H, r]
    return torch.bmm(lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1).contiguous()  # [T, H, dv]
