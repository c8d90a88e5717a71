"""Adaptive speculation's controller alone (runtime/adaptive.py AdaptiveK, runtime/step_times.py StepTimes), no
engine: the expected-tokens formula, K_max under high acceptance, K = 0 once acceptance falls to ~0 with two-step
probes at a doubling, cost-bounded interval; the per-request counts by slot against their definition; the rates'
weight by the requests observed; the switch margin and unknown times; the step-time table's calibration; the
finish-time choice (the slowest requests, the tokens left, a switch up's padded first step, held away from a batch's
end). The engines with adaptive speculation on are tests/test_adaptive.py's."""

import itertools
import random

import pytest

from draftgraph.runtime.adaptive import AdaptiveK
from draftgraph.runtime.step_times import StepTimes


def test_controller_follows_acceptance_and_probes_back():
    ctl = AdaptiveK((0, 2, 4), lambda k, b, c: 1.0 + 0.25 * k, probe=4, max_probe=16, probe_budget=1.0)
    ctl.rates = [0.5, 0.5, 0.5, 0.5]
    assert ctl.expected_tokens(0) == 1.0 and ctl.expected_tokens(2) == 1.75 and ctl.expected_tokens(4) == 1.9375
    for _ in range(50):  # every draft accepted: 5 tokens in 2 time units beats 1 in 1
        k = ctl.choose(8)
        ctl.observe(k, [k] * 8)
    assert ctl.current == 4 and min(ctl.rates) > 0.99
    chosen = []
    for _ in range(200):  # nothing accepted: down to K = 0, two-step probes at K = 2 every 4, 8, 16, 16 steps
        k = ctl.choose(8)
        chosen.append(k)
        ctl.observe(k, [0] * 8)
    assert ctl.current == 0 and ctl.rates[0] < 0.05  # (later positions are never reached: unobserved)
    zero_from = chosen.index(0)
    assert set(chosen[:zero_from]) <= {4, 2}
    runs = [len(list(g)) for z, g in itertools.groupby(chosen[zero_from:]) if z == 0]
    probes = [(z, len(list(g))) for z, g in itertools.groupby(chosen[zero_from:]) if z != 0]
    assert probes and all(p == (2, 2) for p in probes)  # each probe: two steps at the smallest K > 0
    assert runs[1:4] == [8, 16, 16]  # the interval doubles up to max_probe
    assert ctl.stats()["histogram"][0] == chosen.count(0)
    # by default probes cost at most 1 % of the time at K = 0: two steps at K = 2 (2 x 0.5 more), a step for the
    # switches (1) and, before any catch-up was timed, one step at K = 2 for it (1.5): 3.5 / 0.01 = 350 steps apart
    fresh = AdaptiveK((0, 2, 4), lambda k, b, c: 1.0 + 0.25 * k)
    assert fresh._probe_interval(8, 10.0) == 350
    fresh.note_catch_up(100, 0.5)  # (below catch_up_min_tokens: its launches' time, not a rate; nothing moves)
    assert fresh.catch_up_per_token is None and fresh._probe_interval(8, 10.0) == 350
    fresh.note_catch_up(300, 1.5)  # 5 ms a token: 8 requests x 10 cached tokens, 0.4 s -> (1 + 1 + 0.4) / 0.01
    assert fresh._probe_interval(8, 10.0) == 240


