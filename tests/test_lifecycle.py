"""Engine lifecycle on the CPU (mode NONE, the built-in pair): `with compile_model(...) as engine:` closes it,
a closed engine refuses work with a message that says what to do, and `abort` gives a request's KV blocks back
(counted on the allocator) while the other requests go on to the tokens they get alone."""

import pytest

import draftgraph as dg
from draftgraph.models.builtin import BuiltinSpec, builtin_pair

CONFIG = dict(mode="NONE", num_speculative_tokens=2, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=96)
SPEC = BuiltinSpec(num_layers=2, draft_layers=1, vocab_size=128, hidden_size=64, intermediate_size=128)
PROMPTS = [[1, 5, 9, 11], [7, 7, 3], [4, 2, 8, 16, 32]]
PARAMS = dg.SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def pair():
    return builtin_pair(SPEC)


def engine(pair):
    target, drafter = pair
    return dg.compile_model(target, drafter, dg.CompileConfig(**CONFIG))


def test_context_manager_closes_and_refuses_later_work(pair):
    with engine(pair) as e:
        assert not e.closed
        ref = e.generate(PROMPTS, PARAMS)
        blocks = e.config.num_kv_blocks
    assert e.closed and e.runner is None and e.compiled is None and e.target is None
    e.close()  # idempotent
    with pytest.raises(RuntimeError, match=r"this engine is closed; check_request\(\) needs a new engine"):
        e.generate(PROMPTS, PARAMS)
    for call in (lambda: e.add_request([1, 2]), e.step, e.stats):
        with pytest.raises(RuntimeError, match="this engine is closed"):
            call()
    # A new engine in the same process: the same cache size and the same tokens.
    with engine(pair) as again:
        assert again.config.num_kv_blocks == blocks
        assert [o.token_ids for o in again.generate(PROMPTS, PARAMS)] == [o.token_ids for o in ref]


def test_abort_frees_blocks_and_leaves_the_others_alone(pair):
    with engine(pair) as e:
        ref = [o.token_ids for o in e.generate(PROMPTS, PARAMS)]
        total = e.num_free_kv_blocks
        assert total == e.config.num_kv_blocks  # generate's requests gave every block back
        ids = [e.add_request(p, PARAMS) for p in PROMPTS]
        e.step()  # all three prefilled: each holds blocks
        e.step()
        held = total - e.num_free_kv_blocks
        mine = e.scheduler.running[1].block_table.blocks.size
        assert e.scheduler.running[1].id == ids[1] and held > mine > 0
        assert e.abort(ids[1]) is True
        assert total - e.num_free_kv_blocks == held - mine  # its blocks are free now, the others' are not
        assert e.abort(ids[1]) is False and e.abort(12345) is False  # gone already / never existed
        outs = {}
        while e.has_unfinished():
            outs.update({o.request_id: o for o in e.step()})
        assert sorted(outs) == [ids[0], ids[2]]  # the aborted one never finishes
        assert outs[ids[0]].token_ids == ref[0] and outs[ids[2]].token_ids == ref[2]
        assert e.num_free_kv_blocks == total


def test_abort_a_waiting_request(pair):
    with engine(pair) as e:
        total = e.num_free_kv_blocks
        rid = e.add_request(PROMPTS[0], PARAMS)
        assert e.abort(rid) and not e.has_unfinished() and e.num_free_kv_blocks == total
        assert e.step() == []


def test_close_aborts_unfinished_requests(pair):
    e = engine(pair)
    for p in PROMPTS:
        e.add_request(p, PARAMS)
    e.step()
    allocator = e.allocator
    assert allocator.num_free < e.config.num_kv_blocks
    e.close()
    assert allocator.num_free == e.config.num_kv_blocks and not e.has_unfinished()
