"""The paged attention custom op: `torch.ops.draftgraph.paged_attention`.

One opaque node in every traced graph (the compiler splits there). It writes this step's K/V into the
paged caches (declared mutated) and returns causal attention for a flat batch of variable-length
queries. `impl` picks the implementation registered in backends.py.

Registering the op is this module's one import-time action: torch.library registration has to happen
exactly once per process before any graph that names the op is traced or loaded.
"""

from __future__ import annotations

import torch

from draftgraph.ops.attention.reference import paged_attention_reference
from draftgraph.ops.attention.sdpa import paged_attention_sdpa
from draftgraph.ops.backends import check_device
from draftgraph.ops.registry import custom_op


@custom_op("draftgraph::paged_attention", mutates_args=("k_cache", "v_cache"))
def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    token_req: torch.Tensor,
    token_kv_len: torch.Tensor,
    scale: float,
    window: int,
    impl: str,
) -> torch.Tensor:
    check_device(impl, q.device.type)
    args = (q, k, v, k_cache, v_cache, slot_mapping, block_tables, token_req, token_kv_len, scale, window)
    if impl == "triton":
        from draftgraph.ops.attention.triton_attention import paged_attention_triton

        return paged_attention_triton(*args)
    if impl == "sdpa":
        return paged_attention_sdpa(*args)
    return paged_attention_reference(*args)


@paged_attention.register_fake
def _(q, k, v, k_cache, v_cache, slot_mapping, block_tables, token_req, token_kv_len, scale, window, impl):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