def test_probes_stay_within_budget_when_nothing_is_accepted():
    """With nothing accepted, probes (their steps at K = 2, the switches, and a draft model's catch-up on every
    cached token of the batch, here 20 steps' time) cost at most 1 % over K = 0 alone, also as the context grows;
    the interval keeps doubling (no cap below the budget's)."""
    ctl = AdaptiveK((0, 2, 4), lambda k, b, c: 1.0 + 0.25 * k + 0.001 * c)
    batch, per_token, extra, zero_time, probes, steps = 8, 0.005, 0.0, 0.0, 0, 40_000
    for s in range(steps):
        ctx = 100 + s % 400  # requests of 500 tokens in turn
        k = ctl.choose(batch, ctx)
        t0, tk = ctl.step_time(0, batch, ctx), ctl.step_time(k, batch, ctx)
        if k and ctl.current == 0 and ctl._probe_left:  # a probe's first step: the draft model catches up first
            probes += 1
            extra += per_token * batch * ctx + t0  # and a step's time for the switches (not overlapped)
            ctl.note_catch_up(batch * ctx, per_token * batch * ctx)
        if ctl.current == 0:
            extra += tk - t0  # a probe's steps at K = 2
            zero_time += t0
        ctl.observe(k, [0] * batch)
    assert ctl.histogram[0] > 0.99 * steps
    assert 0 < probes <= 10 and ctl.stats()["probes"] == probes  # 32, 64, ... steps apart, at least the budget's
    assert extra <= 0.01 * zero_time, (extra, zero_time)


def test_counts_by_slot_equal_the_lists():
    """The engine's path (runtime/engine.py): each request's counts kept by the controller in a row per slot
    (`observe(..., slots, ids)`, `BatchLeft`), updated in one array operation, equal the per-request lists, bit for bit,
    and so do the finish times and choices made from them, over random steps at every K while requests come and go
    (a slot taken by a new request starts from no counts, as a new request's empty list does)."""
    import numpy as np

    from draftgraph.runtime.adaptive import BatchLeft

    rng = random.Random(3)
    times = {0: 1.4e-3, 2: 2.2e-3, 3: 2.5e-3, 5: 3.1e-3}
    by_list, by_slot = (AdaptiveK((0, 2, 3, 5), lambda k, b, c: times[k], sizes=(1, 8, 16)) for _ in range(2))
    owner = list(range(16))  # slot -> request id; lists by request id
    lists = {i: [] for i in owner}
    next_id = 16
    for _ in range(200):
        for slot in rng.sample(range(16), rng.randint(0, 3)):  # requests that finished: new ones take their slots
            owner[slot], next_id = next_id, next_id + 1
            lists[owner[slot]] = []
        k = rng.choice((2, 3, 5))
        rows = sorted(rng.sample(range(16), rng.randint(1, 16)))
        accepted = [rng.randint(0, k) for _ in rows]
        by_list.observe(k, accepted, [lists[owner[r]] for r in rows])
        ids = np.array([owner[r] for r in rows], dtype=np.int64)
        by_slot.observe(k, accepted, slots=np.array(rows, dtype=np.int64), ids=ids)
        assert by_list.rates == by_slot.rates
        tokens = [rng.randint(1, 300) for _ in rows]
        left = [(t, lists[owner[r]]) for t, r in zip(tokens, rows)]
        batch = BatchLeft(np.array(tokens, dtype=np.float64), np.array(rows, dtype=np.int64), ids)
        for kk in (2, 3, 5):
            assert by_list.finish_time(kk, left, 100.0, 3) == by_slot.finish_time(kk, batch, 100.0, 3)
        assert by_list.choose(len(rows), 100.0, left, k) == by_slot.choose(len(rows), 100.0, batch, k)


def test_a_step_at_k0_builds_no_batch_left():
    """The engine passes the batch's tokens left as a function (runtime/engine.py `_left`): it is called only where
    tokens/s chose a K > 0 (the finish-time choice among the K > 0), so a step at K = 0 builds nothing."""

    def never():
        raise AssertionError("built for a step at K = 0")

    times = {0: 1.0e-3, 2: 1.5e-3, 4: 2.0e-3}
    ctl = AdaptiveK((0, 2, 4), lambda k, b, c: times[k], sizes=(8,))
    ctl.rates = [0.1] * 4  # nothing pays: K = 0 by tokens/s
    assert ctl.choose(8, 0.0, never) == 0
    ctl.rates = [0.95] * 4
    built = []
    assert ctl.choose(8, 0.0, lambda: built.append(1) or [(200, [])] * 8) in (2, 4) and built == [1]


