"""The dispatcher over every batch shape: uniform and mixed, every size 1..max+1, both bounds."""

import pytest

from draftgraph.compiler.config import CUDAGraphMode
from draftgraph.runtime.dispatcher import BatchDescriptor, Dispatcher

K = 3
FULL_REQS = (1, 2, 4, 8, 16)  # FULL bound: 16 requests
PIECEWISE = (1, 2, 4, 8, 16, 32, 48, 64)  # PIECEWISE bound: 64 tokens
QS = (1, K + 1)


def make(mode):
    return Dispatcher(CUDAGraphMode(mode), PIECEWISE, FULL_REQS, QS)


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "FULL", "PIECEWISE", "NONE"])
def test_every_uniform_and_mixed_shape(mode):
    d = make(mode)
    has_full = mode.startswith("FULL")
    has_pw = mode in ("PIECEWISE", "FULL_AND_PIECEWISE")
    for q in (1, K + 1, 2):  # 2: a uniform query length without full graphs
        for b in range(1, 18):  # every request count up to the bound + 1
            t = b * q
            got = d.dispatch(BatchDescriptor(t, b, q))
            if has_full and q in QS and b <= 16:
                pb = min(s for s in FULL_REQS if s >= b)
                assert (got.runtime, got.num_reqs, got.num_tokens, got.key) == ("FULL", pb, pb * q, f"full/q{q}/b{pb}")
            elif has_pw and t <= 64:
                pt = min(s for s in PIECEWISE if s >= t)
                assert (got.runtime, got.num_tokens, got.num_reqs) == ("PIECEWISE", pt, b)
            else:
                assert (got.runtime, got.num_tokens, got.num_reqs, got.key) == ("NONE", t, b, "none")
    for t in range(1, 66):  # mixed batches: never FULL
        got = d.dispatch(BatchDescriptor(t, 3, None))
        if has_pw and t <= 64:
            assert got.runtime == "PIECEWISE" and got.num_tokens == min(s for s in PIECEWISE if s >= t)
        else:
            assert got.runtime == "NONE" and got.num_tokens == t


def test_bounds_are_separate():
    d = make("FULL_AND_PIECEWISE")
    # 16 requests x 4 tokens = 64 tokens: FULL (request bound 16) although PIECEWISE would also fit
    assert d.dispatch(BatchDescriptor(64, 16, 4)).runtime == "FULL"
    # 17 requests x 4 = 68 tokens: past both bounds
    assert d.dispatch(BatchDescriptor(68, 17, 4)).runtime == "NONE"
    # 17 requests x 1 token: past the FULL bound, inside the PIECEWISE one
    assert d.dispatch(BatchDescriptor(17, 17, 1)).runtime == "PIECEWISE"


def test_graph_keys_and_step_shapes():
    """Query lengths come from StepShapes alone; keys name what stats report."""
    from draftgraph.compiler.cuda_graphs import GraphKey, StepShapes

    eagle, draft_model, plain = StepShapes(3), StepShapes(3, drafter_reads_hidden=False), StepShapes(0)
    assert (eagle.verify, eagle.first_draft, eagle.later_draft) == (4, 4, 1)
    assert (draft_model.verify, draft_model.first_draft) == (4, 5)  # a draft model also reads the new token
    assert eagle.full_query_lens == (1, 4) and draft_model.full_query_lens == (1, 4, 5)
    assert plain.full_query_lens == (1,)
    d = make("FULL_AND_PIECEWISE")
    full, pw = d.dispatch(BatchDescriptor(12, 3, 4)), d.dispatch(BatchDescriptor(5, 2, None))
    assert full.graph_key("target") == GraphKey.full("target", 4, 4) and str(full.graph_key("target")) == (
        "target/full/q4/b4"
    )
    assert pw.graph_key("drafter").name == "drafter/piecewise/t8" and pw.key == "piecewise/t8"
    assert str(GraphKey.piecewise("target", 16, piece=2)) == "target/piecewise/t16/piece2"
    assert GraphKey.loop(4, 8, "greedy").name == "drafter/loop/q4/b8/greedy"
    assert d.dispatch(BatchDescriptor(100, 3, None)).graph_key("target") is None


def test_full_decode_only_is_folded_into_full():
    import draftgraph as dg

    with pytest.raises(ValueError, match="FULL_DECODE_ONLY.*use mode='FULL'"):
        dg.CompileConfig(mode="FULL_DECODE_ONLY")
