"""Adaptive speculation (CompileConfig.speculation="adaptive", runtime/adaptive.py): each decode step picks K from
{0, ceil(K/2), K} by a cost model against running per-position acceptance.

- The controller alone: tests/test_adaptive_controller.py. Here its configuration errors and "auto".
- Engines (tiny Llama, CPU; FULL_AND_PIECEWISE runs the one-graph step's code without graphs, overlapped): greedy
  tokens equal transformers' with adaptive on for a draft model and EAGLE; K follows pinned acceptance
  (synthetic_acceptance 1 -> K_max, 0 -> K = 0); a forced K cycle 0 / ceil(K/2) / K with a draft model equal to the
  target accepts every real draft (its KV caught up on the positions K = 0 skipped; prefix-cache hits never hold
  stale entries of them), and the steady steps calibrate the step-time table;
  sampled requests keep the target's distribution under a forced K cycle (chi-square, tests/test_sampling.py's).
"""

import itertools
import time

import pytest
import torch

import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.drafters import truncated_draft_model
from draftgraph.runtime.warmup import measure_step_times
from tests.copy_drafters import make_drafter
from tests.helpers import hf_greedy, tiny_hf_model
from tests.test_sampling import assert_target_marginals

K = 3
VOCAB = 96


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", vocab_size=VOCAB)


@pytest.fixture(scope="module")
def target(hf):
    return CausalLM.from_hf(hf)


def config(mode="NONE", **kw):
    return dg.CompileConfig(mode=mode, num_speculative_tokens=K, max_num_seqs=8, max_num_batched_tokens=64,
                            compile_backend="eager", progress=False, speculation="adaptive", **kw)  # fmt: skip


