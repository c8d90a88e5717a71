"""Safetensors files read through a memory map, and their tensors copied to a device through pinned buffers.

`MappedSafetensors(file)` parses the file's header and maps its bytes: `get_tensor(name)` and
`get_slice(name)[index]` are zero-copy CPU views of the page cache, as safetensors' own handle gives whole tensors.
The interface is safe_open's, so the sharded reader (models/parallel/sharded_read.py) and its tests' recording
wrapper take either.

`DeviceLoader(device)` turns such views into device tensors with ONE host copy: each view (strided too: a
row-parallel share) is copied by torch's threads into one of two pinned buffers, whose copy to the device runs
while the next one fills. Before, a share was read into CPU memory, its fused parts concatenated there, then moved
with pageable copies; the 8B shape's weight load at TP 2 (rank 0, `scripts/bench_cold_start.py --pair 8b --args
"--tp 2" --timeline`, 2 x H200) took 4.0 s warm, 2.8 s with this reader, and the 1B pair's on one H100 1.1 -> 0.4 s
(docs/performance.md).

A view keeps its map alive (the tensor holds the mmap object), so the map is never closed by hand: closing a
map under a live view would leave the view reading unmapped memory. The map is copy-on-write, as safetensors'
own: a CPU weight kept as a view (no copy, as safetensors' tensors are) and written in place copies its page.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from typing import Any

import torch

# safetensors' dtype names -> torch (those this torch has)
DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name, dtype in (
        ("F64", torch.float64),
        ("F32", torch.float32),
        ("F16", torch.float16),
        ("BF16", torch.bfloat16),
        ("I64", torch.int64),
        ("I32", torch.int32),
        ("I16", torch.int16),
        ("I8", torch.int8),
        ("U8", torch.uint8),
        ("BOOL", torch.bool),
        ("F8_E4M3", getattr(torch, "float8_e4m3fn", None)),
        ("F8_E5M2", getattr(torch, "float8_e5m2", None)),
        ("U16", getattr(torch, "uint16", None)),
        ("U32", getattr(torch, "uint32", None)),
        ("U64", getattr(torch, "uint64", None)),
    )  # fmt: skip
    if dtype is not None
}
HEADER_LIMIT = 100 << 20  # safetensors refuses larger headers too


class MappedSafetensors:
    """One safetensors file, mapped: its tensors as zero-copy CPU views (safe_open's interface: keys,
    get_tensor, get_slice; a context manager). A malformed file raises ValueError naming what is wrong."""

    def __init__(self, file: str):
        self.file = file
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{size} bytes: too short for a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > HEADER_LIMIT or 8 + n > size:
                raise ValueError(f"header length {n} does not fit the file's {size} bytes")
            try:
                header = json.loads(f.read(n))
            except ValueError as e:
                raise ValueError(f"header is not JSON ({e})") from e
            header.pop("__metadata__", None)
            self._start = 8 + n
            self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
            for name, entry in header.items():
                self._entries[name] = self._entry(name, entry, size - self._start)
            data = size - self._start
            # copy-on-write (as safetensors maps): a weight kept as a view and written in place is copied, not the file
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8) if self._map is not None and data else None

    @staticmethod
    def _entry(name: str, entry: Any, data: int) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        kind = entry.get("dtype") if isinstance(entry, dict) else None
        if isinstance(kind, str) and kind not in DTYPES:
            known = sorted(DTYPES)
            raise ValueError(f"tensor {name!r} has dtype {kind!r}, which this torch cannot hold (known: {known})")
        try:
            dtype, shape, (begin, end) = DTYPES[entry["dtype"]], tuple(entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"tensor {name!r} has an unreadable header entry {entry!r} ({e!r})") from e
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end <= data or end - begin != numel * dtype.itemsize:
            raise ValueError(
                f"tensor {name!r} ({entry['dtype']} {list(shape)}) claims bytes [{begin}, {end}) of the "
                f"{data} data bytes; the file is truncated or corrupt"
            )
        return dtype, shape, begin, end

    def __enter__(self) -> MappedSafetensors:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Drop this handle's references; the map ends with the last view of it (see the module's docstring)."""
        self._bytes = self._map = None

    def keys(self) -> list[str]:
        return list(self._entries)

    def get_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor: a view of the map (a copy where its bytes are not aligned to its dtype)."""
        dtype, shape, begin, end = self._entries[name]
        if begin == end:
            return torch.empty(shape, dtype=dtype)
        if self._bytes is None:
            raise ValueError(f"{self.file} was closed before {name!r} was read")
        raw = self._bytes[self._start + begin : self._start + end]
        if (self._start + begin) % dtype.itemsize:
            raw = raw.clone()  # (safetensors' writers align; a file that does not still reads)
        return raw.view(dtype).view(shape)

    def get_slice(self, name: str) -> _Slice:
        return _Slice(self, name)


class _Slice:
    """safe_open's slice handle: `get_shape()`, and `[index]` a view of the map."""

    def __init__(self, handle: MappedSafetensors, name: str):
        self._handle, self._name = handle, name
        self.shape = handle._entries[name][1]

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self._handle.get_tensor(self._name)[index]


