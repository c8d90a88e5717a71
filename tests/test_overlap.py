"""Overlapped steps (CompileConfig.overlap_steps, runtime/engine.py): in steady uniform decoding the next
one-graph step is launched before the host reads the last one, from inputs the step advanced on the device
(runtime/uniform_step.py `_advance`). On the CPU the same code runs without graphs: the tokens equal the
steps read one at a time and mode NONE, greedy and sampled, with requests that join, stop on a token
(their queued step's rows are dropped) or reach max_tokens, and the counters show how many steps overlapped."""

import pytest
import torch

import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model

K = 3


@pytest.fixture(scope="module")
def target():
    return CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96))


def workload(n: int, sampled: bool, stops: bool):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 96, (int(m),), generator=g).tolist() for m in torch.randint(2, 30, (n,), generator=g)]
    params = [
        dg.SamplingParams(
            max_tokens=6 + (5 * i) % 23,
            temperature=0.8 if sampled and i % 2 else 0.0,
            seed=i,
            ignore_eos=True,
            stop_token_ids=[int(t) for t in torch.randint(0, 96, (6,), generator=g)] if stops and i % 3 == 0 else [],
        )
        for i in range(n)
    ]
    arrivals = [0] * (n // 2) + [25 + 9 * i for i in range(n - n // 2)]  # a batch, then late joiners
    return prompts, params, arrivals


def run(target, drafter, mode, sampled, stops, **kw):
    cfg = dg.CompileConfig(mode=mode, num_speculative_tokens=K if drafter is not None else 0, max_num_seqs=8,
                           max_num_batched_tokens=64, compile_backend="eager", progress=False, **kw)  # fmt: skip
    eng = dg.compile_model(target, drafter, cfg)
    outs = eng.generate(*workload(10, sampled, stops))
    return [(o.token_ids, o.finish_reason) for o in outs], eng.stats(), eng


@pytest.mark.parametrize("kind", ["eagle", "draft_model", "ngram", None])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_overlapped_steps_give_the_same_tokens(target, kind, sampled):
    drafter = make_drafter(kind, target) if kind else None
    ref, ref_stats, _ = run(target, drafter, "NONE", sampled, stops=True)
    got, stats, eng = run(target, drafter, "FULL_AND_PIECEWISE", sampled, stops=True)
    assert got == ref
    assert any(reason == "stop" for _, reason in got) and any(reason == "length" for _, reason in got)
    assert eng.config.overlap_steps and stats["overlapped_steps"] > stats["steps"] // 3  # most steps queued ahead
    assert stats["generated_tokens"] == ref_stats["generated_tokens"]
    if kind is not None and not sampled:  # greedy acceptance is the tokens': the same in every run
        assert stats["accepted_tokens"] == ref_stats["accepted_tokens"]
    if kind == "eagle":  # and serial steps (each read before the next is launched) give them too
        one_by_one, serial, _ = run(target, drafter, "FULL_AND_PIECEWISE", sampled, stops=True, overlap_steps=False)
        assert one_by_one == got and serial["overlapped_steps"] == 0
    # every launched step is read once: the runner's copies are all waited for, one wait per step
    assert eng.runner.host.waits == stats["steps"] and eng._pending is None
    assert not eng.has_unfinished()


def test_a_queued_step_of_stopped_requests_is_dropped(target):
    """Every request stops on a token in the step just read: the step queued behind it is waited for and
    dropped, nothing stays in flight, and the engine takes new requests after."""
    drafter = make_drafter("eagle", target)
    cfg = dg.CompileConfig(mode="FULL_AND_PIECEWISE", num_speculative_tokens=K, max_num_seqs=4,
                           max_num_batched_tokens=64, compile_backend="eager", progress=False)  # fmt: skip
    eng = dg.compile_model(target, drafter, cfg)
    prompt = torch.randint(0, 96, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    free = eng.generate([prompt], dg.SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    at = next(i for i in range(8, len(free)) if free[i] not in free[:i])  # a token first out after several steps
    out = eng.generate([prompt], dg.SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[free[at]]))[0]
    assert out.finish_reason == "stop" and out.token_ids == free[: at + 1]
    s = eng.stats()
    assert s["overlapped_steps"] > 0 and s["dropped_steps"] == 1 and eng._pending is None
    again = eng.generate([prompt], dg.SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    assert again == free


def test_config_turns_overlap_off_where_there_is_no_one_graph_step():
    from draftgraph.compiler.config import resolve

    base = dict(num_speculative_tokens=K, max_num_seqs=4, max_num_batched_tokens=64, progress=False)

    def resolved(**kw):
        return resolve(dg.CompileConfig(**base, **kw), 512, has_drafter=True).overlap_steps

    assert resolved(mode="FULL_AND_PIECEWISE") and resolved(mode="FULL")
    assert not resolved(mode="PIECEWISE") and not resolved(mode="NONE")
    assert not resolved(mode="FULL_AND_PIECEWISE", one_graph_step=False)
    assert not resolved(mode="FULL_AND_PIECEWISE", overlap_steps=False)
