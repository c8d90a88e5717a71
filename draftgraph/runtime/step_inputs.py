"""A step's device state as named buffers: filled on the host in one pinned buffer, sent by one copy.

`StepBuffers` lays out named fields (int64 or float32, each with a fixed capacity) at fixed offsets of one
byte buffer, once on the host (pinned on CUDA) and once on the device. A step writes the fields it uses
into the host buffer, then `upload()` sends them with one asynchronous copy; the device views keep their
addresses for good, so CUDA graphs read them in place.

`HostCopy` is the other direction: the step's results land in a pinned buffer by one asynchronous copy,
and the host waits for that copy alone (an event, not the whole device). It counts the waits: a step in
steady state makes exactly one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_ALIGN = 8  # every field starts on an 8-byte boundary (a typed view of the byte buffer needs it)


@dataclass(frozen=True)
class Field:
    name: str
    dtype: torch.dtype  # torch.int64 or torch.float32
    capacity: int  # elements


class StepBuffers:
    """Named device buffers with one pinned host mirror; one copy sends every field."""

    def __init__(self, fields: list[Field], device):
        self.device = torch.device(device)
        offsets, at = {}, 0
        for f in fields:
            if f.dtype not in (torch.int64, torch.float32):
                raise ValueError(f"field {f.name!r} has dtype {f.dtype}; StepBuffers holds int64 or float32")
            offsets[f.name] = at
            at += -(-(f.capacity * f.dtype.itemsize) // _ALIGN) * _ALIGN
        self.nbytes = max(at, _ALIGN)
        pin = self.device.type == "cuda"
        self._host = torch.zeros(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        self._dev = torch.zeros(self.nbytes, dtype=torch.uint8, device=self.device)
        self.fields = {f.name: f for f in fields}
        self.host, self.dev = {}, {}
        for f in fields:
            start = offsets[f.name]
            end = start + f.capacity * f.dtype.itemsize
            self.host[f.name] = self._host[start:end].view(f.dtype)
            self.dev[f.name] = self._dev[start:end].view(f.dtype)
        self._np = {name: t.numpy() for name, t in self.host.items()}

    def fill(self, name: str, values, size: int, pad=0) -> None:
        """Field `name`'s first `size` entries: `values`, then `pad` up to `size`."""
        cap = self.fields[name].capacity
        if size > cap:
            raise ValueError(f"step field {name!r} holds {cap} entries; {size} asked (a padded size over its bound)")
        arr = self._np[name]
        n = len(values)
        arr[:n] = values
        arr[n:size] = pad

    def upload(self) -> None:
        """Every field to the device: one copy, asynchronous on CUDA (the pinned buffer is not rewritten before
        the step that reads it has synchronised)."""
        self._dev.copy_(self._host, non_blocking=True)

    def view(self, name: str, size: int) -> torch.Tensor:
        """The device field's first `size` entries (a view at a fixed address)."""
        return self.dev[name][:size]

    def device_tensors(self) -> list[torch.Tensor]:
        """What graphs read in place: each field's device buffer (a step's views start at the same address)."""
        return list(self.dev.values())


class HostCopy:
    """Device results to the host through pinned buffers; `waits` counts the host's waits on the device.

    Two buffers, used in turn: a step's copy may be in flight (`start`) while the host still reads the one
    before it (`wait`), which is what an overlapped step needs (runtime/engine.py launches step n + 1 before
    it reads step n). At most two copies may be outstanding."""

    def __init__(self, capacity: int, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._bufs = [torch.zeros(capacity, dtype=torch.int64, pin_memory=self.cuda) for _ in range(2)]
        self._events = [torch.cuda.Event() if self.cuda else None for _ in range(2)]
        self._next = 0
        self._outstanding: list[int] = []  # buffer indices started and not yet waited for
        self.waits = 0

    def start(self, t: torch.Tensor) -> tuple:
        """Begin copying `t` (1-D int64 on the device) to a pinned buffer; returns the ticket `wait` takes."""
        if len(self._outstanding) == 2:
            raise RuntimeError("HostCopy holds two copies the host has not read; wait for one before a third")
        i, n = self._next, t.numel()
        self._next = 1 - i
        self._outstanding.append(i)
        if not self.cuda:
            return i, t.tolist()
        if n > self._bufs[i].numel():
            self._bufs[i] = torch.zeros(n, dtype=torch.int64, pin_memory=True)
        self._bufs[i][:n].copy_(t, non_blocking=True)
        self._events[i].record()
        return i, n

    def wait(self, ticket: tuple) -> list[int]:
        """The values of a started copy as a Python list, after waiting for that copy alone."""
        i, n = ticket
        self._outstanding.remove(i)
        self.waits += 1
        if not self.cuda:
            return n  # the list itself
        self._events[i].synchronize()
        return self._bufs[i][:n].numpy().tolist()

    def fetch(self, t: torch.Tensor) -> list[int]:
        """`t` (1-D int64 on the device) as a Python list, after waiting for its copy alone."""
        return self.wait(self.start(t))
