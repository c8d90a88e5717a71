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


# ---- prefix caching: the hash chain and the allocator's cached blocks ------------------------------------------


def test_hash_chain_is_stable_and_covers_every_earlier_token():
    import hashlib

    from draftgraph.runtime.prefix_cache import PrefixKey, cache_seed

    seed = cache_seed("model", "float32")
    key = PrefixKey(seed, block_size=4)
    tokens = list(range(10, 21))  # 11 tokens: 2 full blocks
    hashes = key.extend([], tokens, num_blocks=5)
    assert len(hashes) == 2  # the third block is not full
    # blake2b of the parent's hash and the block's ids as int64: the same in every process (not Python's hash())
    first = hashlib.blake2b(seed + np.arange(10, 14, dtype=np.int64).tobytes(), digest_size=16).digest()
    assert hashes[0] == first
    assert hashes[1] == hashlib.blake2b(first + np.arange(14, 18, dtype=np.int64).tobytes(), digest_size=16).digest()
    changed = key.extend([], [99] + tokens[1:], num_blocks=2)
    assert changed[0] != hashes[0] and changed[1] != hashes[1]  # a block's hash covers the blocks before it
    assert PrefixKey(cache_seed("model", "bfloat16"), 4).extend([], tokens, 2) != hashes  # the seed separates caches
    # A head drafter's entries read the token after each block: it is in the hash, and a block waits for it.
    ahead = PrefixKey(seed, 4, lookahead=1)
    assert len(ahead.extend([], tokens[:8], 2)) == 1 and len(ahead.extend([], tokens[:9], 2)) == 2
    other_next = ahead.extend([], tokens[:8] + [77], 2)
    assert other_next[0] == ahead.extend([], tokens[:9], 2)[0] and other_next[1] != ahead.extend([], tokens[:9], 2)[1]
    # extending a chain in place equals hashing at once; a lookup never covers the prompt's last token
    part = key.extend([], tokens, 1)
    assert key.extend(part, tokens, 2) == hashes
    assert [key.max_hit_blocks(n) for n in (1, 4, 5, 8, 9)] == [0, 0, 1, 1, 2]


def test_cached_blocks_are_shared_counted_and_evicted_least_recently_used():
    alloc = BlockAllocator(6)
    a = BlockTable(alloc, 4)
    a.ensure_capacity(12)  # blocks 0, 1, 2
    hashes = [b"h0", b"h1", b"h2"]
    for blk, h in zip(a.blocks.tolist(), hashes):
        assert alloc.register(blk, h)
    assert not alloc.register(5, b"h0")  # another block holds h0: the first one is kept
    b = BlockTable(alloc, 4)
    found = alloc.lookup([b"h0", b"h1", b"zz", b"h2"])
    assert found == [0, 1]  # the longest cached chain only
    b.adopt(found)
    assert [alloc.ref_count(i) for i in range(3)] == [2, 2, 1] and b.num_registered == 2
    b.ensure_capacity(9)  # one more block of its own
    assert b.blocks.tolist() == [0, 1, 3] and alloc.num_free == 2
    a.release()  # blocks 0, 1 still held by b; block 2 is cached and free
    assert [alloc.ref_count(i) for i in range(3)] == [1, 1, 0] and alloc.num_free == 3
    b.release()  # 3 was never registered: free list; 1, then 0 join the LRU after 2
    assert alloc.num_free == 6 and alloc.num_cached == 3 and all(alloc.ref_count(i) == 0 for i in range(6))
    # sharing a free cached block takes it off the LRU (and the free count)
    c = BlockTable(alloc, 4)
    c.adopt(alloc.lookup([b"h0"]))
    assert alloc.num_free == 5 and alloc.num_unheld([1, 2]) == 2
    # empty blocks go first (4, 5, 3), then the least recently freed cached ones: 2, then 1 (0 is held)
    assert alloc.allocate(3) == [3, 4, 5] and alloc.evictions == 0
    assert alloc.allocate(1) == [2] and alloc.lookup([b"h0", b"h1", b"h2"]) == [0, 1]
    assert alloc.allocate(1) == [1] and alloc.lookup([b"h0", b"h1"]) == [0] and alloc.evictions == 2
    with pytest.raises(OutOfBlocksError, match="asked for 1 KV-cache blocks with 0 of 6 free"):
        alloc.allocate(1)
    with pytest.raises(RuntimeError, match="freed more often"):
        alloc.free([1, 1])
