"""Triton grouped matmul for the routed experts, with no host sync and a grid fixed by the token count.

The P = T x k (token, expert) pairs are sorted by expert on the device and laid out in tiles of BM rows,
each expert's run padded to a whole number of tiles, so each tile belongs to one expert. The grid has
room for the worst case (P + E (BM - 1) rows); tiles past the real padded total exit at once. Each tile
multiplies its rows by its expert's weight: only chosen experts' weights are read. gate_up, SiLU-and-
multiply, then down with the routing weight applied, then the k rows of each token are summed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from draftgraph.ops.backends import triton_interpreting
from draftgraph.ops.launch import launch


@triton.jit(do_not_specialize=["num_pairs"])  # pairs = tokens x k: one compiled variant for every batch
def _grouped_gemm_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_ids_ptr,
    tile_expert_ptr,
    total_ptr,
    weights_ptr,
    num_pairs,
    N,
    K,
    stride_am,
    stride_we,
    stride_wn,
    stride_om,
    ROWS_PER_A: tl.constexpr,  # k: pairs per token row of `a` (1 when `a` has a row per pair)
    MUL_WEIGHT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BM >= tl.load(total_ptr):
        return
    pair = tl.load(sorted_ids_ptr + pid_m * BM + tl.arange(0, BM))
    p_mask = pair < num_pairs
    a_row = (pair // ROWS_PER_A).to(tl.int64)
    expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    n = pid_n * BN + tl.arange(0, BN)
    n_mask = n < N
    acc = tl.zeros([BM, BN], tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + tl.arange(0, BK)
        k_mask = kk < K
        a = tl.load(a_ptr + a_row[:, None] * stride_am + kk[None, :], mask=p_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(
            w_ptr + expert * stride_we + n[None, :] * stride_wn + kk[:, None],
            mask=k_mask[:, None] & n_mask[None, :],
            other=0.0,
        )  # [BK, BN]
        acc += tl.dot(a, w, input_precision=PRECISION)
    if MUL_WEIGHT:
        acc *= tl.load(weights_ptr + pair, mask=p_mask, other=0.0)[:, None]
    tl.store(
        out_ptr + pair.to(tl.int64)[:, None] * stride_om + n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=p_mask[:, None] & n_mask[None, :],
    )


def align_pairs(ids: torch.Tensor, num_experts: int, bm: int):
    """(sorted pair ids [tiles * bm] with num_pairs as padding, expert per tile [tiles], padded total [1])."""
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + bm - 1) // bm * bm
    ends = padded.cumsum(0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    expert_sorted = flat[order]
    rank = torch.arange(num_pairs, device=ids.device) - (counts.cumsum(0) - counts)[expert_sorted]
    tiles = triton.cdiv(num_pairs + num_experts * (bm - 1), bm)
    sorted_ids = torch.full((tiles * bm,), num_pairs, dtype=torch.int64, device=ids.device)
    sorted_ids.scatter_(0, starts[expert_sorted] + rank, order)
    tile_start = torch.arange(tiles, device=ids.device) * bm
    tile_expert = torch.searchsorted(ends, tile_start, right=True).clamp_(max=num_experts - 1)
    return sorted_ids, tile_expert, ends[-1:], tiles


def _gemm(a, w, sorted_ids, tile_expert, total, tiles, weights, num_pairs, rows_per_a, bm, out_dtype):
    n, k = w.shape[1], w.shape[2]
    out = torch.empty(num_pairs, n, dtype=out_dtype, device=a.device)
    bn, bk = 64, 64
    fp32 = a.dtype == torch.float32
    launch(_grouped_gemm_kernel, (tiles, triton.cdiv(n, bn)))(
        a,
        w,
        out,
        sorted_ids,
        tile_expert,
        total,
        weights if weights is not None else out,
        num_pairs,
        n,
        k,
        a.stride(0),
        w.stride(0),
        w.stride(1),
        out.stride(0),
        ROWS_PER_A=rows_per_a,
        MUL_WEIGHT=weights is not None,
        BM=bm,
        BN=bn,
        BK=bk,
        PRECISION="ieee" if fp32 or triton_interpreting() else "tf32",
        num_warps=4,
    )
    return out


def moe_experts_triton(x, gate_up, down, ids, weights) -> torch.Tensor:
    num_tokens, top_k = ids.shape
    num_experts, inter = gate_up.shape[0], down.shape[2]
    if num_tokens == 0:
        return torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    if not (gate_up.is_contiguous() and down.is_contiguous()):
        raise ValueError("MoE experts (triton) need contiguous expert weights [E, N, K]")
    x = x.contiguous()
    if triton_interpreting() and x.dtype != torch.float32:  # the interpreter's low-precision dot is wrong
        return moe_experts_triton(x.float(), gate_up.float(), down.float(), ids, weights).to(x.dtype)
    num_pairs = num_tokens * top_k
    bm = 16 if num_pairs <= 512 else 64
    sorted_ids, tile_expert, total, tiles = align_pairs(ids, num_experts, bm)
    args = (sorted_ids, tile_expert, total, tiles)
    h = _gemm(x, gate_up, *args, None, num_pairs, top_k, bm, x.dtype)  # [P, 2I]
    act = F.silu(h[:, :inter]) * h[:, inter:]
    y = _gemm(act, down, *args, weights.reshape(-1).float().contiguous(), num_pairs, 1, bm, torch.float32)
    return y.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)
