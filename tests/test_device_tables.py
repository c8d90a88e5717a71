"""Per-slot block tables on the device (runtime/device_tables.py): rows follow the requests' tables as they
grow, a step with nothing new sends nothing, a new owner or `invalidate()` rewrites a row whole, and a table
wider than the rows is refused with the remedy."""

from types import SimpleNamespace

import pytest
import torch

from draftgraph.runtime.device_tables import DeviceTables
from draftgraph.runtime.kv_cache import BlockAllocator, BlockTable


def req(rid, slot, alloc, tokens):
    table = BlockTable(alloc, 4)
    table.ensure_capacity(tokens)
    return SimpleNamespace(id=rid, slot=slot, block_table=table)


def rows_match(dt, reqs):
    for r in reqs:
        n = len(r.block_table.blocks)
        assert dt.tables[r.slot, :n].tolist() == r.block_table.blocks.tolist()


def test_rows_follow_growth_and_owners():
    alloc = BlockAllocator(64)
    dt = DeviceTables(max_slots=4, max_blocks=8, device="cpu")
    a, b = req("a", 2, alloc, 5), req("b", 0, alloc, 9)
    dt.update([a, b])
    rows_match(dt, [a, b])
    assert dt.uploads == 1 and dt.tables[4].eq(0).all()  # the scratch row stays zeros
    dt.update([a, b])
    assert dt.uploads == 1  # nothing new: no copy
    a.block_table.ensure_capacity(13)  # a grows by two blocks
    dt.update([a, b])
    rows_match(dt, [a, b])
    assert dt.uploads == 2
    a.block_table.release()
    c = req("c", 2, alloc, 7)  # another request takes a's slot (a new table): its row is rewritten whole
    dt.update([c, b])
    rows_match(dt, [c, b])
    b.block_table.release()  # b is preempted and regrows to as many blocks, other ids
    alloc.allocate(3)
    b.block_table.ensure_capacity(9)
    dt.invalidate()  # the runner's step that readmitted it did not go through the rows
    dt.update([c, b])
    rows_match(dt, [c, b])


def test_a_table_wider_than_the_rows_is_refused():
    dt = DeviceTables(max_slots=2, max_blocks=2, device="cpu")
    with pytest.raises(ValueError, match="owns 3 blocks, over max_blocks_per_req=2; raise max_model_len"):
        dt.update([req("x", 0, BlockAllocator(8), 12)])
    assert torch.equal(dt.tables, torch.zeros(3, 2, dtype=torch.int32))
