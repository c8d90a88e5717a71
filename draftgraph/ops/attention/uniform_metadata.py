"""A uniform batch's attention metadata, built on the device from the requests' lengths and block tables.

In a uniform decode batch every request r of the padded batch (B rows) verifies Q tokens at positions
lengths[r] .. lengths[r] + Q - 1, so every metadata field follows from three small per-request vectors
(its slot, its cached length, whether the row is a real request) and the block tables the device keeps per
request slot (runtime/device_tables.py). The one-graph step (runtime/uniform_step.py) builds its metadata
here, inside its CUDA graph, instead of on the host from Python lists every step.

Rows whose `valid` is 0 (padding) read no block table entry (their table row is the scratch slot's), write no
KV (slot -1) and see nothing (visible length 0, sequence length 0); their positions are 0 .. Q - 1.

`uniform_metadata` is the torch reference (the CPU, and traced code); on CUDA run eagerly (the one-graph step
runs around its compiled forwards) it is one Triton kernel, `draftgraph::uniform_metadata`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftgraph.ops.attention.metadata import AttentionMetadata
from draftgraph.ops.launch import launch
from draftgraph.ops.registry import custom_op

BLOCK = 128  # tokens per program
BLOCK_W = 128  # block-table entries per step of a request's row copy


def uniform_metadata_reference(
    tables: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, valid: torch.Tensor, q: int, block_size: int
) -> tuple[torch.Tensor, AttentionMetadata]:
    """positions [B * Q] and the metadata of Q tokens per request; `tables` [slots + 1, W] int32 per request
    slot, `slots` / `lengths` / `valid` [B] int64."""
    b = slots.shape[0]
    dev = slots.device
    rows = tables[slots]  # [B, W]
    ok = valid != 0
    pos = lengths[:, None] + torch.arange(q, device=dev)[None, :]  # [B, Q]
    pos = torch.where(ok[:, None], pos, torch.arange(q, device=dev)[None, :].expand(b, q))
    blk = rows.gather(1, torch.where(ok[:, None], pos // block_size, torch.zeros_like(pos))).long()
    slot = torch.where(ok[:, None], blk * block_size + pos % block_size, torch.full_like(pos, -1))
    kv = torch.where(ok[:, None], pos + 1, torch.zeros_like(pos))
    meta = AttentionMetadata(
        slot_mapping=slot.flatten(),
        token_req=torch.arange(b, device=dev, dtype=torch.int32).repeat_interleave(q),
        token_kv_len=kv.flatten().int(),
        block_tables=rows,
        seq_lens=torch.where(ok, lengths + q, torch.zeros_like(lengths)).int(),
        query_start_loc=(torch.arange(b + 1, device=dev) * q).int(),
    )
    return pos.flatten(), meta


@triton.jit(do_not_specialize=["B", "W", "stride_t"])
def _uniform_kernel(tables, stride_t, slots, lengths, valid, pos_out, slot_out, req_out, kv_out, rows_out, seq_out,
                    qsl_out, B, W, Q: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr,
                    BLOCK_W: tl.constexpr):  # fmt: skip
    pid = tl.program_id(0)
    token_programs = tl.cdiv(B * Q, BLOCK)
    if pid < token_programs:  # per token: position, KV slot, request row, visible length
        t = pid * BLOCK + tl.arange(0, BLOCK)
        m = t < B * Q
        r = t // Q
        j = t % Q
        ok = (tl.load(valid + r, mask=m, other=0) != 0) & m
        p = tl.where(ok, tl.load(lengths + r, mask=m, other=0) + j, j)
        s = tl.load(slots + r, mask=m, other=0)
        blk = tl.load(tables + s * stride_t + p // BLOCK_SIZE, mask=ok, other=0).to(tl.int64)
        tl.store(pos_out + t, p, mask=m)
        tl.store(slot_out + t, tl.where(ok, blk * BLOCK_SIZE + p % BLOCK_SIZE, -1), mask=m)
        tl.store(req_out + t, r.to(tl.int32), mask=m)
        tl.store(kv_out + t, tl.where(ok, p + 1, 0).to(tl.int32), mask=m)
    else:  # per request: its block-table row, sequence length and query start (names of their own: Triton
        # needs a name to keep one type across both branches)
        req = pid - token_programs
        req_slot = tl.load(slots + req)
        real = tl.load(valid + req) != 0
        seq = tl.where(real, tl.load(lengths + req) + Q, 0)
        tl.store(seq_out + req, seq.to(tl.int32))
        tl.store(qsl_out + req, (req * Q).to(tl.int32))
        if req == B - 1:
            tl.store(qsl_out + B, (B * Q).to(tl.int32))
        for start in range(0, W, BLOCK_W):
            w = start + tl.arange(0, BLOCK_W)
            row = tl.load(tables + req_slot * stride_t + w, mask=w < W, other=0)
            tl.store(rows_out + req.to(tl.int64) * W + w, row, mask=w < W)


def uniform_metadata_kernel(
    tables: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, valid: torch.Tensor, q: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions int64 [B*Q], slot_mapping int64, token_req int32, token_kv_len int32, block_tables int32 [B, W],
    seq_lens int32 [B], query_start_loc int32 [B + 1]): uniform_metadata_reference's values in one launch (any
    device Triton runs on: the CPU under its interpreter, for the tests)."""
    b, w = slots.shape[0], tables.shape[1]
    dev = slots.device
    pos = torch.empty(b * q, dtype=torch.int64, device=dev)
    slot = torch.empty(b * q, dtype=torch.int64, device=dev)
    req = torch.empty(b * q, dtype=torch.int32, device=dev)
    kv = torch.empty(b * q, dtype=torch.int32, device=dev)
    rows = torch.empty(b, w, dtype=torch.int32, device=dev)
    seq = torch.empty(b, dtype=torch.int32, device=dev)
    qsl = torch.empty(b + 1, dtype=torch.int32, device=dev)
    if b:
        grid = (triton.cdiv(b * q, BLOCK) + b,)
        launch(_uniform_kernel, grid)(tables, tables.stride(0), slots, lengths, valid, pos, slot, req, kv, rows, seq,
                                      qsl, b, w, Q=q, BLOCK_SIZE=block_size, BLOCK=BLOCK, BLOCK_W=BLOCK_W)  # fmt: skip
    return pos, slot, req, kv, rows, seq, qsl