def test_the_finish_time_choice_is_held_away_from_the_batchs_end():
    """AdaptiveK._finish_choice: the finish-time choice (most of the controller's host time a step) is computed
    again every `recheck` steps of the same batch, at once for another batch size or step ahead, and at every step
    once a request is within 4 steps at K_max of its end; a choice made there is not held into the next batch."""
    times = {0: 1.0e-3, 2: 1.5e-3, 4: 2.0e-3}
    ctl = AdaptiveK((0, 2, 4), lambda k, b, c: times[k], sizes=(8, 16), recheck=4)
    ctl.rates = [0.9] * 4
    computed, best = [], ctl._best_to_finish
    ctl._best_to_finish = lambda *a, **kw: computed.append(1) or best(*a, **kw)
    far = [(200, [])] * 8
    ks = [ctl.choose(8, 0.0, far, 4) for _ in range(9)]
    assert len(computed) == 3 and len(set(ks)) == 1  # steps 1, 5, 9
    ctl.choose(16, 0.0, [(200, [])] * 16, 4)  # another batch: at once
    ctl.choose(16, 0.0, [(200, [])] * 16, 2)  # another step ahead: at once
    assert len(computed) == 5
    near = [(200, [])] * 7 + [(20, [])]  # one request 20 tokens from its end (4 steps at K = 4)
    for _ in range(3):
        ctl.choose(8, 0.0, near, 4)
    assert len(computed) == 8
    ctl.choose(8, 0.0, far, 4)  # (the last choice was at a batch's end: not held)
    assert len(computed) == 9


def test_observe_counts_by_their_definition():
    """`observe` written for the host's time (one comprehension a request, rates from a count of requests by drafts
    accepted) equals its definition, bit for bit, over random steps at every K: a request's counts fade by the decay,
    then gain 1 at each position it reached (0..a, below K) and at each it accepted (0..a - 1); position i's rate
    moves toward (requests accepting more than i) / (requests accepting at least i), by `ema` x min(1, those
    requests / full_weight_at), stopping at the first position none reached; the positions past K drift toward
    position K - 1's rate."""
    import random

    rng = random.Random(7)
    fast = AdaptiveK((0, 2, 3, 5), lambda *a: 1.0)
    n, d = 5, fast.request_decay
    rates, counts_ref = list(fast.rates), [[] for _ in range(40)]
    counts = [[] for _ in range(40)]
    for step in range(300):
        k = rng.choice((2, 3, 5))
        rows = rng.sample(range(40), rng.randint(1, 40))
        accepted = [rng.choice([0, 0, 1, k, k, rng.randint(0, k)]) for _ in rows]
        if step % 50 == 0:
            accepted = [0] * len(rows)  # no position past 0 reached
        fast.observe(k, accepted, [counts[r] for r in rows])
        for a, r in zip(accepted, rows):  # the definition
            c = counts_ref[r]
            c[:] = [x * d for x in c] if c else [0.0] * (2 * n)
            for i in range(min(a + 1, k)):
                c[n + i] += 1.0
            for i in range(min(a, k)):
                c[i] += 1.0
        for i in range(k):
            reached = sum(1 for a in accepted if a >= i)
            if not reached:
                break
            weight = fast.ema * min(1.0, reached / fast.full_weight_at)
            rates[i] += weight * (sum(1 for a in accepted if a > i) / reached - rates[i])
        for i in range(k, n):
            rates[i] += fast.ema * (rates[k - 1] - rates[i])
        assert fast.rates == rates and counts == counts_ref, step


