"""Several ranks on the CPU (gloo): compile_model with tensor_parallel_size 2 starts two worker processes,
each loading its share of the target and of the draft model (heads and MLP split, all-reduced), and its
driver's answers equal the one-process engine's; a bad draft TP fails before anything starts; a rank that
dies or raises stops them all."""

import multiprocessing
import os
import signal
from dataclasses import replace

import pytest

import draftgraph as dg
from draftgraph import timeline
from draftgraph.models.builtin import BuiltinSpec, builtin_hf_target
from draftgraph.workers.driver import WorkerError
from tests.helpers import nothing_starts, within

HANG_S = 300  # a dead rank is noticed by its process sentinel, at once; this long means it hung

SPEC = BuiltinSpec(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_layers=3,
    num_heads=2,
    num_kv_heads=2,
    head_dim=32,
    draft_layers=1,
    max_position_embeddings=256,
)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]
PARAMS = dg.SamplingParams(max_tokens=12, ignore_eos=True)


def config(**over) -> dg.CompileConfig:
    fields = dict(mode="NONE", device="cpu", num_speculative_tokens=2, max_num_seqs=4, max_num_batched_tokens=64)
    return dg.CompileConfig(**{**fields, "max_model_len": 128, **over})


def wait_gone(proc, timeout_s: float) -> bool:
    proc.join(timeout_s)
    return not proc.is_alive()


def test_bad_tensor_parallel_sizes_fail_before_anything_starts(monkeypatch):
    started = nothing_starts(monkeypatch)
    with pytest.raises(ValueError, match=r"draft_tensor_parallel_size=3 with tensor_parallel_size=4.*\[1, 4\]"):
        config(tensor_parallel_size=4, draft_tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size=0 must be at least 1"):
        config(tensor_parallel_size=0)
    assert config(tensor_parallel_size=2, draft_tensor_parallel_size=1).draft_tensor_parallel_size == 1
    from draftgraph.cli import main

    assert main(["generate", "--device", "cpu", "--tp", "2", "--draft-tp", "3"]) == 2
    assert started == [] and not multiprocessing.active_children()  # no model, engine or process started


def test_two_ranks_equal_one_process_then_a_killed_rank_stops_both():
    # transformers objects: each rank loads its share from their save_pretrained directories
    target, drafter = builtin_hf_target(SPEC), builtin_hf_target(replace(SPEC, num_layers=1, seed=1))
    one = dg.compile_model(target, drafter, config())
    want = [o.token_ids for o in one.generate(PROMPTS, PARAMS)]
    want_steps = one.stats()["steps"]
    before = len(timeline.marks())
    engine = dg.compile_model(target, drafter, config(tensor_parallel_size=2))
    try:
        # rank 0's start-up is in this process's timeline, in its order (the -v printout at TP)
        # (a forked CPU rank's "process started" is its fork server's: there when this call started the server)
        ranks = [p for p, _, _ in timeline.marks()[before:] if p.startswith("rank 0 ") and "started" not in p]
        assert ranks[:4] == ["rank 0 imports", "rank 0 process group", "rank 0 groups", "rank 0 weight load"], ranks
        assert ranks[-1] == "rank 0 engine ready"
        assert engine.config.tensor_parallel_size == 2 and engine.config.draft_tensor_parallel_size == 2
        assert engine.k == 2 and engine.vocab_size == SPEC.vocab_size
        got = [o.token_ids for o in engine.generate(PROMPTS, PARAMS)]
        assert got == want
        stats = engine.stats()  # checks that both ranks took the same steps
        assert stats["steps"] == want_steps and stats["tensor_parallel_size"] == 2
        assert stats["verify_steps"] > 0
        # add_request / step drive every rank alike
        ids = [engine.add_request(p, PARAMS) for p in PROMPTS]
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.token_ids for o in engine.step()})
        assert [done[i] for i in ids] == want
        streamed = [t for d in engine.stream(PROMPTS[:1], PARAMS) for t in d.token_ids]  # a round trip per step
        assert streamed == want[0]
        # a rank killed between steps of running requests: the next call names it, the other rank exits
        engine.add_request(PROMPTS[0], PARAMS)
        engine.step()
        os.kill(engine.pids[1], signal.SIGKILL)
        with pytest.raises(WorkerError, match=r"worker rank 1 of 2 failed during step: .*exited with code -9"):
            within(HANG_S, "engine.step() after rank 1 was killed", engine.step)  # tokens left: both ranks step
        assert wait_gone(engine.procs[0], HANG_S), f"rank 0 still runs {HANG_S} s after rank 1 died"
        with pytest.raises(RuntimeError, match="closed"):
            engine.stats()
        assert not multiprocessing.active_children()
    finally:
        engine.close()


def test_a_rank_that_raises_while_building_surfaces_its_error():
    # A transformers object crosses as a save_pretrained directory; its 256 positions are checked in each rank.
    hf = builtin_hf_target(SPEC)
    with pytest.raises(WorkerError, match=r"worker rank \d of 2 failed during ready: ValueError: max_model_len=512"):
        dg.compile_model(hf, None, config(tensor_parallel_size=2, max_model_len=512))
    assert not multiprocessing.active_children()  # the other rank too


def test_ranks_started_before_the_imports_become_the_engines_ranks():
    """workers/prestart.py: ranks spawned before the command's imports (the CLI on GPUs) import theirs, then wait;
    the build sends each its spec and they run as ranks it started itself: the same tokens as one process, rank 0's
    start-up in the driver's timeline from its own process start; told to stop, they end as spawned GPU ranks do
    (exit handlers, then no teardown: exit code 0). Held ranks of another world size are stopped."""
    from draftgraph.workers import prestart

    target, drafter = builtin_hf_target(SPEC), builtin_hf_target(replace(SPEC, num_layers=1, seed=1))
    want = [o.token_ids for o in dg.compile_model(target, drafter, config()).generate(PROMPTS, PARAMS)]
    prestart.prestart_ranks(2, cuda=False)
    held = [p.pid for p in prestart._held[-1].procs]
    before = len(timeline.marks())
    engine = dg.compile_model(target, drafter, config(tensor_parallel_size=2))
    try:
        assert engine.pids == held and prestart._held == []  # the held processes are the ranks
        assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == want
        ranks = [p for p, _, _ in timeline.marks()[before:] if p.startswith("rank 0 ")]
        assert ranks[:3] == ["rank 0 process started", "rank 0 imports", "rank 0 process group"], ranks
        imports = next(d for p, _, d in timeline.marks()[before:] if p == "rank 0 imports")
        assert int(imports.split()[0]) > 10_000, imports  # the rank froze its imports out of the collector's sight
    finally:
        engine.close()
    assert not multiprocessing.active_children() and [p.exitcode for p in engine.procs] == [0, 0]
    prestart.prestart_ranks(2, cuda=False)
    procs = list(prestart._held[-1].procs)
    assert prestart.take(3) is None and prestart._held == []  # another world size: stopped, not taken
    assert all(wait_gone(p, HANG_S) for p in procs)
