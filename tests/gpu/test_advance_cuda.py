"""GPU tier: a draft step's metadata advance in one Triton kernel (ops/attention/triton_advance.py) equals the
torch ops it replaces (runtime/drafting.py `advance`) at every batch size across the kernel's block, padding
rows included, and replays from a CUDA graph."""

import pytest
import torch

from draftgraph.ops.attention.metadata import META_FIELDS
from draftgraph.runtime.drafting import advance, advance_next

pytestmark = pytest.mark.gpu


def _case(b: int, width: int, block_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    tables = torch.randint(0, 5000, (b, width), generator=g, dtype=torch.int32)
    pos = torch.randint(0, width * block_size - 1, (b,), generator=g)
    valid = torch.rand(b, generator=g) < 0.8
    return tables.cuda(), pos.cuda(), valid.cuda()


@pytest.mark.parametrize("block_size", [16, 1])
@pytest.mark.parametrize("b", [1, 2, 7, 64, 127, 128, 129, 300])
def test_one_kernel_equals_the_torch_ops(b, block_size):
    tables, pos, valid = _case(b, 9, block_size, seed=b)
    ref_pos, ref = advance(tables, pos + 1, valid, block_size)
    got_pos, got = advance_next(tables, pos, valid, block_size)
    assert torch.equal(got_pos, ref_pos) and got_pos.dtype == ref_pos.dtype
    for f in META_FIELDS:
        r, x = getattr(ref, f), getattr(got, f)
        assert x.dtype == r.dtype and torch.equal(x, r), f
    assert (got.slot_mapping[~valid] == -1).all() and (got.token_kv_len[~valid] == 0).all()


def test_replays_from_a_graph():
    tables, pos, valid = _case(24, 9, 16, seed=0)
    advance_next(tables, pos, valid, 16)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_pos, meta = advance_next(tables, pos, valid, 16)
    new_tables, new_pos, new_valid = _case(24, 9, 16, seed=1)
    tables.copy_(new_tables), pos.copy_(new_pos), valid.copy_(new_valid)
    graph.replay()
    ref_pos, ref = advance(tables, pos + 1, valid, 16)
    assert torch.equal(out_pos, ref_pos)
    assert all(torch.equal(getattr(meta, f), getattr(ref, f)) for f in META_FIELDS)


@pytest.mark.parametrize("q", [1, 5, 6])
@pytest.mark.parametrize("b", [1, 3, 64, 129])
def test_uniform_metadata_kernel_equals_the_reference(b, q):
    """The one-graph step's metadata (ops/attention/uniform_metadata.py): one kernel against the torch ops, at
    batch sizes across the kernel's token block, padding rows (the scratch slot) included."""
    from draftgraph.ops.attention.uniform_metadata import uniform_metadata, uniform_metadata_reference

    g = torch.Generator().manual_seed(b * 10 + q)
    width, bs, n_slots = 300, 16, 200  # rows wider than one BLOCK_W step
    tables = torch.randint(0, 5000, (n_slots + 1, width), generator=g, dtype=torch.int32)
    tables[n_slots] = 0
    valid = (torch.rand(b, generator=g) < 0.8).long()
    slots = torch.where(valid != 0, torch.randperm(n_slots, generator=g)[:b], n_slots)
    lengths = torch.where(valid != 0, torch.randint(0, width * bs - q, (b,), generator=g), 0)
    args = [t.cuda() for t in (tables, slots, lengths, valid)]
    ref_pos, ref = uniform_metadata_reference(*args, q, bs)
    got_pos, got = uniform_metadata(*args, q, bs)
    assert torch.equal(got_pos, ref_pos)
    for f in META_FIELDS:
        r, x = getattr(ref, f), getattr(got, f)
        assert x.dtype == r.dtype and x.shape == r.shape and torch.equal(x, r), f
    graph = torch.cuda.CUDAGraph()  # and from a graph, on inputs changed in place
    with torch.cuda.graph(graph):
        out_pos, meta = uniform_metadata(*args, q, bs)
    args[2].add_(1)
    graph.replay()
    ref_pos, ref = uniform_metadata_reference(*args, q, bs)
    assert torch.equal(out_pos, ref_pos) and all(torch.equal(getattr(meta, f), getattr(ref, f)) for f in META_FIELDS)
