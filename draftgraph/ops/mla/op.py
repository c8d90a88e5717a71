"""The MLA custom op: `torch.ops.draftgraph.mla_attention` (forms.py picks and runs the form).

Registering the op is this module's one import-time action (see ops/splitting.py).
"""

from __future__ import annotations

import torch

from draftgraph.ops.backends import check_device
from draftgraph.ops.mla.forms import check_form, mla_forward
from draftgraph.ops.registry import custom_op


@custom_op("draftgraph::mla_attention", mutates_args=("latent_cache", "rope_cache"))
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
    form (`form`, forms.py) and returns the per-head values [T, H, dv], before o_proj."""
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
