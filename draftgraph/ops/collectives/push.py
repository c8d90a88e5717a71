"""A one-shot "push" all-reduce over peer memory: one Triton kernel launch, no end barrier, safe to replay in a
CUDA graph.

Each rank's share of the symmetric buffer (peer.py) holds, from `PushLayout.offset` on:
  data[2 slots][W source ranks][max_elems]  (the message's dtype)   then   flags[max_programs][W]  (int64 epochs)
and each rank keeps, in its own (not shared) memory, `state` = [epoch, arrivals] (int64).

Call e (e = epoch + 1, read by every program at its start; slot = e % 2): program `pid` takes a chunk of the
message, stores it into every peer's data[slot][my rank][chunk] (NVLink stores), then, after a CTA barrier, one
release store at system scope of e into every peer's flags[pid][my rank]; then it waits (acquire, system scope)
until its own flags[pid][p] >= e for every peer p, sums data[slot][*][chunk] in float32 in rank order (its own
part from its input, not the buffer) and writes the output. The last program to arrive resets the arrival count
and stores epoch = e, which the next launch reads (the kernel boundary orders it).

Why no end barrier: a rank writes slot e % 2 in call e only after finishing call e - 1, which needed a flag of
call e - 1 from every peer, sent from the peer's kernel e - 1, which started after its kernel e - 2 (the last
reader of that slot) ended. A peer may already have signalled e + 1 into a flag this rank waits on for e (it
may be a call ahead, never two): hence `>= e`. Flags only grow (int64: never wrap), so a stale flag never
passes. The number of programs may differ from call to call (chunks by message size): the argument above holds
for any one flag of call e - 1. Epochs start at 0 with the flags zeroed (`zero_state`, before the rendezvous).
All ranks make the same all-reduces in the same order (SPMD), as with NCCL; the sums are the same bits on every
rank (float32, rank order, rounded once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

PUSH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ALIGN = 256  # bytes: the region's start and each data row (vector stores, and torch's own region below it)


@dataclass(frozen=True)
class PushLayout:
    """Where the push all-reduce's data and flags lie in one rank's share of the symmetric buffer: from `offset`
    bytes, 2 slots x `world_size` rows of `max_bytes` (a row: one source rank's message), then `max_programs` x
    `world_size` int64 flags. `bytes_per_program`: the message bytes one program takes (more programs for larger
    messages, at most `max_programs`)."""

    world_size: int
    max_bytes: int
    offset: int = 0
    max_programs: int = 128
    bytes_per_program: int = 8192

    def __post_init__(self):
        if self.world_size < 2 or self.max_bytes <= 0 or self.max_bytes % ALIGN or self.offset % ALIGN:
            raise ValueError(
                f"PushLayout(world_size={self.world_size}, max_bytes={self.max_bytes}, offset={self.offset}): need "
                f"world_size >= 2, max_bytes > 0 and max_bytes, offset multiples of {ALIGN}"
            )
        bpp = self.bytes_per_program
        if self.max_programs < 1 or bpp < 16 or bpp & (bpp - 1):
            raise ValueError(
                f"PushLayout(max_programs={self.max_programs}, bytes_per_program={self.bytes_per_program}): need "
                "max_programs >= 1 and bytes_per_program a power of two >= 16"
            )

    @property
    def row_bytes(self) -> int:
        return self.max_bytes

    def data_at(self, slot: int, src: int) -> int:
        """Byte offset, in a rank's share, of data[slot][src]."""
        return self.offset + (slot * self.world_size + src) * self.row_bytes

    @property
    def flags_at(self) -> int:
        """Byte offset of flags[0][0] (8-byte aligned)."""
        return self.offset + 2 * self.world_size * self.row_bytes

    @property
    def end(self) -> int:
        """Bytes of a rank's share the layout needs (its region ends here)."""
        return self.flags_at + 8 * self.max_programs * self.world_size

    def grid(self, nbytes: int, itemsize: int, bytes_per_program: int | None = None) -> tuple[int, int, int]:
        """(programs, chunk, block) for a message of `nbytes`: each program sums `chunk` elements (a multiple of
        `block`, the elements it moves at once); at most `max_programs` programs."""
        bpp = bytes_per_program or self.bytes_per_program
        block = max(bpp // itemsize, 16)
        n = nbytes // itemsize
        programs = min(triton.cdiv(n, block), self.max_programs)
        chunk = triton.cdiv(triton.cdiv(n, programs), block) * block
        return triton.cdiv(n, chunk), chunk, block


@triton.jit
def _push_all_reduce(
    x_ptr,
    out_ptr,
    data_ptr,  # this rank's data[0][0] (the message's dtype)
    flags_ptr,  # this rank's flags[0][0] (int64)
    deltas_ptr,  # int64 [W]: (rank p's share - this rank's share) in 256-byte units
    state_ptr,  # int64 [2]: this rank's epoch (the last call done), programs arrived in this call
    n,
    chunk,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    ROW: tl.constexpr,  # elements in one data row (layout.max_bytes / itemsize)
    UNIT: tl.constexpr,  # elements in 256 bytes
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    e = tl.load(state_ptr, cache_modifier=".cg") + 1
    slot = e % 2
    start = pid * chunk
    # 1. this rank's chunk into every peer's data[slot][RANK]
    for off in range(start, start + chunk, BLOCK):
        offs = tl.max_contiguous(tl.multiple_of(off + tl.arange(0, BLOCK), BLOCK), BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        for i in tl.static_range(1, WORLD):
            p = (RANK + i) % WORLD
            row = tl.load(deltas_ptr + p) * UNIT + (slot * WORLD + RANK) * ROW
            tl.store(data_ptr + row + offs, x, mask=mask)
    tl.debug_barrier()  # every thread's stores before the release below
    # 2. signal: e into every peer's flags[pid][RANK]
    for i in tl.static_range(1, WORLD):
        p = (RANK + i) % WORLD
        flag = flags_ptr + tl.load(deltas_ptr + p) * 32 + pid * WORLD + RANK
        tl.atomic_xchg(flag, e, sem="release", scope="sys")
    # 3. wait for every peer's chunk: own flags[pid][p] >= e
    for i in tl.static_range(1, WORLD):
        p = (RANK + i) % WORLD
        seen = tl.atomic_add(flags_ptr + pid * WORLD + p, 0, sem="acquire", scope="sys")
        while seen < e:
            seen = tl.atomic_add(flags_ptr + pid * WORLD + p, 0, sem="acquire", scope="sys")
    tl.debug_barrier()
    # 4. sum in rank order (the same bits on every rank), this rank's part from its input
    for off in range(start, start + chunk, BLOCK):
        offs = tl.max_contiguous(tl.multiple_of(off + tl.arange(0, BLOCK), BLOCK), BLOCK)
        mask = offs < n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for src in tl.static_range(WORLD):
            if src == RANK:
                acc += tl.load(x_ptr + offs, mask=mask).to(tl.float32)
            else:
                row = (slot * WORLD + src) * ROW
                acc += tl.load(data_ptr + row + offs, mask=mask, cache_modifier=".cg").to(tl.float32)
        tl.store(out_ptr + offs, acc.to(x_ptr.dtype.element_ty), mask=mask)
    # 5. the last program here ends the call: the next launch reads epoch e
    arrived = tl.atomic_add(state_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        tl.store(state_ptr + 1, 0)
        tl.store(state_ptr, e)


class PushAllReduce:
    """One rank's push all-reduce over `share`, its part of a symmetric buffer (uint8, from the layout's offset
    on), `buffer_ptrs` every rank's buffer address (this rank's view of them), `state` its epoch and arrival
    count. Shared by every PeerAllReduce of the buffer (one epoch per buffer)."""

    def __init__(self, layout: PushLayout, rank: int, buffer: torch.Tensor, buffer_ptrs: list[int]):
        if len(buffer_ptrs) != layout.world_size or not 0 <= rank < layout.world_size:
            raise ValueError(f"PushAllReduce: rank {rank}, {len(buffer_ptrs)} buffers for {layout.world_size} ranks")
        if buffer.dtype != torch.uint8 or buffer.numel() < layout.end:
            raise ValueError(f"PushAllReduce: need a uint8 buffer of {layout.end} bytes, got {buffer.dtype} "
                             f"[{buffer.numel()}]")  # fmt: skip
        deltas = [p - buffer_ptrs[rank] for p in buffer_ptrs]
        if any(d % ALIGN for d in deltas) or buffer.data_ptr() % ALIGN:
            raise ValueError(f"PushAllReduce: symmetric buffers not {ALIGN}-byte aligned: {buffer_ptrs}")
        self.layout, self.rank = layout, rank
        self.data = buffer[layout.offset : layout.flags_at]
        self.flags = buffer[layout.flags_at : layout.end].view(torch.int64)
        self.deltas = torch.tensor([d // ALIGN for d in deltas], dtype=torch.int64, device=buffer.device)
        self.state = torch.zeros(2, dtype=torch.int64, device=buffer.device)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype in PUSH_DTYPES and 0 < x.numel() * x.element_size() <= self.layout.max_bytes

    def all_reduce(self, x: torch.Tensor, out: torch.Tensor | None = None, bytes_per_program: int | None = None):
        """The sum of x (contiguous, 16-byte aligned, `fits`) over the ranks, into `out` (a new tensor if None)."""
        out = torch.empty_like(x) if out is None else out
        size = x.element_size()
        programs, chunk, block = self.layout.grid(x.numel() * size, size, bytes_per_program)
        _push_all_reduce[(programs,)](
            x, out, self.data.view(x.dtype), self.flags, self.deltas, self.state, x.numel(), chunk,
            RANK=self.rank, WORLD=self.layout.world_size, ROW=self.layout.row_bytes // size, UNIT=ALIGN // size,
            BLOCK=block, num_warps=8 if block * size >= 8192 else 4,
        )  # fmt: skip
        return out