def test_a_step_of_few_requests_moves_the_rates_less():
    """A step whose position was reached by fewer than `full_weight_at` requests moves that position's rate in
    proportion: the last request of a batch rejecting its drafts step after step does not take K to 0 as a whole
    batch rejecting them would; with full_weight_at=1 every step has the whole weight (the rule before it)."""
    times = {0: 1.0e-3, 2: 1.5e-3, 4: 2.0e-3}
    few, one = (AdaptiveK((0, 2, 4), lambda k, b, c: times[k], full_weight_at=f) for f in (4, 1))
    for ctl in (few, one):
        ctl.rates = [0.85] * 4
        ctl.observe(4, [0])  # one request, its first draft rejected
    assert few.rates[0] == 0.85 + 0.025 * (0.0 - 0.85) and one.rates[0] == 0.85 + 0.1 * (0.0 - 0.85)
    for _ in range(12):  # a batch's last request in a stretch of rejections
        for ctl in (few, one):
            k = ctl.choose(1)
            if k:
                ctl.observe(k, [0])
    assert one.current == 0 and few.current > 0 and few.rates[0] > 0.6
    full = AdaptiveK((0, 2, 4), lambda *a: 1.0)
    full.rates = [0.85] * 4
    full.observe(4, [0] * 8)  # eight requests: the whole weight
    assert full.rates[0] == 0.85 + 0.1 * (0.0 - 0.85)


def test_controller_margin_and_unknown_times():
    times = {0: 1.0, 2: 1.5, 4: 2.0}
    ctl = AdaptiveK((0, 2, 4), lambda k, b, c: times[k] if b <= 8 else None, margin=0.05)
    ctl.rates = [0.25, 0.0, 0.0, 0.0]  # K=2: 1.25 tokens / 1.5 < K=0's 1 / 1; K=4 below both
    assert ctl.choose(8) == 0
    ctl.rates = [0.52, 0.0, 0.0, 0.0]  # K=2: 1.013 tokens/unit: not 5 % better than K=0's 1.0
    assert ctl.choose(8) == 0
    ctl.rates = [0.6, 0.0, 0.0, 0.0]  # 1.067: better by more than the margin
    assert ctl.choose(8) == 2
    assert ctl.choose(64) == 4  # no measured time for this batch: the largest K, as "fixed"


def test_calibration_moves_every_k_of_the_batch_size():
    """Start-up's step times at batch 128 (an H200, the 1B pair: K = 0 1.39 ms + 1.26 us a cached token, K = 2 3.22
    + 2.92, K = 4 4.92 + 4.85). Steady K = 2 steps that take 4.2 ms (the host's share at 128 requests) move the
    offset of their padded size, which every K's time at that size carries (K = 0's too, though none ran: an entry
    of its own per K stayed where a stall had put it while its K did not run); another size keeps its entries. A
    stall (one step 40x the rest) moves nothing (the median of the window)."""
    st = StepTimes((64, 128), None, None)
    for k, t, per in ((0, 1.39e-3, 1.26e-6), (2, 3.22e-3, 2.92e-6), (4, 4.92e-3, 4.85e-6)):
        st.measured[(k, 128)], st.per_token[(k, 128)] = t, per
        st.measured[(k, 64)], st.per_token[(k, 64)] = t / 2, per
    ctl = AdaptiveK((0, 2, 4), st)
    ctl.rates = [0.85, 0.76, 0.7, 0.7]
    assert ctl.choose(100, 128.0) == 2  # (bucket 128)
    for _ in range(10):
        st.calibrate(2, 100, 4.2e-3, 128.0)
    extra = 4.2e-3 - (3.22e-3 + 128 * 2.92e-6)
    assert st.offset == {128: pytest.approx(extra)}
    assert st(0, 128, 128.0) == pytest.approx(1.39e-3 + 128 * 1.26e-6 + extra)
    assert st(2, 100, 128.0) == pytest.approx(4.2e-3)
    assert st(0, 64, 128.0) == pytest.approx(1.39e-3 / 2 + 128 * 1.26e-6)  # another size: as measured
    assert ctl.choose(100, 128.0) == 2  # 2.50 tokens in 4.2 ms against 1 in 1.99: K = 2 still
    st.calibrate(0, 100, 40 * 4.2e-3, 128.0)  # a stall
    assert st.offset[128] == pytest.approx(extra)
    for _ in range(20):  # steps 0.8 ms faster than their entries: the offset follows (a time stays above 1/4)
        st.calibrate(0, 100, 1.39e-3 + 128 * 1.26e-6 - 0.8e-3, 128.0)
    assert st.offset[128] == pytest.approx(-0.8e-3)
    assert st(0, 128, 128.0) > 0.25 * 1.39e-3


