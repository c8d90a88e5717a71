"""`torch.ops.draftgraph.rope_qkv(q, k, v, cos, sin) -> (q', k', v')`: RoPE (rotate-half layout) on the queries
and keys of a fused QKV projection, and the values made contiguous.

The Llama attention's q and k rotations and the copy of v out of the QKV output were three Inductor kernels per
layer, each about a microsecond at decode sizes (docs/history/benchmarks-2026-11.md, 2026-11-26); on CUDA this op is
one Triton kernel (triton_rope.py; a program per token and head) reading the strided views once and writing three new
contiguous tensors. Off CUDA it is `rotate_half`, the torch code models/rope.py's apply_rope always ran. Values
equal: the rotation in float32, rounded once to the input dtype. Registering the op is this module's one
import-time action.
"""

from __future__ import annotations

import torch

from draftgraph.ops.registry import custom_op


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, head_dim // 2] (neox / rotate-half layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def _check(q, k, v, cos, sin) -> None:
    t, _, d = q.shape
    ok = q.dim() == k.dim() == v.dim() == 3 and k.shape[-1] == v.shape[-1] == d and d % 2 == 0
    ok = ok and k.shape[0] == v.shape[0] == t and cos.shape == sin.shape == (t, d // 2) and k.shape[1] == v.shape[1]
    if not ok:
        raise ValueError(
            "rope_qkv takes q [T, Hq, D], k and v [T, Hkv, D] (D even), cos and sin [T, D/2]; got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
        )


def kernel_takes(head_dim: int) -> bool:
    """Whether the Triton kernel takes this head size (half of it a power of two: 64, 128, 256, ...)."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half > 0 and half & (half - 1) == 0


@custom_op("draftgraph::rope_qkv", mutates_args=())
def rope_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rotate_half(q), rotate_half(k), v contiguous), each a new tensor."""
    if q.is_cuda:
        from draftgraph.ops.rope.triton_rope import rope_qkv_triton

        return rope_qkv_triton(q, k, v, cos, sin)
    return rotate_half(q, cos, sin), rotate_half(k, cos, sin), v.clone(memory_format=torch.contiguous_format)


@rope_qkv.register_fake
def _(q, k, v, cos, sin):
    _check(q, k, v, cos, sin)
    return (
        q.new_empty(q.shape),
        k.new_empty(k.shape),
        v.new_empty(v.shape),
    )


@custom_op("draftgraph::rope_qkv_write", mutates_args=("k_cache", "v_cache"))
def rope_qkv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """`rope_qkv` whose rotated keys and the values go straight into the paged caches at `slot_mapping` (slot -1:
    skipped), as the attention op's KV write would put them; returns the rotated queries. The attention op then
    gets no rows to write: the KV write's kernel goes. The Llama attention's default on CUDA with the Triton
    attention (OpChoices.rope_kv_write off turns it off): 1.0-1.3 % off plain decode at batch 1, 8 and 32 on an
    H100 (docs/history/benchmarks-2026-11.md)."""
    if q.is_cuda:
        from draftgraph.ops.rope.triton_rope import rope_qkv_write_triton

        return rope_qkv_write_triton(q, k, v, cos, sin, k_cache, v_cache, slot_mapping)
    from draftgraph.ops.attention.reference import write_kv_reference

    write_kv_reference(rotate_half(k, cos, sin), v, k_cache, v_cache, slot_mapping)
    return rotate_half(q, cos, sin)


@rope_qkv_write.register_fake
def _(q, k, v, cos, sin, k_cache, v_cache, slot_mapping):
    _check(q, k, v, cos, sin)
    return q.new_empty(q.shape)
