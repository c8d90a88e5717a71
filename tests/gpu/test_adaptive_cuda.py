"""GPU tier: adaptive speculation (speculation="adaptive") with CUDA graphs. Start-up measures a step time for every
(K, FULL size); with the controller's choice forced through 0 / 2 / 3 (K = 3) and a draft model equal to the target,
greedy tokens equal the target alone on the ragged suite (FULL_AND_PIECEWISE, staggered arrivals), the one-graph step
of every K replays (q1, q3, q4) with no step fallback and input addresses checked at each replay, the draft model is
caught up after K = 0 steps and accepts its real drafts; steady steps calibrate the step-time table."""

import pytest
import torch

import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.drafters import truncated_draft_model
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model
from tests.test_adaptive import forced
from tests.test_engine import ragged

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def target():
    torch.backends.cuda.matmul.allow_tf32 = False
    return CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96), device="cuda", attn_impl="triton")


def engine(target, drafter, mode, k=3, speculation="fixed", **kw):
    cfg = dg.CompileConfig(
        mode=mode, num_speculative_tokens=k, max_num_seqs=8, max_num_batched_tokens=64, device="cuda",
        gpu_memory_utilization=0.0, capture_sizes=(1, 2, 4, 8, 16, 32, 64), full_capture_sizes=(1, 2, 4, 8),
        progress=False, check_addresses=True, speculation=speculation, **kw,
    )  # fmt: skip
    return dg.compile_model(target, drafter, cfg)


def test_adaptive_is_lossless_and_replays_every_k(target, monkeypatch):
    prompts, params, arrivals = ragged(16)
    ref = [o.token_ids for o in engine(target, None, "NONE", k=0).generate(prompts, params, arrivals)]
    eng = engine(target, truncated_draft_model(target, target.cfg.num_layers), "FULL_AND_PIECEWISE",
                 speculation="adaptive")  # fmt: skip
    assert set(eng.step_times.measured) == {(k, b) for k in (0, 2, 3) for b in (1, 2, 4, 8)}
    assert all(t > 0 for t in eng.step_times.measured.values())
    assert set(eng.step_times.per_token) == set(eng.step_times.measured)  # (timed again at a longer cached length)
    seen = forced(monkeypatch, eng, [0] * 12 + [3, 3, 2, 2])
    assert [o.token_ids for o in eng.generate(prompts, params, arrivals)] == ref
    s, replays = eng.stats(), eng.compiled.counters.graph_replays
    for q in (1, 3, 4):  # the one-graph step of K = 0, 2 and 3
        assert any(key.startswith(f"step/q{q}/") and key.endswith("/greedy") for key in replays), dict(replays)
    assert not any(key.startswith("step/") for key in s["fallbacks_by_key"]), s["fallbacks_by_key"]
    assert s["speculation"]["catch_up_tokens"] > 0
    real = [(k, a) for k, acc in seen if k for a in acc]
    assert real and sum(a == k for k, a in real) >= 0.95 * len(real)  # float32: a near-tie may flip a draft
    assert eng.step_times.offset  # steady overlapped steps calibrated their padded sizes' times


@pytest.mark.parametrize("kind", ["eagle", "ngram", "draft_model"])
def test_real_row_step_times_then_tokens_equal(target, kind):
    """Start-up times every (K, FULL size) on real rows (each on blocks of its own, zeroed, tables restored); the
    engine then generates the target's greedy tokens. With every draft rejected a draft model's engine stays at
    K = 0 for most steps (after its first ones), with at most one probe."""
    prompts, params, arrivals = ragged(16)
    ref = [o.token_ids for o in engine(target, None, "NONE", k=0).generate(prompts, params, arrivals)]
    drafter = truncated_draft_model(target, 1) if kind == "draft_model" else make_drafter(kind, target)
    eng = engine(target, drafter, "FULL_AND_PIECEWISE", speculation="adaptive")
    ks = (2, 3) if kind == "eagle" else (0, 2, 3)
    assert set(eng.step_times.measured) == {(k, b) for k in ks for b in (1, 2, 4, 8)}
    assert "adaptive speculation: step times of" in eng.warm_up_report
    assert [o.token_ids for o in eng.generate(prompts, params, arrivals)] == ref
    if kind == "draft_model":
        zero = engine(target, drafter, "FULL_AND_PIECEWISE", speculation="adaptive", synthetic_acceptance=(0.0,) * 3)
        zero.generate(prompts, params, arrivals)
        spec = zero.stats()["speculation"]
        assert spec["probes"] <= 1 and spec["histogram"][0] > 0.5 * sum(spec["histogram"].values()), spec
