"""GPU tier: the n-gram (prompt lookup) drafter with CUDA graphs. Greedy tokens equal the target alone on the
ragged suite (batch up to 8, staggered arrivals) in FULL_AND_PIECEWISE; uniform batches replay the one-graph step
(greedy and sampled variants) with the lookup inside it, no drafter trace or graph, no fallback for them; a
repetitive prompt is mostly accepted."""

import pytest
import torch

import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from tests.helpers import tiny_hf_model
from tests.test_engine import ragged

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def target():
    torch.backends.cuda.matmul.allow_tf32 = False
    return CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96), device="cuda", attn_impl="triton")


def engine(target, drafter, mode, k=3):
    cfg = dg.CompileConfig(
        mode=mode, num_speculative_tokens=k, max_num_seqs=8, max_num_batched_tokens=64, device="cuda",
        gpu_memory_utilization=0.0, capture_sizes=(1, 2, 4, 8, 16, 32, 64), full_capture_sizes=(1, 2, 4, 8),
        progress=False, check_addresses=True,
    )  # fmt: skip
    return dg.compile_model(target, drafter, cfg)


def test_ngram_is_lossless_and_runs_in_the_one_graph_step(target):
    prompts, params, arrivals = ragged(16)
    ref = [o.token_ids for o in engine(target, None, "NONE", k=0).generate(prompts, params, arrivals)]
    eng = engine(target, "ngram", "FULL_AND_PIECEWISE")
    assert [o.token_ids for o in eng.generate(prompts, params, arrivals)] == ref
    s, c = eng.stats(), eng.compiled.counters
    assert "drafter" not in c.traces and not any("drafter" in key for key in s["dispatch"])
    assert any(key.startswith("step/q4/") and key.endswith("/greedy") for key in c.graph_replays), dict(c.graph_replays)
    assert not any(key.startswith("step/") for key in s["fallbacks_by_key"]), s["fallbacks_by_key"]
    assert 0 < s["accepted_tokens"] < s["draft_tokens"]

    # A repetitive workload: each prompt holds the target's own continuation, then the prompt again.
    prompts, greedy = prompts[:8], dg.SamplingParams(max_tokens=32, ignore_eos=True)
    plain = engine(target, None, "NONE", k=0)
    cont = [o.token_ids for o in plain.generate(prompts, [greedy] * 8)]
    repeated = [p + c + p for p, c in zip(prompts, cont)]
    ref = [o.token_ids for o in plain.generate(repeated, [greedy] * 8)]
    eng.reset_stats()
    assert [o.token_ids for o in eng.generate(repeated, [greedy] * 8)] == ref
    s = eng.stats()
    assert s["accepted_tokens"] > 0.25 * s["draft_tokens"], s["acceptance_histogram"]

    # Sampled requests: the sampled one-graph step (one-hot q in the acceptance) replays, nothing falls back.
    sampled = [dg.SamplingParams(max_tokens=24, temperature=0.8, seed=i, ignore_eos=True) for i in range(8)]
    outs = eng.generate(repeated, sampled)
    assert all(len(o.token_ids) == 24 for o in outs)
    replays = eng.compiled.counters.graph_replays
    assert any(key.startswith("step/q4/") and key.endswith("/sample") for key in replays), dict(replays)
    assert not any(key.startswith("step/") for key in eng.stats()["fallbacks_by_key"])
