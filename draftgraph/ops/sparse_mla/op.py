"""DeepSeek Sparse Attention's two custom ops: `torch.ops.draftgraph.indexer_topk` (the lightning indexer:
write this step's index keys, pick each token's top-k visible positions) and
`torch.ops.draftgraph.sparse_mla_attention` (write the latents, MLA over the picked positions only).
reference.py states both contracts (shapes, dtypes, -1 padding, ties); kernels implement them unchanged.

Where they sit in the compiled graph:
- `sparse_mla_attention` is a splitting op (ops/splitting.py), like `mla_attention`: PIECEWISE runs it
  between piece graphs, and its implementations may differ per batch shape there.
- `indexer_topk` is not: it stays inside the compiled piece before the attention. Every implementation of it
  must therefore be capturable for any batch (GraphSupport.ALWAYS: fixed shapes from T, topk and the
  block-table width, no host read), which the reference is and a Triton kernel will be. Splitting there too
  would add one piece per layer and its eager launches to every PIECEWISE step for nothing; vLLM keeps its
  indexer out of graphs only because its prefill path plans on the host. Inductor calls the op in place on
  the index-key cache (no copy of the cache: a mutating custom op on a graph input).

Implementations by name (ops/backends.py, family "sparse_mla"): "triton" runs the Triton kernels
(triton_indexer.py, triton_sparse_mla.py), every other name the PyTorch reference; both read nothing back to
the host. Registering the ops is this module's one import-time action.
"""

from __future__ import annotations

import functools

import torch

from draftgraph.ops.backends import check_device, family_backend
from draftgraph.ops.registry import custom_op


@functools.cache
def _kernels(impl: str):
    """(indexer_topk, sparse_mla) implementations for `impl`: the Triton kernels for "triton" (CUDA, or CPU
    tensors under TRITON_INTERPRET=1), the references for every other name."""
    if impl == "triton":
        from draftgraph.ops.sparse_mla.triton_indexer import indexer_topk_triton
        from draftgraph.ops.sparse_mla.triton_sparse_mla import sparse_mla_triton

        return indexer_topk_triton, sparse_mla_triton
    from draftgraph.ops.sparse_mla.reference import indexer_topk_reference, sparse_mla_reference

    return indexer_topk_reference, sparse_mla_reference


def _check(impl: str, device_type: str) -> None:
    family_backend("sparse_mla", impl)
    check_device(impl, device_type)


@custom_op("draftgraph::indexer_topk", mutates_args=("index_k_cache",))
def indexer_topk(
    index_q: torch.Tensor,
    index_k: torch.Tensor,
    index_w: torch.Tensor,
    index_k_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    token_req: torch.Tensor,
    token_kv_len: torch.Tensor,
    scale: float,
    topk: int,
    impl: str,
) -> torch.Tensor:
    """index_q [T, Hi, Di], index_k [T, Di], index_w [T, Hi] float32, index_k_cache [blocks, block_size, Di]
    -> [T, topk] int32 request-local positions, -1 padded (reference.py)."""
    _check(impl, index_q.device.type)
    return _kernels(impl)[0](
        index_q, index_k, index_w, index_k_cache, slot_mapping, block_tables, token_req, token_kv_len, scale, topk
    )


@indexer_topk.register_fake
def _(index_q, index_k, index_w, index_k_cache, slot_mapping, block_tables, token_req, token_kv_len, scale, topk,
      impl):  # fmt: skip
    return index_q.new_empty(index_q.shape[0], topk, dtype=torch.int32)


@custom_op("draftgraph::sparse_mla_attention", mutates_args=("latent_cache", "rope_cache"))
def sparse_mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    w_kv_b: torch.Tensor,
    topk_indices: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    token_req: torch.Tensor,
    token_kv_len: torch.Tensor,
    scale: float,
    impl: str,
) -> torch.Tensor:
    """Writes this step's latent c [T, r] and RoPE key [T, dr], then MLA (absorbed) with queries q_nope
    [T, H, dn], q_pe [T, H, dr] over the positions in topk_indices [T, k] only; returns [T, H, dv]."""
    _check(impl, q_nope.device.type)
    return _kernels(impl)[1](
        q_nope, q_pe, kv_c, k_pe, latent_cache, rope_cache, w_kv_b, topk_indices, slot_mapping, block_tables,
        token_req, token_kv_len, scale,
    )  # fmt: skip


@sparse_mla_attention.register_fake
def _(q_nope, q_pe, kv_c, k_pe, latent_cache, rope_cache, w_kv_b, topk_indices, slot_mapping, block_tables,
      token_req, token_kv_len, scale, impl):  # fmt: skip
    num_tokens, num_heads, head_nope = q_nope.shape
    head_v = w_kv_b.shape[0] // num_heads - head_nope
    return q_nope.new_empty(num_tokens, num_heads, head_v)