def test_finish_time_follows_the_slowest_requests_and_the_tokens_left():
    """No request waits: K minimises the time to finish the batch. The H100's step times at batch 8 (the 1B pair: K =
    0 1.408 ms, K = 2 2.193, K = 4 2.886) and the batch's rates there favour K = 4 by tokens/s (3.70 tokens a step
    against 2.53); but when half of the 8 requests accept at 0.5 (their own counts over 60 steps, here against a prior
    of 8 observations at the batch's rates), they finish last, and K = 2 finishes them sooner. While requests wait,
    tokens/s decides (K = 4). A request with 3 tokens left emits them in one step at K = 2 as at K = 4: K = 2, the
    cheaper step."""
    times = {0: 1.408e-3, 2: 2.193e-3, 4: 2.886e-3}
    ctl = AdaptiveK((0, 2, 4), lambda k, b, c: times[k], sizes=(1, 8), prior=8.0)
    batch_rates = [0.822, 0.857, 0.867, 0.925]
    ctl.rates = list(batch_rates)
    assert ctl.expected_tokens(4) == pytest.approx(3.70, abs=0.01) and ctl.choose(8) == 4
    rng = random.Random(0)
    counts = [[] for _ in range(8)]
    for _ in range(60):  # requests 0-3 accept each draft with 0.95, 4-7 with 0.5
        accepted = [next((i for i in range(4) if rng.random() > (0.95 if r < 4 else 0.5)), 4) for r in range(8)]
        ctl.observe(4, accepted, counts)
        ctl.rates = list(batch_rates)  # (the batch's rates as in the H100 run; only the requests' own counts move)
    assert all(len(c) == 8 for c in counts) and counts[0][0] > counts[7][0]  # (accepted, reached) per position
    left = [(200, c) for c in counts]
    assert ctl.finish_time(2, left) < ctl.finish_time(4, left) / 1.03
    assert ctl.choose(8, 0.0, left) == 2 and ctl.current == 2
    assert ctl.choose(8, 0.0, None) == 4  # requests wait: tokens/s
    fast = [(200, c) for c in counts[:4]]  # the four fast ones alone: K = 4
    assert ctl.choose(4, 0.0, fast) == 4
    assert ctl.choose(1, 0.0, [(3, counts[0])]) == 2  # 3 tokens left
    assert ctl.stats()["histogram"] == {0: 0, 2: 2, 4: 3}
    # with padded sizes (1, 8): once one request is left, the steps take K's time at 1 (here half of it)
    half = AdaptiveK((0, 2, 4), lambda k, b, c: times[k] / (2 if b == 1 else 1), sizes=(1, 8))
    half.rates = list(batch_rates)
    one_slow = [(100, c) for c in counts[:7]] + [(300, counts[7])]  # the slow one runs 2/3 of its steps alone
    mean, sd = half.steps_left(4, one_slow)
    (m1, s1), (m2, s2) = sorted(zip(mean.tolist(), sd.tolist()), reverse=True)[:2]
    n1, n2 = m1 + half._order_z(1, 8) * s1, m2 + half._order_z(2, 8) * s2  # the last and second last to finish
    assert half.finish_time(4, one_slow) == pytest.approx(times[4] / 2 * n1 + times[4] / 2 * n2) and n1 > 2 * n2
    assert half._order_z(1, 8) == pytest.approx(1.42, abs=0.02)  # (the expected largest of 8 standard normals)


