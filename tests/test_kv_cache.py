"""Block allocator, block tables and the metadata builder (addresses stable, padding harmless)."""

import numpy as np
import pytest
import torch

from draftgraph.runtime.attn_metadata import MetadataBuilder, RequestSlice
from draftgraph.runtime.kv_cache import BlockAllocator, BlockTable, KVCacheSpec, OutOfBlocksError


def test_allocator_and_block_table():
    alloc = BlockAllocator(6)
    a, b = BlockTable(alloc, 4), BlockTable(alloc, 4)
    a.ensure_capacity(9)  # ceil(9 / 4) = 3 blocks
    b.ensure_capacity(4)
    assert len(a.blocks) == 3 and len(b.blocks) == 1 and alloc.num_free == 2
    assert not set(a.blocks) & set(b.blocks)
    a.ensure_capacity(12)  # still 3
    assert len(a.blocks) == 3
    with pytest.raises(OutOfBlocksError, match="asked for 3 KV-cache blocks with 2 of 6 free"):
        b.ensure_capacity(16)
    a.release()
    assert alloc.num_free == 5


def test_block_table_ids_are_a_read_only_array_across_growth():
    """The ids live in a numpy array (grown by doubling): kept in order across growth, read-only to callers,
    returned whole by release; a build from them equals a build from the same ids as a list."""
    alloc = BlockAllocator(40)
    other, t = BlockTable(alloc, 4), BlockTable(alloc, 4)
    other.ensure_capacity(8)  # blocks 0, 1: the table's ids do not start at 0
    for n in (1, 5, 17, 70, 130):  # 1, 2, 5, 18 and 33 blocks: across the 16- and 32-entry growth points
        t.ensure_capacity(n)
        assert t.blocks.dtype == np.int64 and t.blocks.tolist() == list(range(2, 2 + -(-n // 4)))
    with pytest.raises(ValueError, match="read-only"):
        t.blocks[0] = 7
    builders = [MetadataBuilder(max_tokens=8, max_reqs=2, max_blocks_per_req=40, block_size=4, device="cpu")
                for _ in range(2)]  # fmt: skip
    metas = [
        b.build([RequestSlice(ids, 126, 4), RequestSlice(other.blocks, 3, 1)], num_tokens_padded=8)[0]
        for b, ids in zip(builders, (t.blocks, t.blocks.tolist()))
    ]
    assert all(torch.equal(getattr(metas[0], f), getattr(metas[1], f)) for f in ("slot_mapping", "block_tables"))
    # positions 126..129: table entries 31 and 32, blocks 33 and 34
    assert metas[0].slot_mapping[:4].tolist() == [33 * 4 + 2, 33 * 4 + 3, 34 * 4, 34 * 4 + 1]
    t.release()
    assert len(t.blocks) == 0 and alloc.num_free == 38


def test_spec_rejects_bad_block_size():
    with pytest.raises(ValueError, match="block_size=6 must be a power of two"):
        KVCacheSpec(1, 4, 6, 1, 8)


def test_builder_layout_padding_and_stable_addresses():
    b = MetadataBuilder(max_tokens=16, max_reqs=4, max_blocks_per_req=4, block_size=2, device="cpu")
    reqs = [RequestSlice([3, 1], 2, 2), RequestSlice([0], 0, 1)]  # request 0: tokens 2, 3; request 1: token 0
    meta, pos = b.build(reqs, num_tokens_padded=5, num_reqs_padded=3)
    assert pos.tolist() == [2, 3, 0, 0, 0]
    assert meta.slot_mapping.tolist() == [1 * 2 + 0, 1 * 2 + 1, 0, -1, -1]  # block 1 holds positions 2, 3
    assert meta.token_req.tolist() == [0, 0, 1, 0, 0]
    assert meta.token_kv_len.tolist() == [3, 4, 1, 0, 0]
    assert meta.seq_lens.tolist() == [4, 1, 0]
    assert meta.query_start_loc.tolist() == [0, 2, 3, 3]
    assert meta.block_tables[:2].tolist() == [[3, 1, 0, 0], [0, 0, 0, 0]]
    ptr = meta.slot_mapping.data_ptr()
    meta2, _ = b.build([RequestSlice([2], 0, 1)])
    assert meta2.slot_mapping.data_ptr() == ptr and meta2.num_tokens == 1  # same buffer, new contents
    with pytest.raises(ValueError, match="owns 1 blocks of 2"):
        b.build([RequestSlice([2], 1, 2)])
    with pytest.raises(ValueError, match=r"padded token count 20 must lie in \[1, 16\]"):
        b.build([RequestSlice([2], 0, 1)], num_tokens_padded=20)


def test_bytes_per_block():
    spec = KVCacheSpec(num_layers=2, num_blocks=1, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert spec.bytes_per_block == 2 * 2 * 16 * 8 * 128 * 2
