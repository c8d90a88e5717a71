"""SamplingParams.logprobs under speculation (CPU, float32, a draft model at K = 3).

Oracle: transformers' forward on the same weights over prompt + output: the log-softmax of its logits at
each position that predicted a generated token. Accepted drafts, bonus tokens and the first token after the
prompt all take the target's raw logits (sampled rows too: before temperature). FULL_AND_PIECEWISE runs with
the eager backend (the dispatch and the one-graph step's code are under test, not Inductor's)."""

import pytest
import torch

import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model

K = 3
TOL = 1e-4
PROMPTS = [[5, 17, 3, 88, 41], [9, 2], [60, 61, 62, 63, 64, 65, 66], [1, 30, 30, 7]]
PARAMS = [
    dg.SamplingParams(max_tokens=14, ignore_eos=True, logprobs=5),
    dg.SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0),
    dg.SamplingParams(max_tokens=6, ignore_eos=True, logprobs=3, temperature=0.8, seed=3),
    dg.SamplingParams(max_tokens=10, ignore_eos=True),
]
ARRIVALS = [0, 0, 1, 2]  # mixed steps (a prefill beside verifies) first, uniform verify batches after


@pytest.fixture(scope="module")
def models():
    hf = tiny_hf_model("llama")
    target = CausalLM.from_hf(hf)
    return hf, target, make_drafter("draft_model", target)


def config(mode):
    return dg.CompileConfig(
        mode=mode, num_speculative_tokens=K, max_num_seqs=4, max_num_batched_tokens=64, compile_backend="eager",
        capture_sizes=(1, 4, 16), full_capture_sizes=(1, 2, 4), progress=False,
    )  # fmt: skip


@pytest.fixture(scope="module", params=["NONE", "FULL_AND_PIECEWISE"])
def run(request, models):
    _, target, drafter = models
    eng = dg.compile_model(target, drafter, config(request.param))
    outs = eng.generate(PROMPTS, PARAMS, ARRIVALS)
    yield request.param, outs, eng.stats()
    eng.close()


def hf_logprobs(hf, prompt, output) -> torch.Tensor:
    """log-softmax [len(output), V] of transformers' logits at the positions that predicted `output`."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + output])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : len(prompt) + len(output) - 1]


def test_logprobs_equal_transformers_log_softmax(models, run):
    hf = models[0]
    _, outs, stats = run
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"]  # accepted drafts and rejections both ran
    for prompt, params, out in zip(PROMPTS, PARAMS, outs):
        assert len(out.token_ids) == params.max_tokens
        if params.logprobs is None:
            assert out.logprobs is None and out.cumulative_logprob is None
            continue
        ref = hf_logprobs(hf, prompt, out.token_ids)
        assert len(out.logprobs) == len(out.token_ids)
        for j, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            if params.temperature == 0:
                assert tok == int(ref[j].argmax()), f"greedy token {j}"
            top = ref[j].topk(params.logprobs).indices.tolist()
            assert set(entry) == set(top) | {tok}, f"token {j}: ids {sorted(entry)} vs {sorted(set(top) | {tok})}"
            for t, v in entry.items():
                assert abs(v - float(ref[j, t])) < TOL, f"token {j}, id {t}: {v} vs {float(ref[j, t])}"
        chosen = ref.gather(1, torch.tensor(out.token_ids)[:, None]).sum()
        assert out.cumulative_logprob == pytest.approx(float(chosen), abs=TOL * len(out.token_ids))


def test_uniform_batches_with_logprobs_run_the_one_graph_step(run):
    mode, _, stats = run
    if mode == "NONE":
        assert stats["fallbacks"] == 0 and not any(key.startswith("step/") for key in stats["dispatch"])
        return
    # On the CPU no graph replays: every forward is a fallback counted under the key it was dispatched to. Uniform
    # verify batches dispatched the whole step with logprobs (sampled while request 2 ran, greedy after) and never
    # the verify on its own (target/full/...), so no uniform batch left the one-graph step.
    by_key = stats["fallbacks_by_key"]
    assert set(stats["dispatch"]) == {"target/none", "drafter/none", "step/none"}
    for variant in ("greedy_logprobs", "sample_logprobs"):
        assert sum(n for key, n in by_key.items() if key.startswith(f"step/q{K + 1}/b") and key.endswith(variant)) > 0
    assert not any(key.startswith("target/full/") for key in by_key)
    assert not any(key.endswith("/greedy") or key.endswith("/sample") for key in by_key)


@pytest.mark.parametrize("bad", [-1, 21, True, 2.5, "5"])
def test_logprobs_are_checked(bad):
    with pytest.raises(ValueError, match=r"logprobs=.*must be None \(off\) or an int in \[0, 20\]"):
        dg.SamplingParams(logprobs=bad)
