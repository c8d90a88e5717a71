"""GPU tier: device buffers that grow in place (runtime/growable.py), the KV cache's backing when it is sized
after capture: the address stays, contents survive growth, new bytes are zeroes, a CUDA graph captured on the
small tensor reads and writes the grown one, and the memory goes back when the last tensor is gone."""

import gc

import pytest
import torch

from draftgraph.runtime.growable import GrowableBuffer, available, granularity
from draftgraph.runtime.kv_cache import KVCacheSpec, PagedKVCache

pytestmark = pytest.mark.gpu


def test_available_and_granularity():
    assert available("cuda")
    assert granularity("cuda") >= 4096 and granularity("cuda") & (granularity("cuda") - 1) == 0


def test_buffer_grows_at_its_address_and_keeps_its_bytes():
    g = granularity("cuda")
    buf = GrowableBuffer(64 * g, "cuda")
    buf.grow(1000)
    assert buf.mapped == g
    small = buf.tensor((250,), torch.float32)
    assert small.abs().sum().item() == 0  # mapped memory starts zeroed
    small.copy_(torch.arange(250, device="cuda", dtype=torch.float32))
    addr = small.data_ptr()
    buf.grow(5 * g + 3)
    assert buf.mapped == 6 * g
    big = buf.tensor((6 * g // 4,), torch.float32)
    assert big.data_ptr() == addr == buf.address
    assert torch.equal(big[:250], torch.arange(250, device="cuda", dtype=torch.float32))
    assert big[250:].abs().sum().item() == 0
    with pytest.raises(ValueError, match="cannot grow"):
        buf.grow(65 * g)
    with pytest.raises(ValueError, match="mapped"):
        buf.tensor((7 * g,), torch.uint8)


def test_graph_captured_on_the_small_tensor_reaches_the_grown_one():
    """As the KV cache's Triton kernels do: a graph captured while the tensor held g bytes writes and reads a
    slot past them once the buffer has grown (the kernel takes the base address, not the size)."""
    import triton
    import triton.language as tl

    @triton.jit
    def write_then_read(cache, slot, value, out):
        s = tl.load(slot)
        tl.store(cache + s, tl.load(value))
        tl.store(out, tl.load(cache + s) * 2)

    g = granularity("cuda")
    buf = GrowableBuffer(16 * g, "cuda")
    buf.grow(g)
    small = buf.tensor((g // 4,), torch.float32)
    slot = torch.zeros(1, dtype=torch.long, device="cuda")
    value = torch.zeros(1, device="cuda")
    out = torch.zeros(1, device="cuda")
    write_then_read[(1,)](small, slot, value, out)  # compiled outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_then_read[(1,)](small, slot, value, out)
    buf.grow(8 * g)
    big = buf.tensor((8 * g // 4,), torch.float32)
    far = 7 * g // 4 + 5  # past what was mapped at capture
    slot.fill_(far)
    value.fill_(3.5)
    graph.replay()
    torch.cuda.synchronize()
    assert big[far].item() == 3.5 and out.item() == 7.0


@pytest.mark.whole_device
def test_memory_goes_back_when_the_last_tensor_is_gone(settled_device):
    g = granularity("cuda")
    warm = GrowableBuffer(g, "cuda")  # the first use loads the fill kernel's module (lazily, device memory)
    warm.grow(g)
    del warm
    gc.collect()
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    buf = GrowableBuffer(512 * g, "cuda")
    buf.grow(256 * g)
    t = buf.tensor((256 * g,), torch.uint8)
    del buf
    gc.collect()
    assert torch.cuda.mem_get_info()[0] <= free0 - 256 * g + 8 * g  # the tensor keeps the mapping
    del t
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.mem_get_info()[0] >= free0 - 8 * g


def test_paged_cache_grows_in_place():
    spec = KVCacheSpec(num_layers=3, num_blocks=4, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    cache = PagedKVCache(spec, "cuda", reserve_blocks=1000)
    assert cache.grows_in_place and cache.num_tensors == 6
    ptrs = [t.data_ptr() for kv in cache.layers for t in kv]
    layers = cache.layers
    cache.layers[1][0][3].fill_(1.0)
    cache.resize(900)
    assert cache.layers is layers  # holders of the list see the new tensors
    assert [t.data_ptr() for kv in cache.layers for t in kv] == ptrs
    assert all(t.shape[0] == 900 for kv in cache.layers for t in kv)
    assert cache.layers[1][0][3].float().mean().item() == 1.0 and cache.layers[1][0][4:].abs().sum().item() == 0
    assert cache.mapped_bytes >= 900 * spec.bytes_per_block
    with pytest.raises(ValueError, match="more than the 1000 blocks reserved"):
        cache.resize(1001)


def test_no_unmapping_at_interpreter_exit():
    """A buffer still alive when the interpreter exits is not unmapped by the exit handlers (the `draftgraph`
    command runs them before it ends): the process's end gives the device back at once. A process that maps
    1 GiB and exits exits cleanly."""
    import subprocess
    import sys

    code = (
        "import atexit, torch\n"
        "from draftgraph.runtime import growable\n"
        "released = []\n"
        "growable._Mapping.release = lambda self: released.append(1)  # what the finalizer would call\n"
        "buf = growable.GrowableBuffer(2**30, 'cuda'); buf.grow(2**30)\n"
        "atexit._run_exitfuncs()\n"
        "print('released at exit:', len(released))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("released at exit: 0")