@custom_op("draftgraph::uniform_metadata", mutates_args=(), device_types="cuda")
def uniform_metadata_triton(
    tables: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, valid: torch.Tensor, q: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """uniform_metadata_kernel as an op, so that the kernels-ahead threads can compile it before the one-graph
    step's first run (runtime/warmup.py)."""
    return uniform_metadata_kernel(tables, slots, lengths, valid, q, block_size)


@uniform_metadata_triton.register_fake
def _(tables, slots, lengths, valid, q, block_size):
    b, w = slots.shape[0], tables.shape[1]
    i64, i32 = torch.int64, torch.int32
    return (
        slots.new_empty(b * q, dtype=i64),
        slots.new_empty(b * q, dtype=i64),
        slots.new_empty(b * q, dtype=i32),
        slots.new_empty(b * q, dtype=i32),
        slots.new_empty(b, w, dtype=i32),
        slots.new_empty(b, dtype=i32),
        slots.new_empty(b + 1, dtype=i32),
    )


def uniform_metadata(
    tables: torch.Tensor, slots: torch.Tensor, lengths: torch.Tensor, valid: torch.Tensor, q: int, block_size: int
) -> tuple[torch.Tensor, AttentionMetadata]:
    """uniform_metadata_reference's positions and metadata: one Triton kernel on CUDA outside traced code."""
    if not slots.is_cuda or torch.compiler.is_compiling() or tables.stride(-1) != 1:
        return uniform_metadata_reference(tables, slots, lengths, valid, q, block_size)
    pos, slot, req, kv, rows, seq, qsl = uniform_metadata_triton(tables, slots, lengths, valid, q, block_size)
    return pos, AttentionMetadata(slot, req, kv, rows, seq, qsl)
