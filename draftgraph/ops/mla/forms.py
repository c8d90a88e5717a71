"""Multi-head latent attention: which form runs for which rows, and the two forms end to end.

Both forms give the same attention (reference.py states them); they differ in cost. Per head and per
causal (query row, key) pair the absorbed form does 2(2r + dr) flops, scoring and accumulating in latent
space (r = 512 in V3); the decompressed form does 2(dn + dr + dv), after rebuilding each key's per-head
K/V once per step (2 r (dn + dv) flops per key and head), and its buffers are sized on the host.

`form`: "absorbed" always absorbs. "decompressed" decompresses every request (tests, benchmarks).
"auto" picks per request with `MLACost`, a cost model measured on the GPU (scripts/bench_mla_prefill.py):
- from shapes alone, a batch where no request can bring `gate_rows` query rows (tokens - requests + 1
  under it: decode, verify of small batches) absorbs with no host read;
- otherwise the per-token request and visible length are read back once per forward (the plan is reused
  by every layer), and a request decompresses
  when its causal pairs times the per-pair saving outweigh rebuilding its keys; if the batch's total
  saving is under the decompressed path's fixed cost, everything absorbs. The rebuilt K/V of one forward
  stays under `workspace_bytes` (1 GiB): requests past it absorb.
Inside a CUDA graph capture every form runs absorbed: the decompressed form needs that host read.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import numpy as np
import torch

MLA_FORMS = ("auto", "absorbed", "decompressed")


def check_form(form: str) -> None:
    if form not in MLA_FORMS:
        raise ValueError(f"MLA form {form!r} is unknown; choose one of {list(MLA_FORMS)} (set_mla_form).")


@dataclass(frozen=True)
class MLACost:
    """Time per head of each part, in picoseconds, and the decompressed path's fixed cost in
    microseconds (host plan, gathers, launches). Defaults: H100, bf16, V3's ranks
    (docs/history/benchmarks-2026-11.md)."""

    absorbed_pair_ps: float = 27.0  # one causal (row, key) pair, absorbed kernel
    decompressed_pair_ps: float = 5.0  # one pair, decompressed kernel
    key_ps: float = 520.0  # rebuilding one key's K/V (the kv_b matmul)
    fixed_us: float = 150.0
    gate_rows: int = 64  # no request can have this many rows: absorbed from shapes alone
    workspace_bytes: int = 1 << 30  # cap on the rebuilt K/V of one forward; requests past it absorb

    def saving_us(self, heads, pairs, keys):
        """Per request: absorbed minus decompressed time, fixed cost excluded."""
        per_pair = self.absorbed_pair_ps - self.decompressed_pair_ps
        return heads * (pairs * per_pair - keys * self.key_ps) * 1e-6


DEFAULT_COST = MLACost()


@dataclass(frozen=True)
class MLAPlan:
    """Which rows run in which form, and the decompressed form's key layout (device tensors)."""

    absorbed_rows: torch.Tensor  # [Ta] int64: rows attended in latent space
    decompressed_rows: torch.Tensor  # [Td] int64: rows of the decompressed requests, in order
    key_slots: torch.Tensor  # [L] int64: cache slots of those requests' keys, request after request
    key_start: torch.Tensor  # [Td] int64: each decompressed row's first key in key_slots
    kv_len: torch.Tensor  # [Td] int64: its visible keys
    q_blocks: torch.Tensor  # [NB, 2] int64: (first, end) row of each tile of one request, in decompressed rows


def _per_request(req, kv_len, num_reqs):
    """Rows, causal pairs and context (longest visible length) of each request, on the host."""
    rows = np.bincount(req, minlength=num_reqs)
    pairs = np.bincount(req, weights=kv_len, minlength=num_reqs)
    context = np.zeros(num_reqs, dtype=np.int64)
    if req.size and np.all(req[1:] >= req[:-1]):  # the flat layout: each request's rows together
        starts = np.flatnonzero(np.r_[True, req[1:] != req[:-1]])
        context[req[starts]] = np.maximum.reduceat(kv_len, starts)
    else:
        np.maximum.at(context, req, kv_len)
    return rows, pairs, context


def _tiles(groups: np.ndarray, block_m: int) -> np.ndarray:
    """[NB, 2] (first, end) of runs of equal `groups`, cut every block_m rows."""
    starts = np.flatnonzero(np.r_[True, groups[1:] != groups[:-1]])
    ends = np.r_[starts[1:], groups.size]
    count = -(-(ends - starts) // block_m)
    first = np.repeat(starts, count) + (np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)) * block_m
    return np.stack([first, np.minimum(first + block_m, np.repeat(ends, count))], axis=1)


class _LastPlan:
    """The last plan and what it was made from. Every MLA layer of one forward gets the same metadata
    tensors, so the first layer plans (one host read) and the others reuse it. A hit needs the very same
    tensor objects (weak references, so a new tensor at a reused address misses) at the same version
    (in-place writes, such as the metadata builder's copies, bump it), with the same settings."""

    def __init__(self):
        self.refs, self.versions, self.settings, self.plan = (), (), None, None

    def get(self, tensors, settings):
        same = bool(self.refs) and settings == self.settings and all(r() is t for r, t in zip(self.refs, tensors))
        if same and self.versions == tuple(t._version for t in tensors):
            return True, self.plan
        return False, None

    def put(self, tensors, settings, plan):
        self.refs = tuple(weakref.ref(t) for t in tensors)
        self.versions = tuple(t._version for t in tensors)
        self.settings, self.plan = settings, plan


_LAST = _LastPlan()


