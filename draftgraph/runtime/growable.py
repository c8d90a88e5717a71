"""Device buffers that grow without moving: CUDA's virtual memory management, through the driver API.

Why: the KV cache is sized after the CUDA graphs are captured (runtime/memory.py measures their memory), and
graphs read the cache in place, at the address they were captured with. A buffer whose address range is
reserved up front for the most it could ever hold (the device's memory), with physical memory mapped only
for what it holds now, lets the probe's small cache grow to its final size under the graphs captured on it:
every graph is captured once. torch's `expandable_segments` allocator grows its own segments with the same
driver calls; vLLM's issue 26300 proposes this for its KV cache.

`GrowableBuffer(capacity, device)`: `grow(nbytes)` maps physical memory up to `nbytes` (rounded up to the
driver's granularity, 2 MiB on Hopper), `tensor(shape, dtype)` views the mapped bytes from the start. The
memory is not the caching allocator's: `torch.cuda.memory_reserved()` leaves it out, `mapped` says it. It is
unmapped and released when the buffer and every tensor viewing it are gone (or by the process's end: not at exit).

`available(device)` says whether this process can use it (libcuda loads, the device supports virtual memory
management); callers fall back to plain allocations otherwise (and where `CompileConfig.kv_grow_in_place` is
off, runtime/engine.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import weakref

import torch

_SUCCESS = 0
_ALLOCATION_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_ACCESS_READWRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_GRANULARITY_RECOMMENDED = 1  # CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
_ATTR_VMM_SUPPORTED = 102  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class DriverError(RuntimeError):
    pass


@functools.cache
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    u64, size = ctypes.c_uint64, ctypes.c_size_t
    sigs = {
        "cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
        "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
        "cuMemGetAllocationGranularity": [ctypes.POINTER(size), ctypes.POINTER(_AllocationProp), ctypes.c_int],
        "cuMemAddressReserve": [ctypes.POINTER(u64), size, size, u64, u64],
        "cuMemAddressFree": [u64, size],
        "cuMemCreate": [ctypes.POINTER(u64), size, ctypes.POINTER(_AllocationProp), u64],
        "cuMemRelease": [u64],
        "cuMemMap": [u64, size, size, u64, u64],
        "cuMemUnmap": [u64, size],
        "cuMemSetAccess": [u64, size, ctypes.POINTER(_AccessDesc), size],
    }
    for name, args in sigs.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def _check(result: int, call: str) -> None:
    if result != _SUCCESS:
        msg = ctypes.c_char_p()
        _libcuda().cuGetErrorString(result, ctypes.byref(msg))
        text = msg.value.decode() if msg.value else "unknown error"
        raise DriverError(f"{call} failed with CUDA driver error {result} ({text})")


def _device_index(device) -> int:
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def _prop(index: int) -> _AllocationProp:
    prop = _AllocationProp()
    prop.type = _ALLOCATION_PINNED
    prop.location = _Location(_LOCATION_DEVICE, index)
    return prop


@functools.cache
def _granularity(index: int) -> int:
    g = ctypes.c_size_t()
    prop = _prop(index)
    _check(_libcuda().cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(prop), _GRANULARITY_RECOMMENDED),
           "cuMemGetAllocationGranularity")  # fmt: skip
    return g.value


def available(device) -> bool:
    """This process can grow buffers in place on `device` (a CUDA device whose driver supports virtual memory
    management)."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        torch.cuda.init()
        supported = ctypes.c_int()
        _check(_libcuda().cuDeviceGetAttribute(ctypes.byref(supported), _ATTR_VMM_SUPPORTED, _device_index(device)),
               "cuDeviceGetAttribute")  # fmt: skip
        return bool(supported.value)
    except (OSError, DriverError):
        return False


def granularity(device) -> int:
    """Bytes a mapping rounds up to on `device`."""
    return _granularity(_device_index(device))


class _Mapping:
    """The driver objects behind one buffer; `release` undoes them (also at garbage collection)."""

    def __init__(self, index: int, capacity: int):
        self.index, self.capacity = index, capacity
        self.base = ctypes.c_uint64()
        self.chunks: list[tuple[int, int, int]] = []  # (offset, size, handle)
        _check(_libcuda().cuMemAddressReserve(ctypes.byref(self.base), capacity, 0, 0, 0), "cuMemAddressReserve")

    def release(self) -> None:
        # work queued on the memory finishes before it is unmapped (CUDA may be torn down at interpreter exit)
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(self.index)
        lib = _libcuda()
        for offset, size, handle in reversed(self.chunks):
            lib.cuMemUnmap(self.base.value + offset, size)
            lib.cuMemRelease(handle)
        self.chunks.clear()
        if self.base.value:
            lib.cuMemAddressFree(self.base.value, self.capacity)
            self.base = ctypes.c_uint64()


class _View:
    """A `__cuda_array_interface__` over the buffer's first bytes; the tensor made from it keeps it, and
    through it the buffer, alive."""

    def __init__(self, owner: GrowableBuffer, nbytes: int):
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (owner.address, False),
            "version": 2,  # no stream: the bytes are only read by work queued after this
        }


class GrowableBuffer:
    """`capacity` bytes of address space on `device`, physical memory mapped for the first `mapped` of them."""

    def __init__(self, capacity: int, device):
        self.index = _device_index(device)
        self.device = torch.device("cuda", self.index)
        self.granularity = _granularity(self.index)
        self.capacity = _round_up(max(capacity, 1), self.granularity)
        self._mapping = _Mapping(self.index, self.capacity)
        self._finalizer = weakref.finalize(self, self._mapping.release)
        # Not at interpreter exit (the `draftgraph` command's `finish` runs the exit handlers too): the process's
        # end gives the whole device back at once; unmapping the KV cache's tens of GiB buffer by buffer first
        # is work nobody waits for, and CUDA may already be torn down by then.
        self._finalizer.atexit = False
        self.mapped = 0

    @property
    def address(self) -> int:
        return self._mapping.base.value

    def grow(self, nbytes: int) -> None:
        """Map physical memory so that the first `nbytes` bytes are backed (never shrinks); the new bytes are
        zeroed (on the current stream)."""
        if nbytes > self.capacity:
            raise ValueError(f"a buffer reserved for {self.capacity} bytes cannot grow to {nbytes}")
        want = _round_up(nbytes, self.granularity)
        if want <= self.mapped:
            return
        lib, size, offset = _libcuda(), want - self.mapped, self.mapped
        handle = ctypes.c_uint64()
        prop = _prop(self.index)
        _check(lib.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(prop), 0), f"cuMemCreate({size} bytes)")
        try:
            _check(lib.cuMemMap(self.address + offset, size, 0, handle.value, 0), "cuMemMap")
        except DriverError:
            lib.cuMemRelease(handle.value)
            raise
        self._mapping.chunks.append((offset, size, handle.value))
        access = _AccessDesc(_Location(_LOCATION_DEVICE, self.index), _ACCESS_READWRITE)
        _check(lib.cuMemSetAccess(self.address + offset, size, ctypes.byref(access), 1), "cuMemSetAccess")
        self.mapped = want
        self.tensor((want,), torch.uint8)[offset:].zero_()

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of `shape` over the buffer's first bytes (which must be mapped)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self.mapped:
            raise ValueError(f"a tensor of {nbytes} bytes over a buffer with {self.mapped} mapped")
        raw = torch.as_tensor(_View(self, max(nbytes, 1)), device=self.device)
        return raw[:nbytes].view(dtype).view(shape)


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to
