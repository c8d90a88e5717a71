"""One draft step's attention metadata in one Triton kernel (runtime/drafting.py's `advance_next` on CUDA).

Between two drafter steps every request moves one position on: its new position, the KV slot of that position
from its block table, its visible length, and the batch's request / query-start layout for one token per
request. Written as torch ops that is a dozen small kernels per draft step; inside a traced function Inductor
fuses them, but the draft loop the one-graph step runs around the compiled drafter step (fuse_draft_loop
"auto") runs them as written, inside the step's CUDA graph. This kernel writes all of them in one launch, the
same values as the torch ops (runtime/drafting.py `advance`, the reference: tests/gpu/test_advance_cuda.py).
Rows whose `valid` is False read no block table entry, get slot -1 and visible length 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from draftgraph.ops.launch import launch
from draftgraph.ops.registry import custom_op

BLOCK = 128


@triton.jit(do_not_specialize=["B", "stride_t"])
def _advance_kernel(tables, stride_t, pos_in, valid, pos_out, slot_out, req_out, kv_out, seq_out, qsl_out, B,
                    BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < B
    p = tl.load(pos_in + offs, mask=m, other=0) + 1
    v = tl.load(valid + offs, mask=m, other=0) != 0
    blk = tl.load(tables + offs.to(tl.int64) * stride_t + p // BLOCK_SIZE, mask=m & v, other=0).to(tl.int64)
    slot = tl.where(v, blk * BLOCK_SIZE + p % BLOCK_SIZE, -1)
    kv = tl.where(v, p + 1, 0).to(tl.int32)
    tl.store(pos_out + offs, p, mask=m)
    tl.store(slot_out + offs, slot, mask=m)
    tl.store(req_out + offs, offs.to(tl.int32), mask=m)
    tl.store(kv_out + offs, kv, mask=m)
    tl.store(seq_out + offs, kv, mask=m)
    tl.store(qsl_out + offs, offs.to(tl.int32), mask=m)
    tl.store(qsl_out + B + offs * 0, B, mask=offs == 0)  # the last query start: B


@custom_op("draftgraph::advance_next", mutates_args=(), device_types="cuda")
def advance_next_triton(
    tables: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(positions + 1, slot_mapping int64, token_req int32, token_kv_len int32, seq_lens int32,
    query_start_loc int32 [B + 1]) for one token per request at `pos` + 1. An op, so that the kernels-ahead
    threads can compile its kernel before the one-graph step's first run (runtime/warmup.py)."""
    b = pos.shape[0]
    dev = pos.device
    pos_out = torch.empty_like(pos)
    slot = torch.empty(b, dtype=torch.int64, device=dev)
    req, kv, seq = (torch.empty(b, dtype=torch.int32, device=dev) for _ in range(3))
    qsl = torch.empty(b + 1, dtype=torch.int32, device=dev)
    grid = (max(1, triton.cdiv(b, BLOCK)),)
    launch(_advance_kernel, grid)(tables, tables.stride(0), pos, valid, pos_out, slot, req, kv, seq, qsl, b,
                                  BLOCK_SIZE=block_size, BLOCK=BLOCK)  # fmt: skip
    return pos_out, slot, req, kv, seq, qsl


@advance_next_triton.register_fake
def _(tables, pos, valid, block_size):
    b = pos.shape[0]
    i32 = [pos.new_empty(b, dtype=torch.int32) for _ in range(3)]  # token_req, token_kv_len, seq_lens
    return (torch.empty_like(pos), pos.new_empty(b, dtype=torch.int64), *i32, pos.new_empty(b + 1, dtype=torch.int32))