def test_a_switch_up_counts_its_padded_first_step():
    """A step at a K above the last step's verifies that step's drafts padded (runtime/step.py fit_drafts): it emits
    the smaller K's tokens at the larger K's time. The finish-time choice counts that step: near the batch's end
    (no step `ahead`, 1 % margin) K = 4 finishes 8 requests of 7 tokens left in fewer steps than K = 2, but not
    after the padded step; from K = 4 (its drafts there) it stays, and far from the end the gain outweighs it."""
    times = {0: 1.408e-3, 2: 2.193e-3, 4: 2.886e-3}
    ctl = AdaptiveK((0, 2, 4), lambda k, b, c: times[k], sizes=(1, 8))
    ctl.rates = [0.95] * 4
    near = [(7, []) for _ in range(8)]
    assert ctl.finish_time(4, near) < ctl.finish_time(2, near) / 1.01  # without the padded step: K = 4
    ctl.current = 2
    assert ctl.choose(8, 0.0, near) == 2
    e2, e4 = ctl.expected_tokens(2), ctl.expected_tokens(4)
    padded = ctl.finish_time(4, near) + times[4] * (e4 - e2) / e4
    assert padded > ctl.finish_time(2, near) / 1.01  # (what the choice compared)
    ctl.current = 4
    assert ctl.choose(8, 0.0, near) == 4  # K = 4's own drafts: no padded step
    ctl.current = 2
    assert ctl.choose(8, 0.0, [(400, []) for _ in range(8)]) == 4  # far from the end: worth one padded step
    # where the step would be relaunched (`ahead`), a switch also gives up `switch_steps` of the current K's steps
    far = [(400, []) for _ in range(8)]
    saving = ctl.finish_time(2, far, 0.0, 2) - ctl.finish_time(4, far, 0.0, 2) - times[4] * (e4 - e2) / e4
    ctl.current, ctl.switch_steps = 2, 0.9 * saving / times[2]
    assert ctl.choose(8, 0.0, far, 2) == 4
    ctl.current, ctl.switch_steps, ctl._held = 2, 1.1 * saving / times[2], None
    assert ctl.choose(8, 0.0, far, 2) == 2


def test_the_finish_time_counts_the_steps_not_overlapped():
    """An H200's step times at batch 128 (the 1B pair, 2026-11-28) and the batch's rates there: K = 2 is 6 % better
    than K = 0 per step (2.45 tokens in 3.85 ms against 1 in 1.67) and, counting the slowest requests alone, finishes
    128 requests of 250 tokens 1.4 % sooner. But its requests end over about 19 steps, none of them overlapped, while
    K = 0's end in one: once such a step is measured to idle the device 1 ms (`note_gap`), K = 0 finishes first and is
    chosen, and held; while requests wait, tokens/s decides (K = 2). The gap is the median of a padded size's last
    measurements, else the nearest size's."""
    times = {128: {0: 1.667e-3, 2: 3.851e-3, 4: 6.030e-3}, 64: {0: 1.380e-3, 2: 2.636e-3, 4: 3.914e-3},
             32: {0: 1.25e-3, 2: 2.05e-3, 4: 2.95e-3}, 8: {0: 1.145e-3, 2: 1.779e-3, 4: 2.388e-3}}  # fmt: skip
    sizes = (8, 32, 64, 128)
    ctl = AdaptiveK((0, 2, 4), lambda k, b, c: times[next(s for s in sizes if s >= b)][k], sizes=sizes)
    ctl.rates = [0.786, 0.844, 0.831, 0.831]
    left = [(250, []) for _ in range(128)]
    assert ctl.gap(128) == 0.0
    assert ctl.finish_time(2, left) < ctl.finish_time(0, left) / 1.01
    assert ctl.choose(128, 0.0, left) == 2
    for seconds in (1e-3, 5e-3, 0.9e-3):  # (one stalled step moves the median by one sample)
        ctl.note_gap(100, seconds)
    assert ctl.gap(128) == 1e-3 and ctl.gap(1) == 1e-3  # (batch 100 pads to 128; 1: the nearest size measured)
    mean, sd = ctl.steps_left(2, left)
    spread = (mean + ctl._order_z(1, 128) * sd).max() - (mean + ctl._order_z(128, 128) * sd).min()
    assert 15 < spread < 22  # the steps from the first request's end to the last's
    without = AdaptiveK((0, 2, 4), ctl.step_time, sizes=sizes)
    without.rates = ctl.rates
    assert ctl.finish_time(0, left) == pytest.approx(without.finish_time(0, left) + 1e-3)  # one step not overlapped
    assert ctl.finish_time(2, left) == pytest.approx(without.finish_time(2, left) + (spread + 1) * 1e-3)
    assert ctl.finish_time(0, left) < ctl.finish_time(2, left) / 1.01
    ctl._held = None
    assert [ctl.choose(128, 0.0, left) for _ in range(3)] == [0, 0, 0] and ctl.current == 0
    assert ctl._held is not None  # (K = 0 by the finish time is held like any other finish-time choice)
    assert ctl.choose(128, 0.0, None) == 2  # requests wait: tokens/s
    ctl.note_gap(8, 0.2e-3)
    assert ctl.gap(1) == 0.2e-3 and ctl.gap(128) == 1e-3