def workload(n=8):
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(3, 20, (n,), generator=g)
    prompts = [torch.randint(0, VOCAB, (int(m),), generator=g).tolist() for m in lens]
    lengths = [12 + (7 * i) % 29 for i in range(n)]
    arrivals = [0] * (n // 2) + [10 + 6 * i for i in range(n - n // 2)]  # a batch, then late joiners
    params = [dg.SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in lengths]
    return prompts, params, arrivals


@pytest.fixture(scope="module")
def want(hf):
    prompts, params, _ = workload()
    return hf_greedy(hf, prompts, [p.max_tokens for p in params])


def test_config_errors():
    with pytest.raises(ValueError, match=r"unknown; choose one of \['auto', 'fixed', 'adaptive'\]"):
        dg.CompileConfig(speculation="dynamic")
    from draftgraph.compiler.config import resolve, resolve_speculation

    cfg = dg.CompileConfig(speculation="adaptive", tensor_parallel_size=2, max_num_seqs=4)
    with pytest.raises(ValueError, match="speculation='fixed' there"):
        resolve(cfg, 128, has_drafter=True)
    assert resolve(dg.CompileConfig(speculation="adaptive"), 128, has_drafter=True).speculation_ks == (0, 2, 3)
    assert resolve(dg.CompileConfig(speculation="adaptive"), 128, has_drafter=False).speculation_ks == ()
    # the default, "auto": adaptive only where start-up times the steps (CUDA graphs of the one-graph step) and no
    # other rank steps with this one; fixed here on the CPU, so the CPU suite's engines keep K fixed
    assert dg.CompileConfig().speculation == "auto"
    assert resolve(dg.CompileConfig(mode="FULL_AND_PIECEWISE"), 128, has_drafter=True).speculation_ks == ()
    assert resolve_speculation(dg.CompileConfig(), 4, measured=True) == (0, 2, 4)
    assert resolve_speculation(dg.CompileConfig(), 4, measured=False) == ()
    assert resolve_speculation(dg.CompileConfig(tensor_parallel_size=2), 4, measured=True) == ()


# ---- engines ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["NONE", "FULL_AND_PIECEWISE"])
@pytest.mark.parametrize("kind", ["draft_model", "eagle", "ngram"])
def test_greedy_tokens_equal_transformers(target, want, mode, kind):
    drafter = truncated_draft_model(target, 1) if kind == "draft_model" else make_drafter(kind, target)
    eng = dg.compile_model(target, drafter, config(mode))
    got = [o.token_ids for o in eng.generate(*workload())]
    assert got == want
    s = eng.stats()
    spec = s["speculation"]
    assert spec["mode"] == "adaptive" and sum(spec["histogram"].values()) == s["steps"]
    # a drafter reading the target's hidden states never skips a step (it could not catch up): no K = 0; the n-gram
    # drafter keeps no KV, a draft model catches up
    assert spec["choices"] == ([2, 3] if kind == "eagle" else [0, 2, 3])
    if mode == "FULL_AND_PIECEWISE":
        assert s["overlapped_steps"] > 0 and s["fallbacks"] > 0  # the one-graph step's code, overlapped (no graphs)


@pytest.mark.parametrize("rates,most", [((1.0, 1.0, 1.0), 3), ((0.0, 0.0, 0.0), 0)])
def test_chosen_k_follows_acceptance(target, rates, most):
    eng = dg.compile_model(target, truncated_draft_model(target, 1), config(synthetic_acceptance=rates))
    prompts, params, arrivals = workload()
    if most:  # requests long enough that K = 3 finishes them clearly sooner than K = 2 (not within the margin)
        params = [dg.SamplingParams(max_tokens=p.max_tokens + 48, temperature=0.0, ignore_eos=True) for p in params]
    eng.generate(prompts, params, arrivals)
    spec = eng.stats()["speculation"]
    hist = spec["histogram"]
    assert max(hist, key=hist.get) == most, hist
    if most == 0:  # acceptance ~0: down through K = 2 to K = 0, where late joiners' prompt steps run too (no drafter)
        # (rate 0 down from 0.7: the batch's short requests finish sooner at K = 0 by the finish time once it falls)
        assert hist[2] >= 2 and hist[3] < 8 and spec["acceptance_rates"][0] < 0.6
        assert spec["probes"] <= 1  # the first comes 32 steps at K = 0 later
    else:
        assert hist[0] == 0 and spec["acceptance_rates"][0] > 0.9


@pytest.mark.parametrize("mode", ["NONE", "FULL_AND_PIECEWISE"])
def test_last_step_runs_the_k_that_finishes_cheapest(target, mode, monkeypatch):
    """Every draft accepted (pinned), step times as if measured (K = 3 15 % dearer than K = 2), requests of 24 tokens
    (the prefill's 1, five steps of 4, then 3): K = 3 throughout. Unoverlapped (NONE), each closed batch's last step
    runs K = 2: its requests have 3 tokens left, which K = 2 emits in one step as K = 3 would (tokens/s alone ran
    K = 3 there); 8 requests with 4 more waiting: the first 8's last step runs K = 3 (requests wait: tokens/s
    decides), the last 4's K = 2. Overlapped (FULL_AND_PIECEWISE), the last step's K is chosen while the one before
    it runs (7 tokens left as read, the unread step's 4 taken off: one step at either K), and K = 2 would give up
    the relaunch (a step's time, more than the 0.15 it saves): K = 3."""
    eng = dg.compile_model(target, truncated_draft_model(target, 1), config(mode, synthetic_acceptance=(1.0,) * K))
    times = {(k, b): t for k, t in ((0, 0.5), (2, 1.0), (3, 1.15)) for b in eng.step_times.sizes}
    eng.step_times.measured.update(times)
    eng.step_times.calibrate = lambda *a, **kw: None  # (the CPU's wall times would move the entries)
    ctl = eng.adaptive
    ctl.rates = [1.0] * K
    calls, choose = [], ctl.choose

    def spy(batch, ctx=0.0, left=None, ahead=None):
        batch_left = left() if callable(left) else left  # (the engine passes a function giving a BatchLeft)
        calls.append((ahead, None if batch_left is None else [int(r) for r in batch_left.tokens]))
        return choose(batch, ctx, batch_left, ahead)

    monkeypatch.setattr(ctl, "choose", spy)
    prompts = [list(range(3 + i, 11 + i)) for i in range(12)]  # (8 requests x 8 tokens: one prefill step)
    params = dg.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    last = 2 if mode == "NONE" else 3
    for n, want in ((4, {0: 0, 2: 0, 3: 6}), (12, {0: 0, 2: 0, 3: 13})):
        want[last] += 1
        outs = eng.generate(prompts[:n], params)
        s = eng.stats()
        assert all(len(o.token_ids) == 24 for o in outs) and s["speculation"]["histogram"] == want, s["speculation"]
    if mode == "NONE":
        assert (None, [3] * 4) in calls and (None, [3] * 8) not in calls  # (the first 8's last step: requests waited)
    else:
        assert (3, [7] * 4) in calls
        # the steps not relaunched (the last of each batch, at a request's end) measured the device's idle time
        assert ctl._gaps and all(0 < g < 1 for w in ctl._gaps.values() for g in w)
        mean, sd = ctl.steps_left(2, [(7, [])] * 4, ahead=3)
        assert mean.tolist() == [1.0] * 4 and sd.tolist() == [0.0] * 4


def forced(monkeypatch, eng, cycle):
    """The engine's controller answers `cycle` in turn (the choice is the controller's alone; this drives every
    transition), and its observations are recorded."""
    seen, ks = [], itertools.cycle(cycle)
    observe, ctl = eng.adaptive.observe, eng.adaptive

    def choose(batch, ctx=0.0, left=None, ahead=None):
        ctl.current = next(ks)  # as the controller's own choice: prompt chunks then run at K = 0 or the largest K
        return ctl.current

    monkeypatch.setattr(eng.adaptive, "choose", choose)
    monkeypatch.setattr(
        eng.adaptive, "observe", lambda k, acc, **rows: (seen.append((k, list(acc))), observe(k, acc, **rows))
    )
    return seen


def test_forced_k_cycle_catches_the_draft_model_up(hf, target, want, monkeypatch):
    """A draft model equal to the target accepts every draft it proposed after a step at its K, also after K = 0
    steps skipped it (decodes, and late joiners' prompts): the positions they skipped were fed to it before its next
    step."""
    eng = dg.compile_model(target, truncated_draft_model(target, target.cfg.num_layers), config("FULL_AND_PIECEWISE"))
    seen = forced(monkeypatch, eng, [0] * 12 + [3, 3, 2, 2])  # K = 0 runs longer than the drafts reach
    # As if measured at warm-up (CUDA graphs): steady overlapped steps move each time toward the observed one
    sizes = eng.config.full_capture_sizes
    eng.step_times.measured.update({(k, b): 1.0 for k in (0, 2, 3) for b in sizes})
    got = [o.token_ids for o in eng.generate(*workload())]
    assert got == want
    offsets = eng.step_times.offset  # padded size -> observed less modelled (1 s modelled against the CPU's steps)
    assert offsets and all(-1.0 < x < -0.1 for x in offsets.values()), offsets
    real = [(k, a) for k, acc in seen if k for a in acc]
    assert len(real) > 20 and all(a == k for k, a in real)  # every real draft accepted (padded ones not observed)
    s = eng.stats()["speculation"]
    assert all(s["histogram"][k] > 2 for k in (0, 2, 3)) and s["catch_up_tokens"] > 0
    # Prompts that extend the first call's: their cached blocks hold the draft model's KV too, never stale entries of
    # positions it skipped (blocks past a request's `draft_lag` are not registered)
    prompts = [p + o for p, o in zip(workload()[0], got)]
    params = [dg.SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)] * len(prompts)
    seen.clear()
    again = [o.token_ids for o in eng.generate(prompts, params)]
    assert eng.stats()["prefix_cache"]["hit_tokens"] > 0
    assert again == hf_greedy(hf, prompts, 10)
    real = [(k, a) for k, acc in seen if k for a in acc]
    assert real and all(a == k for k, a in real)


