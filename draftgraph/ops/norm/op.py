"""RMSNorm as custom ops: `torch.ops.draftgraph.rms_norm(x, weight, eps)` and
`torch.ops.draftgraph.add_rms_norm(x, residual, weight, eps) -> (x + residual, its norm)`.

The norm is the Llama one, `weight * (x / rms(x))` with the product in x's dtype, computed as
models/layers.py's RMSNorm always did (the reference here, on every device but CUDA). On CUDA each op is one
Triton kernel (triton_rms_norm.py), which a compiled piece calls as one opaque node: a layer's norms and residual
add are two launches instead of Inductor's four or five (a reduction then a pointwise kernel per norm). Outputs
are new contiguous tensors. Registering the ops is this module's one import-time action; Triton loads on the first
CUDA call.
"""

from __future__ import annotations

import torch

from draftgraph.ops.registry import custom_op


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf.to(x.dtype)).contiguous()


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() not in (2, 3) or weight.shape != (x.shape[-1],):
        raise ValueError(
            f"rms_norm takes x [N, H] or [T, heads, H] and weight [H]; got x {tuple(x.shape)}, weight "
            f"{tuple(weight.shape)}"
        )


@custom_op("draftgraph::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / rms(x) over the last dim, in x's dtype."""
    if x.is_cuda:
        from draftgraph.ops.norm.triton_rms_norm import rms_norm_triton

        return rms_norm_triton(x, None, weight, eps)[1]
    return rms_norm_reference(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    _check(x, weight)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@custom_op("draftgraph::add_rms_norm", mutates_args=())
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, norm) with s = x + residual in x's dtype (the residual stream) and norm = rms_norm(s, weight, eps)."""
    if x.is_cuda:
        from draftgraph.ops.norm.triton_rms_norm import rms_norm_triton

        return rms_norm_triton(x, residual, weight, eps)
    s = (x + residual).contiguous()
    return s, rms_norm_reference(s, weight, eps)


@add_rms_norm.register_fake
def _(x, residual, weight, eps):
    _check(x, weight)
    return torch.empty(x.shape, dtype=x.dtype, device=x.device), torch.empty(x.shape, dtype=x.dtype, device=x.device)
