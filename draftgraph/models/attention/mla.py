"""Multi-head latent attention: which form runs for which rows, and the two forms end to end.

Both forms give the same attention (mla_reference.py states them); they differ in cost. Per head and per
(query row, key) pair the absorbed form does about 2(2r + dr) flops, scoring and accumulating in latent
space (r = 512 in V3); the decompressed form does 2(dn + dr + dv), after rebuilding each key's per-head
K/V once per step (2 r (dn + dv) flops per key and head). So decompressing pays when a request brings more
than about r (dn + dv) / (2r - dn - dv) query rows to the step (171 for V3's ranks), whatever its context
length: long prefills and prefill chunks decompress; decode and verify (a few rows) stay absorbed.

`form`: "absorbed" always absorbs. "auto" looks closer only when the batch's mean rows per request
(tokens / block-table rows: shapes, no sync) reaches that break-even; it then reads the per-token request
and length back to the host once and decompresses the requests at or above it, absorbing the rest.
"decompressed" decompresses every request (tests and benchmarks). Inside a CUDA graph capture every
form runs absorbed: the decompressed form sizes its buffers from the host read, which a capture forbids.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MLA_FORMS = ("auto", "absorbed", "decompressed")


def check_form(form: str) -> None:
    if form not in MLA_FORMS:
        raise ValueError(f"MLA form {form!r} is unknown; choose one of {list(MLA_FORMS)} (set_mla_form).")


def decompress_min_rows(rank: int, head_nope: int, head_v: int) -> int:
    """Query rows per request from which the decompressed form does fewer flops (see the module doc)."""
    saved = 2 * rank - head_nope - head_v  # flops per (row, key, head) saved, over 2
    return math.ceil(rank * (head_nope + head_v) / saved) if saved > 0 else 1 << 30


@dataclass(frozen=True)
class MLAPlan:
    """Which rows run in which form, and the decompressed form's key layout (device tensors)."""

    absorbed_rows: torch.Tensor  # [Ta] int64: rows attended in latent space
    decompressed_rows: torch.Tensor  # [Td] int64: rows of the decompressed requests, in order
    key_slots: torch.Tensor  # [L] int64: cache slots of those requests' keys, request after request
    key_start: torch.Tensor  # [Td] int32: each decompressed row's first key in key_slots
    kv_len: torch.Tensor  # [Td] int32: its visible keys
    q_blocks: torch.Tensor  # [NB, 2] int32: (first, end) row of each tile of one request, in decompressed rows