def test_prefixes_stay_cached_at_k0_and_the_draft_model_catches_up_on_them(hf, target, monkeypatch):
    """Start-up's step times first (runtime/warmup.py; on CUDA the captured graphs, here their code): every (K, FULL
    size) at cached length 0 and at a longer one, every row a request on blocks of its own, leaving nothing behind in
    the caches and block tables. Then requests run at K = 0 throughout (their prompts too: the draft model skipped)
    still register their blocks, as missing the draft model's entries; a later call with the same prompts finds them
    (as plain decoding would), and at K = 3 its draft model, equal to the target, catches up on them first: every
    real draft accepted; the tokens equal transformers' throughout."""
    eng = dg.compile_model(target, truncated_draft_model(target, target.cfg.num_layers), config("FULL_AND_PIECEWISE"))
    line = measure_step_times(eng, runs=1, max_context=24, timer=wall_time, captured_only=False)
    want_keys = {(k, b) for k in (0, 2, 3) for b in eng.config.full_capture_sizes}
    assert set(eng.step_times.measured) == want_keys == set(eng.step_times.per_token), eng.step_times.measured
    assert "adaptive speculation: step times of" in line
    prompts = [list(range(1 + i, 40 + i)) for i in range(4)]  # 39 tokens: 2 full blocks of 16 each
    params = [dg.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * len(prompts)
    want = hf_greedy(hf, prompts, 12)
    eng.adaptive.current = 0  # prompts at K = 0 from the first step on
    forced(monkeypatch, eng, [0])
    assert [o.token_ids for o in eng.generate(prompts, params)] == want
    assert eng.stats()["speculation"]["catch_up_tokens"] == 0
    seen = forced(monkeypatch, eng, [3])
    assert [o.token_ids for o in eng.generate(prompts, params)] == want
    s = eng.stats()
    assert s["prefix_cache"]["hit_tokens"] == 4 * 32  # each prompt's 2 blocks
    assert s["speculation"]["catch_up_tokens"] >= 4 * 32
    real = [(k, a) for k, acc in seen if k for a in acc]
    assert len(real) > 8 and all(a == k for k, a in real)


def wall_time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def test_sampled_requests_stay_lossless(monkeypatch):
    """Tokens 2 and 3 of 8000 seeded requests (K = 2: choices 0, 1, 2 forced in turn, so verify steps truncate,
    pad with one-hot q after K = 0, and skip the drafter) match the exact marginals; a marginal shifted by 2 % is
    rejected (tests/test_sampling.py's check)."""
    vocab = 16
    hf = tiny_hf_model("llama", vocab_size=vocab)
    target = CausalLM.from_hf(hf)
    prompt, n = [3, 1, 4, 1, 5], 8000
    cfg = dg.CompileConfig(num_speculative_tokens=2, max_num_seqs=256, max_num_batched_tokens=2048,
                           speculation="adaptive")  # fmt: skip
    eng = dg.compile_model(target, truncated_draft_model(target, 1), cfg)
    forced(monkeypatch, eng, [0, 1, 2, 2, 1])
    params = [dg.SamplingParams(max_tokens=3, temperature=1.0, seed=i, ignore_eos=True) for i in range(n)]
    samples = torch.tensor([o.token_ids for o in eng.generate([prompt] * n, params)])  # [n, 3]
    hist = eng.stats()["speculation"]["histogram"]
    assert all(hist[k] > 0 for k in (0, 1, 2)), hist
    assert_target_marginals(hf, prompt, vocab, samples)