def plan_mla(
    form, cost, num_heads, block_tables, token_req, token_kv_len, block_size, block_m, key_bytes=0
) -> MLAPlan | None:  # fmt: skip
    """None: every row absorbed. Otherwise one host read of the per-token request and length (once per
    forward: the plan is reused while the metadata tensors are unchanged), the split above, and one copy
    of the plan back to the device."""
    num_tokens, num_reqs = token_req.shape[0], block_tables.shape[0]
    capturing = token_req.is_cuda and torch.cuda.is_current_stream_capturing()
    if form == "absorbed" or capturing or num_tokens == 0:
        return None
    if form == "auto" and num_tokens - (num_reqs - 1) < cost.gate_rows:  # no request can reach the gate
        return None
    tensors = (token_req, token_kv_len, block_tables)
    settings = (form, cost, num_heads, block_size, block_m, key_bytes)
    hit, plan = _LAST.get(tensors, settings)
    if not hit:
        plan = _plan(form, cost, num_heads, block_tables, token_req, token_kv_len, block_size, block_m, key_bytes)
        _LAST.put(tensors, settings, plan)
    return plan


def _plan(
    form, cost, num_heads, block_tables, token_req, token_kv_len, block_size, block_m, key_bytes
) -> MLAPlan | None:  # fmt: skip
    num_reqs = block_tables.shape[0]
    req, kv_len = torch.stack([token_req.long(), token_kv_len.long()]).cpu().numpy()  # the one host read
    valid = kv_len > 0  # padding rows see nothing: they stay zeros in either form
    rows, pairs, context = _per_request(req[valid], kv_len[valid], num_reqs)
    if form == "decompressed":
        long_req = rows > 0
    else:
        saving = cost.saving_us(num_heads, pairs, context)
        long_req = (saving > 0) & (rows > 0)
        if saving[long_req].sum() <= cost.fixed_us:
            return None
    if key_bytes:  # keep the rebuilt K/V within the workspace: the first requests that fit, the rest absorb
        long_req &= np.cumsum(np.where(long_req, context, 0)) * key_bytes <= cost.workspace_bytes
    if not long_req.any():
        return None
    is_long = valid & long_req[req]
    absorbed_rows = np.flatnonzero(valid & ~is_long)
    dec_rows = np.flatnonzero(is_long)
    ctx = np.where(long_req, context, 0)
    first_key = np.cumsum(ctx) - ctx  # each decompressed request's keys, one after another
    dec_req = req[dec_rows]
    key_req = np.repeat(np.arange(num_reqs), ctx)
    key_pos = np.arange(key_req.size) - first_key[key_req]
    tiles = _tiles(dec_req, block_m)
    parts = [absorbed_rows, dec_rows, key_req, key_pos, first_key[dec_req], kv_len[dec_rows], tiles.ravel()]
    sizes = [p.size for p in parts]
    packed = torch.from_numpy(np.concatenate(parts).astype(np.int64)).to(token_req.device)  # one copy
    absorbed_d, dec_d, key_req_d, key_pos_d, start_d, len_d, tiles_d = packed.split(sizes)
    key_slots = block_tables[key_req_d, key_pos_d // block_size].long() * block_size + key_pos_d % block_size
    return MLAPlan(absorbed_d, dec_d, key_slots, start_d, len_d, tiles_d.view(-1, 2))


@functools.cache
def _kernels(impl: str):
    if impl == "triton":
        from draftgraph.ops.mla.triton_absorbed import write_rows_triton
        from draftgraph.ops.mla.triton_decompressed import BLOCK_M, mla_decompressed_triton
        from draftgraph.ops.mla.triton_latent import mla_latent_triton

        def write(kv_c, k_pe, latent_cache, rope_cache, slot_mapping):
            write_rows_triton(kv_c, latent_cache, slot_mapping)
            write_rows_triton(k_pe, rope_cache, slot_mapping)

        return write, mla_latent_triton, mla_decompressed_triton, BLOCK_M
    from draftgraph.ops.attention.reference import write_kv_reference
    from draftgraph.ops.mla.reference import mla_decompressed_reference, mla_latent_reference

    return write_kv_reference, mla_latent_reference, mla_decompressed_reference, 64


def mla_forward(
    q_nope, q_pe, kv_c, k_pe, latent_cache, rope_cache, w_kv_b, slot_mapping, block_tables, token_req,
    token_kv_len, scale, form, impl, cost: MLACost = DEFAULT_COST,
) -> torch.Tensor:  # fmt: skip
    """Write this step's latents and RoPE keys, attend, return [T, H, dv] (before o_proj).
    w_kv_b: kv_b's weight [H * (dn + dv), r]."""
    write, latent_attend, decompressed_attend, block_m = _kernels(impl)
    write(kv_c, k_pe, latent_cache, rope_cache, slot_mapping)
    num_tokens, num_heads, head_nope = q_nope.shape
    rank = latent_cache.shape[-1]
    w = w_kv_b.view(num_heads, -1, rank)
    w_uk, w_uv = w.split([head_nope, w.shape[1] - head_nope], dim=1)  # [H, dn, r], [H, dv, r]

    def absorbed(rows):  # batched matmuls over heads (einsum costs more host time in eager steps)
        sub = (lambda x: x) if rows is None else (lambda x: x.index_select(0, rows))
        q_lat = torch.bmm(sub(q_nope).transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, r], strided
        lat = latent_attend(
            q_lat, sub(q_pe).contiguous(), latent_cache, rope_cache, block_tables, sub(token_req),
            sub(token_kv_len), scale,
        )  # fmt: skip
        return torch.bmm(lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, dv], strided

    key_bytes = w_kv_b.shape[0] * w_kv_b.element_size()  # one rebuilt key: H (dn + dv) values
    plan = plan_mla(
        form, cost, num_heads, block_tables, token_req, token_kv_len, latent_cache.shape[1], block_m, key_bytes
    )
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