def plan_mla(form, min_rows, block_tables, token_req, token_kv_len, block_size, block_m) -> MLAPlan | None:
    """None: every row absorbed, decided from shapes alone. Otherwise one host read of the per-token
    request and length, and the split above."""
    num_tokens, num_reqs = token_req.shape[0], block_tables.shape[0]
    capturing = token_req.is_cuda and torch.cuda.is_current_stream_capturing()
    if form == "absorbed" or capturing or num_tokens == 0:
        return None
    if form == "auto" and num_tokens < min_rows * num_reqs:
        return None
    req, kv_len = torch.stack([token_req.int(), token_kv_len.int()]).cpu().long()  # the one host read
    valid = kv_len > 0  # padding rows see nothing: they stay zeros in either form
    rows = torch.bincount(req[valid], minlength=num_reqs)
    context = torch.zeros(num_reqs, dtype=torch.long).scatter_reduce_(0, req[valid], kv_len[valid], "amax")
    long_req = rows >= (1 if form == "decompressed" else min_rows)
    if not bool(long_req.any()):
        return None
    is_long = valid & long_req[req]
    absorbed_rows = torch.nonzero(valid & ~is_long).flatten()
    dec_rows = torch.nonzero(is_long).flatten()
    ctx = torch.where(long_req, context, 0)
    first_key = torch.cumsum(ctx, 0) - ctx  # each decompressed request's keys, one after another
    dec_req = req[dec_rows]
    # Tiles: runs of rows of one request, cut every block_m rows.
    change = torch.ones(dec_rows.shape[0], dtype=torch.bool)
    change[1:] = dec_req[1:] != dec_req[:-1]
    run_start = torch.nonzero(change).flatten().tolist() + [dec_rows.shape[0]]
    tiles = [(s, min(s + block_m, e)) for a, e in zip(run_start, run_start[1:]) for s in range(a, e, block_m)]
    key_req = torch.repeat_interleave(torch.arange(num_reqs), ctx)
    key_pos = torch.arange(key_req.shape[0]) - first_key[key_req]
    device = token_req.device
    key_req, key_pos = key_req.to(device), key_pos.to(device)
    key_slots = block_tables[key_req, key_pos // block_size].long() * block_size + key_pos % block_size
    return MLAPlan(
        absorbed_rows=absorbed_rows.to(device),
        decompressed_rows=dec_rows.to(device),
        key_slots=key_slots,
        key_start=first_key[dec_req].int().to(device),
        kv_len=kv_len[dec_rows].int().to(device),
        q_blocks=torch.tensor(tiles, dtype=torch.int32).view(-1, 2).to(device),
    )


def _kernels(impl: str):
    if impl == "triton":
        from draftgraph.models.attention.triton_mla import mla_latent_triton, write_rows_triton
        from draftgraph.models.attention.triton_mla_decompressed import BLOCK_M, mla_decompressed_triton

        def write(kv_c, k_pe, latent_cache, rope_cache, slot_mapping):
            write_rows_triton(kv_c, latent_cache, slot_mapping)
            write_rows_triton(k_pe, rope_cache, slot_mapping)

        return write, mla_latent_triton, mla_decompressed_triton, BLOCK_M
    from draftgraph.models.attention.mla_reference import mla_decompressed_reference, mla_latent_reference
    from draftgraph.models.attention.reference import write_kv_reference

    return write_kv_reference, mla_latent_reference, mla_decompressed_reference, 64


def mla_forward(
    q_nope, q_pe, kv_c, k_pe, latent_cache, rope_cache, w_kv_b, slot_mapping, block_tables, token_req,
    token_kv_len, scale, form, impl,
) -> torch.Tensor:  # fmt: skip
    """Write this step's latents and RoPE keys, attend, return [T, H, dv] (before o_proj).
    w_kv_b: kv_b's weight [H * (dn + dv), r]."""
    write, latent_attend, decompressed_attend, block_m = _kernels(impl)
    write(kv_c, k_pe, latent_cache, rope_cache, slot_mapping)
    num_tokens, num_heads, head_nope = q_nope.shape
    rank = latent_cache.shape[-1]
    w = w_kv_b.view(num_heads, -1, rank)
    w_uk, w_uv = w.split([head_nope, w.shape[1] - head_nope], dim=1)  # [H, dn, r], [H, dv, r]

    def absorbed(rows):
        sub = (lambda x: x) if rows is None else (lambda x: x.index_select(0, rows))
        q_lat = torch.einsum("thd,hdr->thr", sub(q_nope), w_uk)
        lat = latent_attend(
            q_lat, sub(q_pe).contiguous(), latent_cache, rope_cache, block_tables, sub(token_req),
            sub(token_kv_len), scale,
        )  # fmt: skip
        return torch.einsum("thr,hvr->thv", lat, w_uv)

    min_rows = decompress_min_rows(rank, head_nope, w_uv.shape[1])
    plan = plan_mla(form, min_rows, block_tables, token_req, token_kv_len, latent_cache.shape[1], block_m)
    if plan is None:
        return absorbed(None).contiguous()
    out = q_nope.new_zeros(num_tokens, num_heads, w_uv.shape[1])
    if plan.absorbed_rows.numel():
        out.index_copy_(0, plan.absorbed_rows, absorbed(plan.absorbed_rows).to(out.dtype))
    # Rebuild the decompressed requests' per-head keys and values from their latents: one matmul.
    c = latent_cache.view(-1, rank).index_select(0, plan.key_slots)
    pe = rope_cache.view(-1, rope_cache.shape[-1]).index_select(0, plan.key_slots)
    kv = (c.to(w_kv_b.dtype) @ w_kv_b.t()).view(-1, num_heads, w.shape[1])
    rows = plan.decompressed_rows
    got = decompressed_attend(
        q_nope.index_select(0, rows), q_pe.index_select(0, rows).contiguous(), kv[..., :head_nope], pe.to(kv.dtype),
        kv[..., head_nope:], plan.key_start, plan.kv_len, scale, plan.q_blocks,
    )  # fmt: skip
    out.index_copy_(0, rows, got)
    return out