def test_a_batch_after_one_ended_at_k0_does_not_stay_there():
    """The finish-time choice may end a batch at K = 0 (its last requests' last tokens). The next batch's prompts then
    run K_max (their drafter's KV written) and the controller continues from it, and leaving a finish-time K = 0
    counts the positions skipped since it began, not the batch's whole context: a draft model's catch-up of a few
    tokens a request (whose time a small catch-up's launches would inflate) cannot keep K at 0 for a whole batch. A
    K = 0 that tokens/s keeps (the drafter does not pay) still skips the drafter on prompts."""
    times = {128: {0: 1.667e-3, 2: 3.851e-3, 4: 6.030e-3}, 64: {0: 1.380e-3, 2: 2.636e-3, 4: 3.914e-3},
             8: {0: 1.145e-3, 2: 1.779e-3, 4: 2.388e-3}}  # fmt: skip
    sizes = (8, 64, 128)
    ctl = AdaptiveK((0, 2, 4), lambda k, b, c: times[next(s for s in sizes if s >= b)][k], sizes=sizes)
    ctl.rates = [0.85, 0.8, 0.8, 0.8]
    ctl.note_gap(64, 1e-3)
    ctl.current = 2
    assert ctl.choose(64, 200.0, [(1, [])] * 64) == 0  # one token left each: K = 0 finishes them as soon, cheaper
    assert ctl.current == 0 and ctl._finish_zero
    ctl.note_catch_up(64, 3e-3)  # a small catch-up: 47 us a token, not counted
    ctl.note_catch_up(4096, 8e-3)  # a batch's prompts: 2 us a token
    assert ctl.catch_up_per_token == pytest.approx(8e-3 / 4096)
    assert ctl.prompt_k() == 4 and ctl.current == 4 and not ctl._finish_zero  # the next batch's prompts: K_max
    assert ctl.choose(64, 144.0, [(255, [])] * 64) == 2  # and its decode steps speculate
    # leaving a finish-time K = 0 counts what it skipped since it began (one step here), at even 47 us a token; a
    # K = 0 of tokens/s's, the batch's whole context at that rate (0.43 s: more than K = 2 saves on 255 tokens)
    ctl.catch_up_per_token = 47e-6
    ctl.current, ctl._finish_zero, ctl.steps_at_zero, ctl._held = 0, True, 1, None
    assert ctl.choose(64, 144.0, [(255, [])] * 64) == 2
    ctl.current, ctl._finish_zero, ctl.steps_at_zero, ctl._held = 0, False, 1, None
    assert ctl.choose(64, 144.0, [(255, [])] * 64) == 0
    ctl.catch_up_per_token = 8e-3 / 4096
    # tokens/s's K = 0 (acceptance gone) keeps the drafter off the prompts
    ctl.rates = [0.0] * 4
    assert ctl.choose(64, 144.0, [(255, [])] * 64) == 0 and not ctl._finish_zero
    assert ctl.prompt_k() == 0 and ctl.current == 0
