"""Per-rank AOT artifacts on the CPU (gloo, two worker processes, PIECEWISE with the eager piece backend): a
TP 2 build writes OUT/rank-0 and OUT/rank-1, each manifest naming its rank; a TP 2 load runs no trace and no
Inductor compile on either rank and gives the one-process engine's tokens; a one-process load of the TP 2 build
is refused by name with the fix; the layout and rank checks themselves without processes."""

import os
import re

import pytest

import draftgraph as dg
from draftgraph.artifacts.ranks import ONE_PROCESS, layout_problem, mismatch
from draftgraph.artifacts.store import MANIFEST, ArtifactError
from draftgraph.build.request import BuildRequest
from draftgraph.models.builtin import builtin_hf_target
from draftgraph.workers.build import build_ranks
from tests.test_workers import PARAMS, PROMPTS, SPEC


def config(**over) -> dg.CompileConfig:
    fields = dict(mode="PIECEWISE", compile_backend="eager", capture_sizes=(4, 16), device="cpu", progress=False)
    fields.update(num_speculative_tokens=2, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128)
    return dg.CompileConfig(**{**fields, **over})


def test_tensor_parallel_artifacts_are_per_rank(tmp_path):
    from dataclasses import replace

    target, drafter = builtin_hf_target(SPEC), builtin_hf_target(replace(SPEC, num_layers=1, seed=1))
    want = [o.token_ids for o in dg.compile_model(target, drafter, config(mode="NONE")).generate(PROMPTS, PARAMS)]
    out = str(tmp_path / "art")
    manifests = build_ranks(BuildRequest(target, drafter, config(tensor_parallel_size=2)), out)
    assert sorted(os.listdir(out)) == ["rank-0", "rank-1"]  # no one-process manifest beside them
    for rank, m in enumerate(manifests):
        assert os.path.isfile(os.path.join(out, f"rank-{rank}", MANIFEST))
        mine = {"world_size": 2, "rank": rank, "tensor_parallel_size": 2, "tp_rank": rank}
        assert m["parallel"] == {**ONE_PROCESS, **mine}
        assert {"target", "drafter"} <= set(m["functions"])

    with dg.compile_model(target, drafter, config(tensor_parallel_size=2), artifacts=out, strict_artifacts=True) as e:
        for rank, info in enumerate(e.rank_info):
            assert f"from {out}/rank-{rank} " in info["warm_up_report"]
            assert not info["compile"]["traces"] and info["compile"]["inductor_compiles"] == 0
        assert [o.token_ids for o in e.generate(PROMPTS, PARAMS)] == want
        assert not e.stats()["compile"]["traces"]  # still none after generating

    # one process given the two ranks' build: refused with both sides and the fix (before anything compiles)
    built = "rank 0 of 2 (tensor_parallel_size=2, data_parallel_size=1)"
    running = "rank 0 of 1 (tensor_parallel_size=1, data_parallel_size=1)"
    fix = "rebuild them with `draftgraph build --tp 1 --dp 1`, or run with --tp 2 --dp 1"
    with pytest.raises(ArtifactError, match=re.escape(f"built for {built}, but this engine is {running}: {fix}")):
        dg.compile_model(target, drafter, config(), artifacts=out, strict_artifacts=True)


def test_rank_and_layout_mismatches_are_named(tmp_path):
    one = tmp_path / "one"  # a one-process build's directory (only its manifest matters here)
    one.mkdir()
    (one / MANIFEST).write_text('{"parallel": {"world_size": 1, "rank": 0, "tensor_parallel_size": 1, '
                                '"data_parallel_size": 1, "expert_parallel": false}}')  # fmt: skip
    two = {**ONE_PROCESS, "world_size": 2, "tensor_parallel_size": 2}
    rank1 = {**two, "rank": 1, "tp_rank": 1}
    assert layout_problem(str(one), ONE_PROCESS) is None and mismatch(str(one), ONE_PROCESS, ONE_PROCESS) is None
    # two ranks given a one-process build: rank 1 looks for one/rank-1
    msg = layout_problem(str(one / "rank-1"), rank1)
    assert f"artifacts in {one} were built for rank 0 of 1" in msg and "this engine is rank 1 of 2" in msg
    assert msg.endswith("rebuild them with `draftgraph build --tp 2 --dp 1`, or run with --tp 1 --dp 1")
    # per-rank directories swapped: the rank is named, and where each rank loads from
    msg = mismatch(str(tmp_path / "art" / "rank-0"), rank1, two)
    assert "built for rank 1 of 2" in msg and "this engine is rank 0 of 2" in msg
    assert f"rank r loads {tmp_path / 'art'}/rank-r" in msg
    # four ranks given a two-rank build: rank 2 finds no directory, rank-0's manifest says what was built
    art = tmp_path / "art"
    (art / "rank-0").mkdir(parents=True)
    (art / "rank-0" / MANIFEST).write_text('{"parallel": {"world_size": 2, "rank": 0, "tensor_parallel_size": 2, '
                                           '"data_parallel_size": 1, "expert_parallel": false}}')  # fmt: skip
    four = {**ONE_PROCESS, "world_size": 4, "rank": 2, "tensor_parallel_size": 4, "tp_rank": 2}
    msg = layout_problem(str(art / "rank-2"), four)
    assert "built for rank 0 of 2" in msg and "this engine is rank 2 of 4" in msg and "--tp 4 --dp 1" in msg
    # expert parallelism is part of the rank
    ep = {**ONE_PROCESS, "world_size": 2, "data_parallel_size": 2, "expert_parallel": True}
    assert "--tp 1 --dp 2 --expert-parallel" in mismatch("x", {**ep, "expert_parallel": False}, ep)
