"""The attention custom ops: `torch.ops.draftgraph.paged_attention` and `torch.ops.draftgraph.mla_attention`.

One opaque node in every traced graph (the compiler splits there). It writes this step's K/V into the
paged caches (declared mutated) and returns causal attention for a flat batch of variable-length
queries. `impl` picks the implementation registered in backends.py.

Registering the op is this module's one import-time action: torch.library registration has to happen
exactly once per process before any graph that names the op is traced or loaded.
"""

from __future__ import annotations

import torch

from draftgraph.models.attention.backends import check_device
from draftgraph.models.attention.mla import check_form, mla_forward
from draftgraph.models.attention.reference import paged_attention_reference
from draftgraph.models.attention.sdpa import paged_attention_sdpa

# The single list of ops the compiler splits graphs at (passes read it from here).
SPLITTING_OPS: list[str] = ["draftgraph::paged_attention", "draftgraph::mla_attention", "draftgraph::piece_boundary"]


@torch.library.custom_op("draftgraph::piece_boundary", mutates_args=("tensors",))
def piece_boundary(tensors: list[torch.Tensor]) -> None:
    """Does nothing to `tensors`: a split point. Around a module call inside a larger traced function (the
    drafter's forward inside the fused draft loop) it makes the call's pieces exactly the module's own, so
    they share its compiled code. Declared as mutating so that no pass drops it; it launches no kernel."""


def mark_piece_boundary(*tensors) -> None:
    """A split point over these tensors while Dynamo traces (eager callers pay nothing)."""
    if torch.compiler.is_compiling():
        piece_boundary([t for t in tensors if t is not None])


@torch.library.custom_op("draftgraph::paged_attention", mutates_args=("k_cache", "v_cache"))
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
        from draftgraph.models.attention.triton_attention import paged_attention_triton

        return paged_attention_triton(*args)
    if impl == "sdpa":
        return paged_attention_sdpa(*args)
    return paged_attention_reference(*args)


@paged_attention.register_fake
def _(q, k, v, k_cache, v_cache, slot_mapping, block_tables, token_req, token_kv_len, scale, window, impl):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.custom_op("draftgraph::mla_attention", mutates_args=("latent_cache", "rope_cache"))
def mla_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    rope_cache: torch.Tensor,
    w_kv_b: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    token_req: torch.Tensor,
    token_kv_len: torch.Tensor,
    scale: float,
    form: str,
    impl: str,
) -> torch.Tensor:
    """Multi-head latent attention: writes this step's latent c [T, r] and RoPE key [T, dr] into the paged
    caches, attends with queries (q_nope [T, H, dn], q_pe [T, H, dr]) in the absorbed or the decompressed
    form (`form`, mla.py) and returns the per-head values [T, H, dv], before o_proj."""
    check_device(impl, q_nope.device.type)
    check_form(form)
    return mla_forward(
        q_nope, q_pe, kv_c, k_pe, latent_cache, rope_cache, w_kv_b, slot_mapping, block_tables, token_req,
        token_kv_len, scale, form, impl,
    )  # fmt: skip


@mla_attention.register_fake
def _(q_nope, q_pe, kv_c, k_pe, latent_cache, rope_cache, w_kv_b, slot_mapping, block_tables, token_req,
      token_kv_len, scale, form, impl):  # fmt: skip
    num_tokens, num_heads, head_nope = q_nope.shape
    head_v = w_kv_b.shape[0] // num_heads - head_nope
    return q_nope.new_empty(num_tokens, num_heads, head_v)
