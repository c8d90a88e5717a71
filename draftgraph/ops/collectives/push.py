"""One-shot "push" all-reduces over peer memory: one Triton kernel launch each, no barrier at the end, safe to
replay in a CUDA graph. Two kernels, chosen by the measured rule (peer.py): "push" (data, then a flag) and
"lamport" (the data is its own flag).

Each rank's share of the symmetric buffer (peer.py) holds, from `PushLayout.offset` on:
  data[2 slots][W source ranks][max_bytes]       the push kernel's rows (the message's dtype)
  lamport2[2][W][max_bytes], lamport4[2][W][...]  the lamport kernel's rows, for 2- and 4-byte dtypes, filled with
                                                  the sentinel -0.0 (`prepare`, before the rendezvous)
  flags[max_programs][W]                          the push kernel's int64 epochs (zeroed)
  fused2[3][W][fused_bytes], fused4[3][W][...]    the fused one-row all-reduce's lamport rows (fused.py: the
                                                  row-parallel GEMV writes them, the next norm + GEMV reads them;
                                                  three slots, its own epoch), the sentinel; only with fused_bytes
and each rank keeps, in its own (not shared) memory, `state` = [epoch, arrivals] (int64), one for both kernels,
and `fused_state` = [epoch, arrivals, elements and width of the last fused call] for the fused pair.

Both: call e (e = epoch + 1, read by every program at its start; slot = e % 2): program `pid` takes a chunk of
the message and stores it into every peer's row [slot][my rank][chunk] (NVLink stores). The last program to
finish resets the arrival count and stores epoch = e, which the next launch reads (the kernel boundary orders
it). Sums are float32 in rank order, rounded once: the same bits on every rank, and NCCL's for two ranks.
- push: after a CTA barrier, one release store at system scope of e into every peer's flags[pid][my rank]; then
  wait (acquire, system scope) until its own flags[pid][p] >= e for every peer p, and sum its rows' chunk (its
  own part from its input, not the buffer).
- lamport (as TensorRT-LLM's low-latency all-reduce): a sent -0.0 becomes +0.0, so no sent value is the
  sentinel; wait until no element of the peers' rows' chunk is the sentinel (volatile loads: the data is the
  signal, no flag, no fence), sum, and store the sentinel back into the rows read.

Why no end barrier: a rank writes slot e % 2 in call e only after finishing call e - 1, which needed data (and
for push a flag) of call e - 1 from every peer, sent from the peer's kernel e - 1, which started after its kernel
e - 2 (the last reader of that slot, which also re-armed it with the sentinel) ended. A peer may already have
signalled e + 1 into a flag this rank waits on for e (a call ahead, never two): hence `>= e`; flags only grow
(int64: never wrap), so a stale flag never passes. The number of programs may differ from call to call (chunks
by message size): the argument holds for any one program of call e - 1. All ranks make the same all-reduces in
the same order (SPMD), as with NCCL.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from draftgraph.ops.launch import pdl_level
from draftgraph.ops.triton_pdl import pdl_args, pdl_release, pdl_start

PUSH_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PUSH_KINDS = ("push", "lamport")
ALIGN = 256  # bytes: the region's start and each data row (vector stores, and torch's own region below it)


@dataclass(frozen=True)
class PushLayout:
    """Where the push kernels' rows and flags lie in one rank's share of the symmetric buffer: from `offset` bytes,
    2 slots x `world_size` rows of `max_bytes` (a row: one source rank's message) for the push kernel, the same
    for the lamport kernel's 2-byte and its 4-byte dtypes, then `max_programs` x `world_size` int64 flags.
    `bytes_per_program`: the message bytes one program takes (more programs for larger messages, at most
    `max_programs`)."""

    world_size: int
    max_bytes: int
    offset: int = 0
    max_programs: int = 128
    bytes_per_program: int = 8192
    fused_bytes: int = 0  # a fused one-row all-reduce's largest row (fused.py); 0: no fused region

    def __post_init__(self):
        if (self.world_size < 2 or self.max_bytes <= 0 or self.max_bytes % ALIGN or self.offset % ALIGN
                or self.fused_bytes < 0 or self.fused_bytes % ALIGN):  # fmt: skip
            raise ValueError(
                f"PushLayout(world_size={self.world_size}, max_bytes={self.max_bytes}, offset={self.offset}): need "
                f"world_size >= 2, max_bytes > 0 and max_bytes, offset (and fused_bytes) multiples of {ALIGN}"
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

    @property
    def rows_bytes(self) -> int:
        """One kernel's rows: 2 slots x world_size rows."""
        return 2 * self.world_size * self.row_bytes

    def data_at(self, slot: int, src: int) -> int:
        """Byte offset, in a rank's share, of the push kernel's data[slot][src]."""
        return self.offset + (slot * self.world_size + src) * self.row_bytes

    def lamport_at(self, itemsize: int) -> int:
        """Byte offset of the lamport kernel's rows [0][0] for dtypes of `itemsize` bytes (2 or 4)."""
        return self.offset + {2: 1, 4: 2}[itemsize] * self.rows_bytes

    @property
    def flags_at(self) -> int:
        """Byte offset of flags[0][0] (8-byte aligned)."""
        return self.offset + 3 * self.rows_bytes

    @property
    def flags_end(self) -> int:
        return -(-(self.flags_at + 8 * self.max_programs * self.world_size) // ALIGN) * ALIGN

    @property
    def fused_rows_bytes(self) -> int:
        """The fused pair's rows for one width: 3 slots x world_size rows of `fused_bytes`."""
        return 3 * self.world_size * self.fused_bytes

    def fused_at(self, itemsize: int) -> int:
        """Byte offset of the fused pair's rows [0][0] for dtypes of `itemsize` bytes (2 or 4), after the flags."""
        return self.flags_end + {2: 0, 4: 1}[itemsize] * self.fused_rows_bytes

    @property
    def end(self) -> int:
        """Bytes of a rank's share the layout needs (its region ends here)."""
        if self.fused_bytes:
            return self.fused_at(4) + self.fused_rows_bytes
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
def send_to_peers(rows, deltas_ptr, offs, x, mask, slot, RANK: tl.constexpr, WORLD: tl.constexpr, ROW: tl.constexpr,
                  UNIT: tl.constexpr):  # fmt: skip
    """x (at offs) into every peer's row [slot][RANK] of `rows` (this rank's view of its region's first row:
    `deltas_ptr` [W] moves it to rank p's, in 256-byte units of UNIT elements)."""
    for i in tl.static_range(1, WORLD):
        p = (RANK + i) % WORLD
        row = tl.load(deltas_ptr + p) * UNIT + (slot * WORLD + RANK) * ROW
        tl.store(rows + row + offs, x, mask=mask)


@triton.jit
def end_call(state_ptr, e):
    """The call's last program to arrive here ends it: the arrivals back to 0, the epoch to e (the next launch
    reads it)."""
    arrived = tl.atomic_add(state_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(0) - 1:
        tl.store(state_ptr + 1, 0)
        tl.store(state_ptr, e)


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
    PDL: tl.constexpr,  # programmatic dependent launch's level (ops/triton_pdl.py): waits before any load
):
    pid = tl.program_id(0)
    pdl_start(PDL)
    e = tl.load(state_ptr, cache_modifier=".cg") + 1
    slot = e % 2
    start = pid * chunk
    # 1. this rank's chunk into every peer's data[slot][RANK]
    for off in range(start, start + chunk, BLOCK):
        offs = tl.max_contiguous(tl.multiple_of(off + tl.arange(0, BLOCK), BLOCK), BLOCK)
        mask = offs < n
        send_to_peers(data_ptr, deltas_ptr, offs, tl.load(x_ptr + offs, mask=mask), mask, slot, RANK, WORLD, ROW, UNIT)
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
    pdl_release(PDL)
    end_call(state_ptr, e)  # 5.


@triton.jit
def _sentinels(v, WIDE: tl.constexpr):
    """How many elements of v are the sentinel -0.0 (compared by bits: -0.0 == 0.0 as floats)."""
    # if / else, not an early return: Triton's compiler still generates the statements after a return inside a
    # constexpr if (a 16-bit bitcast of 4-byte rows: no compile for float32)
    if WIDE:
        n = tl.sum((v.to(tl.int32, bitcast=True) == -2147483648).to(tl.int32), axis=0)
    else:
        n = tl.sum((v.to(tl.int16, bitcast=True) == -32768).to(tl.int32), axis=0)
    return n


@triton.jit
def sentinel_block(like, BLOCK: tl.constexpr, WIDE: tl.constexpr):
    """BLOCK sentinels -0.0 in the element type of pointer `like` (4-byte with WIDE, else 2-byte), to re-arm rows."""
    if WIDE:
        v = tl.full([BLOCK], -2147483648, tl.int32).to(like.dtype.element_ty, bitcast=True)
    else:
        v = tl.full([BLOCK], -32768, tl.int16).to(like.dtype.element_ty, bitcast=True)
    return v


@triton.jit
def lamport_wait(ptrs, mask, WIDE: tl.constexpr):
    """The rows at `ptrs` once no element under `mask` is the sentinel any more (volatile loads: the data is the
    signal, a peer's stores land element by element); the lamport kernel's and fused.py's reader's wait."""
    v = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
    while _sentinels(v, WIDE) > 0:
        v = tl.load(ptrs, mask=mask, other=0.0, volatile=True)
    return v


@triton.jit
def _lamport_all_reduce(
    x_ptr,
    out_ptr,
    data_ptr,  # this rank's lamport rows [0][0] for the message's itemsize (the message's dtype)
    deltas_ptr,  # int64 [W]: (rank p's share - this rank's share) in 256-byte units
    state_ptr,  # int64 [2]: this rank's epoch (the last call done), programs arrived in this call
    n,
    chunk,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    ROW: tl.constexpr,  # elements in one row (layout.max_bytes / itemsize)
    UNIT: tl.constexpr,  # elements in 256 bytes
    BLOCK: tl.constexpr,
    WIDE: tl.constexpr,  # 4-byte elements (else 2-byte)
    PDL: tl.constexpr,  # programmatic dependent launch's level (ops/triton_pdl.py): waits before any load
):
    pid = tl.program_id(0)
    pdl_start(PDL)
    e = tl.load(state_ptr, cache_modifier=".cg") + 1
    slot = e % 2
    start = pid * chunk
    dtype = x_ptr.dtype.element_ty
    sentinel = sentinel_block(x_ptr, BLOCK, WIDE)
    # 1. this rank's chunk into every peer's row [slot][RANK], -0.0 sent as +0.0
    for off in range(start, start + chunk, BLOCK):
        offs = tl.max_contiguous(tl.multiple_of(off + tl.arange(0, BLOCK), BLOCK), BLOCK)
        mask = offs < n
        x = tl.load(x_ptr + offs, mask=mask)
        x = tl.where(x == 0, tl.zeros_like(x), x)
        send_to_peers(data_ptr, deltas_ptr, offs, x, mask, slot, RANK, WORLD, ROW, UNIT)
    # 2. wait until the peers' rows hold no sentinel, sum in rank order, re-arm the rows with the sentinel
    for off in range(start, start + chunk, BLOCK):
        offs = tl.max_contiguous(tl.multiple_of(off + tl.arange(0, BLOCK), BLOCK), BLOCK)
        mask = offs < n
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for src in tl.static_range(WORLD):
            if src == RANK:
                acc += tl.load(x_ptr + offs, mask=mask).to(tl.float32)
            else:
                ptrs = data_ptr + (slot * WORLD + src) * ROW + offs
                v = lamport_wait(ptrs, mask, WIDE)
                acc += v.to(tl.float32)
                tl.store(ptrs, sentinel, mask=mask)
        tl.store(out_ptr + offs, acc.to(dtype), mask=mask)
    pdl_release(PDL)
    end_call(state_ptr, e)  # 3.


class PushAllReduce:
    """One rank's push all-reduces over `buffer`, its share of a symmetric buffer (uint8; the layout's region in
    it `prepare`d before the rendezvous), `buffer_ptrs` every rank's share (this rank's view of them), `state` its
    epoch and arrival count. Shared by every PeerAllReduce of the buffer (one epoch per buffer, both kernels)."""

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
        rows = layout.rows_bytes
        self.data = buffer[layout.offset : layout.offset + rows]
        self.lamport = {size: buffer[layout.lamport_at(size) : layout.lamport_at(size) + rows] for size in (2, 4)}
        self.flags = buffer[layout.flags_at : layout.end].view(torch.int64)
        self.deltas = torch.tensor([d // ALIGN for d in deltas], dtype=torch.int64, device=buffer.device)
        self.state = torch.zeros(2, dtype=torch.int64, device=buffer.device)
        fused = layout.fused_rows_bytes
        self.fused = {size: buffer[layout.fused_at(size) : layout.fused_at(size) + fused] for size in (2, 4)}
        self.fused_state = torch.zeros(4, dtype=torch.int64, device=buffer.device)  # fused.py's kernels'

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype in PUSH_DTYPES and 0 < x.numel() * x.element_size() <= self.layout.max_bytes

    def all_reduce(
        self, x: torch.Tensor, kind: str = "push", out: torch.Tensor | None = None, bytes_per_program: int | None = None
    ) -> torch.Tensor:
        """The sum of x (contiguous, 16-byte aligned, `fits`) over the ranks by kernel `kind` ("push" or
        "lamport"), into `out` (a new tensor if None)."""
        if not self.fits(x) or not x.is_contiguous():  # (a larger message would run into the next rows or flags)
            raise ValueError(
                f"push all-reduce: a contiguous {list(PUSH_DTYPES)} message of 1 to {self.layout.max_bytes} bytes, "
                f"got {x.dtype} [{x.numel()}] ({x.numel() * x.element_size()} bytes, contiguous: {x.is_contiguous()})"
            )
        if out is None:
            out = torch.empty_like(x)
        elif out.dtype != x.dtype or out.numel() != x.numel() or not out.is_contiguous():
            raise ValueError(f"push all-reduce: out {out.dtype} [{out.numel()}] for a message {x.dtype} [{x.numel()}]")
        size = x.element_size()
        programs, chunk, block = self.layout.grid(x.numel() * size, size, bytes_per_program)
        common = dict(RANK=self.rank, WORLD=self.layout.world_size, ROW=self.layout.row_bytes // size,
                      UNIT=ALIGN // size, BLOCK=block, num_warps=8 if block * size >= 8192 else 4,
                      **pdl_args(pdl_level(x.device)))  # fmt: skip
        if kind == "push":
            _push_all_reduce[(programs,)](
                x, out, self.data.view(x.dtype), self.flags, self.deltas, self.state, x.numel(), chunk, **common
            )
        elif kind == "lamport":
            rows = self.lamport[size].view(x.dtype)
            _lamport_all_reduce[(programs,)](
                x, out, rows, self.deltas, self.state, x.numel(), chunk, WIDE=size == 4, **common
            )
        else:
            raise ValueError(f"push kernel {kind!r} is unknown; choose one of {list(PUSH_KINDS)}")
        return out


def prepare(buffer: torch.Tensor, layout: PushLayout) -> None:
    """Arm this rank's share `buffer` (uint8) at epoch 0: the flags zeroed, the lamport rows filled with the
    sentinel -0.0. Before any peer can write into it: call before the rendezvous, then synchronize."""
    buffer[layout.offset : layout.end].zero_()
    rows = layout.rows_bytes
    buffer[layout.lamport_at(2) : layout.lamport_at(2) + rows].view(torch.int16).fill_(-32768)
    buffer[layout.lamport_at(4) : layout.lamport_at(4) + rows].view(torch.int32).fill_(-(2**31))
    if layout.fused_bytes:
        fused = layout.fused_rows_bytes
        buffer[layout.fused_at(2) : layout.fused_at(2) + fused].view(torch.int16).fill_(-32768)
        buffer[layout.fused_at(4) : layout.fused_at(4) + fused].view(torch.int32).fill_(-(2**31))