class DeviceLoader:
    """Copies CPU tensors (views of mapped files) to `device` through `slots` pinned buffers of `stage_bytes`
    (plain memory where `pin` is False: CPU tests of the chunking). Copies are queued on the current stream;
    `close()` waits for them and gives the buffers back."""

    def __init__(self, device: torch.device, stage_bytes: int = 64 << 20, slots: int = 2, pin: bool = True):
        self.device, self.stage_bytes = device, stage_bytes
        self._stages = [torch.empty(stage_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(slots)]
        self._events: list[Any] = [None] * slots
        self._slot = 0
        self.copied_bytes = 0
        self._cuda = device.type == "cuda"

    def load(self, parts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
        """The concatenation of `parts` along `dim`, made on the device (a contiguous tensor)."""
        if len(parts) == 1:
            out = torch.empty(parts[0].shape, dtype=parts[0].dtype, device=self.device)
            self._copy(out, parts[0])
            return out
        shape = list(parts[0].shape)
        shape[dim] = sum(p.shape[dim] for p in parts)
        out = torch.empty(shape, dtype=parts[0].dtype, device=self.device)
        at = 0
        for p in parts:
            self._copy(out.narrow(dim, at, p.shape[dim]), p)
            at += p.shape[dim]
        return out

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        nbytes = src.numel() * src.element_size()
        if nbytes == 0:
            return
        self.copied_bytes += nbytes
        if src.dim() == 0:
            src, dst = src.reshape(1), dst.reshape(1)
        if src.dim() == 1 and src.is_contiguous():  # a long vector: chunks of it
            src, dst = src.view(-1, 1), dst.view(-1, 1)
        row = nbytes // src.shape[0]
        if row > self.stage_bytes:  # one row bigger than a buffer (never in a model's weights): torch's own copy
            dst.copy_(src)
            return
        step = self.stage_bytes // row
        for r in range(0, src.shape[0], step):
            piece = src[r : r + step]
            buf = self._take()
            staged = buf[: piece.numel() * piece.element_size()].view(piece.dtype).view(piece.shape)
            staged.copy_(piece)  # the one host copy: page cache -> pinned (torch's threads)
            dst[r : r + step].copy_(staged, non_blocking=True)
            self._done()

    def _take(self) -> torch.Tensor:
        event = self._events[self._slot]
        if event is not None:
            event.synchronize()  # its last copy to the device has left the buffer
        return self._stages[self._slot]

    def _done(self) -> None:
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
            self._events[self._slot] = event
        self._slot = (self._slot + 1) % len(self._stages)

    def close(self) -> None:
        """Wait for the queued copies; the buffers go back to torch's pinned-memory cache, which is emptied."""
        for event in self._events:
            if event is not None:
                event.synchronize()
        self._stages, self._events = [], []
        empty = getattr(torch._C, "_host_emptyCache", None) or getattr(torch._C, "_accelerator_emptyHostCache", None)
        if self._cuda and empty is not None:
            empty()
