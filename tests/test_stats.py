"""engine.stats() says what ran: graph keys only for graphs that replayed (none on the CPU), and fallbacks
counted per dispatch key for every forward a graph mode ran without a graph. Compiled with the eager
backend (the split pieces run as plain FX): what is under test is the counting, not Inductor's code."""

from collections import Counter

import pytest

import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model
from tests.test_engine import ragged


@pytest.fixture(scope="module")
def pair():
    target = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96))
    return target, make_drafter("eagle", target)


def counting(fn, calls: Counter, name: str):
    def wrapped(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)

    return wrapped


def run(pair, mode, fuse="auto"):
    """Generate 6 staggered requests; returns the stats and the forwards counted at the callables themselves."""
    cfg = dg.CompileConfig(
        mode=mode, num_speculative_tokens=3, max_num_seqs=4, max_num_batched_tokens=64, compile_backend="eager",
        capture_sizes=(1, 4, 16), full_capture_sizes=(1, 2), progress=False, fuse_draft_loop=fuse,
    )  # fmt: skip
    eng = dg.compile_model(*pair, cfg)
    calls: Counter = Counter()
    f = eng.runner.forwards
    f.target_fn = counting(f.target_fn, calls, "target")
    f.drafter_fn = counting(f.drafter_fn, calls, "drafter")
    proposer = eng.runner.proposer
    if proposer.loops is not None:
        proposer.loops = tuple(counting(fn, calls, "loop") for fn in proposer.loops)
    prompts, params, arrivals = ragged(6)
    eng.generate(prompts, params, arrivals)
    return eng.stats(), calls


@pytest.mark.parametrize(
    "mode,fuse", [("PIECEWISE", "auto"), ("FULL_AND_PIECEWISE", "auto"), ("FULL_AND_PIECEWISE", True)]
)
def test_cpu_stats_show_no_graph_keys_and_count_every_fallback(pair, mode, fuse):
    stats, calls = run(pair, mode, fuse)
    assert not stats["cuda_graphs"]
    # Nothing ran on a graph: every forward is "none", none is reported under a graph key. A uniform batch's
    # whole step (FULL modes) is one dispatch holding a target call and the draft loop: one fused loop call, or
    # K = 3 drafter calls (fuse_draft_loop auto: the loop runs around the drafter step inside the step).
    steps = stats["dispatch"].get("step/none", 0)
    assert set(stats["dispatch"]) == {"target/none", "drafter/none"} | ({"step/none"} if steps else set())
    assert stats["dispatch"]["target/none"] + steps == calls["target"]
    per_step = 1 if fuse is True else 3
    assert stats["dispatch"]["drafter/none"] + per_step * steps == calls["drafter"] + calls["loop"]
    # ... and each is a fallback, under the key it was dispatched to.
    by_key = stats["fallbacks_by_key"]
    # (a step is one fallback for its target call and its loop: one fused call or K drafter calls)
    assert stats["fallbacks"] == sum(by_key.values()) == calls.total() - per_step * steps > 0
    assert sum(n for key, n in by_key.items() if key.startswith("target/")) == calls["target"] - steps
    loops = sum(n for key, n in by_key.items() if key.startswith("drafter/loop/"))
    if mode == "PIECEWISE":
        assert loops == steps == calls["loop"] == 0 and not any("/full/" in key for key in by_key)
        assert any(key.startswith("target/piecewise/t") for key in by_key)
    else:  # uniform verify batches of 1-2 requests were dispatched FULL: the whole step, verify to drafts
        assert sum(n for key, n in by_key.items() if key.startswith("step/q4/b")) == steps > 0
        assert loops == 0 and calls["loop"] == (steps if fuse is True else 0)


def test_mode_none_has_no_fallbacks(pair):
    stats, calls = run(pair, "NONE")
    assert stats["dispatch"] == {"target/none": calls["target"], "drafter/none": calls["drafter"]}
    assert stats["fallbacks"] == 0 and stats["fallbacks_by_key"] == {}
