"""Adaptive speculation (CompileConfig.speculation="adaptive"): each decode step picks K from a few choices.

The choice maximises expected tokens per second for the step's batch:

    tokens(K) = 1 + sum_{i<K} prod_{j<=i} a_j      (a_j: running conditional acceptance of draft position j)
    tokens/s  = tokens(K) / time(K, padded batch, mean cached length)

`time` is runtime/step_times.py's `StepTimes`, a table per (K, padded request count) of a step's time on real rows as a
line in the requests' cached length: measured on the captured one-graph step graphs at start-up, every row a request at
two cached lengths (runtime/warmup.py), plus an offset per padded size from the step times observed in steady,
overlapped decoding at any K (`calibrate`, from runtime/engine.py); or, where nothing is captured (the CPU), estimated
from the bytes each K reads (the target's weights once, the drafter's once per draft), which is what a decode step is
bound by.

While no request waits to join (runtime/engine.py passes `left`), the batch ends with its last request, and where
tokens/s chose a K > 0, K is chosen again, K = 0 included, for the least expected time to finish the batch
(`finish_time`): request i with r_i tokens left needs n_i steps at K, about normal with mean r_i / e_i and variance
r_i v_i / e_i^3 (a renewal process; e_i, v_i the mean and variance of the tokens one step emits for it, counting no
draft past its r_i - 1), from its own acceptance counts (fading by `request_decay` a step) against a prior of `prior`
observations at the batch's rates; the c-th request to finish last is taken at the c-th largest mean plus z(c, B)
standard deviations (z: the expected order statistics of B standard normals), and while c requests are left a step
costs step_time(K, c) (the padded size shrinks as requests finish). Each step from the first request's end to the
last's is not overlapped (runtime/engine.py relaunches no step in which a request may end) and costs the device's
idle time between a read and the next launch more (`gap`: measured on such steps, `note_gap`); K = 0's requests of
equal length end in one step. What tokens/s misses and this sees: a batch's slowest request decides when it ends, a
larger K spreads the requests' finishing steps more (K = 4's tokens a step vary more, and differ more between
requests) and so has more steps not overlapped, and drafts past a request's last token are wasted. With the H100's
step times at B = 8 (1B pair) K = 4 is 4.7 % better per step (3.43 tokens a step in 2.886 ms, against 2.49 in 2.193)
but the batch at K = 4 ran 81 decode steps against its mean request's 74.6, at K = 2 105 against 102.8: K = 2
finished 3.5 % sooner. On an H200 at B = 128 K = 2 is 6 % better per step than K = 0 (2.45 tokens in 3.85 ms against
1 in 1.67) and its batch 4 % slower (115 steps against its mean request's 102, 19 of them not overlapped). Where
tokens/s chose K = 0, K = 0 stands (it observes nothing: only probes bring K back, so it is left for steady-state
reasons alone; an earlier tail term, in tokens/s, that also decided K = 0 against K > 0 ran B = 128 with nothing
accepted at K = 2 throughout: docs/performance.md). A step launched before the one before it was read takes that
step's expected tokens off first (`ahead`), and near a request's end the engine chooses after the read. A switch must
save `finish_margin` (1 %) of the time left, and where the choice is made for a step that would be relaunched
(`ahead`), also one step's time (the overlap the switch gives up, at most a step; `switch_steps` of them: a setting
to measure against). Away from the batch's end the finish-time choice is held for `recheck` steps of the same batch
(computing it is most of the controller's host time: about 100 us a step at 128 requests on a CPU core, against 25 us
held). A K above the last step's first verifies that step's drafts, padded: its time counts the tokens that step
misses (at the H100's B = 8 the 1B pair's adaptive run had 6 such K = 4 steps among 101 at K = 2, at K = 2's
acceptance, and ended 4 % behind fixed K = 2), and up from K = 0 a draft model's catch-up.

The acceptance rates are exponential moving averages per draft position, fed by every verified step (a request
that accepted a drafts observed positions 0..a as accepted, accepted, ..., rejected); a step in which fewer than
`full_weight_at` (4) requests reached a position moves its rate in proportion (a batch's last one or two requests,
one 0 or 1 each, drove rate 0 to 0.22-0.29 and K to 0 at the tail of a simulated batch of the tiny pair, which the
next batch then kept for 368 steps until a probe: scripts/sim_adaptive.py, B = 32 0.913 -> 1.000 of the best fixed
K, B = 64 0.852 -> 1.000, the mid pair's within 0.002). A step at K observes only
positions below K (the ones past it drift toward position K - 1's rate, so a K below K_max can climb back); at
K = 0 nothing, so after a while at K = 0 two steps run at the smallest K > 0 to measure again (a probe: the first
proposes the drafts the second verifies: a request whose drafts were padded, after a step at a smaller K, is not
observed; runtime/engine.py). Probes back off exponentially while they do not pay (`probe` steps, doubled after each
probe up to `max_probe`), and are at least as far apart as keeps their cost within `probe_budget` of the time spent
at K = 0: two steps at K > 0 instead of K = 0, the switches, and a draft model's catch-up on the positions K = 0
skipped (the batch's cached tokens, at the seconds per token the last catch-ups of `catch_up_min_tokens` or more
took: `note_catch_up`). Prompts run K = 0 (the drafter skipped) only while tokens/s keeps K there; a K = 0 the
finish-time choice made ends with its batch (`prompt_k`).

Lossless by construction: a step's K depends only on acceptance and lengths already read back to the host (steps up
to s - 1, or s - 2 with overlapped steps), never on the drafts the step verifies. The switch margin keeps K from
flapping (every change of K costs one step without overlap, and a return from K = 0 a catch-up of the drafter).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np


@dataclass(frozen=True)
class BatchLeft:
    """A decode batch's requests as `choose` takes them while none waits (runtime/engine.py): per request, the
    tokens it may still emit, its slot and its id. Its acceptance counts are the controller's, a row per slot
    (`observe(..., slots, ids)`), so no per-request list is built or updated on the host each step."""

    tokens: np.ndarray  # [B] float64
    slots: np.ndarray  # [B] int64
    ids: np.ndarray  # [B] int64

    def __len__(self) -> int:
        return len(self.tokens)


# What choose, finish_time and steps_left take as the batch's requests: a BatchLeft, or per request (tokens left,
# its own counts list)
Left = BatchLeft | Sequence[tuple[int, list]]


class AdaptiveK:
    """The per-step choice of K among `ks` (ascending, K_max last)."""

    def __init__(
        self,
        ks: tuple[int, ...],
        step_time: Callable[..., float | None],  # (K, batch size, mean cached length) -> seconds (None: unknown)
        ema: float = 0.1,  # weight of one step's observation
        margin: float = 0.03,  # a new K must beat the current one by this fraction
        probe: int = 32,
        max_probe: int = 1 << 16,
        probe_budget: float = 0.01,  # probes cost at most this fraction of the time spent at K = 0
        initial_rate: float = 0.7,
        sizes: Sequence[int] = (),  # the padded batch sizes step_time's entries change at (StepTimes.sizes)
        prior: float = 32.0,  # a request's own rates start as this many observations at the batch's rates
        request_decay: float = 0.97,  # a request's own counts fade by this per step (its text changes)
        finish_margin: float = 0.01,  # a new K must finish the batch sooner by this fraction (and the overlap lost)
        recheck: int = 4,  # the finish-time choice is held for this many steps of the same batch, away from its end
        full_weight_at: int = 4,  # requests reaching a draft position for a step's whole `ema` weight there
        switch_steps: float = 1.0,  # what a switch of K gives up where a step is relaunched, in the current K's steps
        gap_window: int = 15,  # the device's idle times between a read and the next launch kept per padded size
        catch_up_min_tokens: int = 256,  # a draft model's catch-up counts toward its seconds a token from this size
    ):
        if not ks or list(ks) != sorted(set(ks)):
            raise ValueError(f"adaptive K choices {ks} must be distinct and ascending, e.g. (0, 2, 4)")
        self.ks, self.k_max = tuple(ks), ks[-1]
        self.step_time = step_time
        self.ema, self.margin = ema, margin
        self.rates = [initial_rate] * self.k_max  # conditional acceptance per draft position
        self.current = self.k_max
        self.probe, self.min_probe, self.max_probe, self.probe_budget = probe, probe, max_probe, probe_budget
        self.steps_at_zero = 0
        self.probes = 0  # probes started (stats)
        self.catch_up_per_token: float | None = None  # seconds per token of a draft model's catch-up (None: none yet)
        self._probe_left = 0
        self.histogram: Counter = Counter()  # K chosen -> steps
        self.sizes = tuple(sorted(sizes))
        self.prior, self.request_decay, self.finish_margin = prior, request_decay, finish_margin
        self.recheck, self.full_weight_at, self.switch_steps = recheck, full_weight_at, switch_steps
        self._held: tuple | None = None  # ((batch size, ahead), steps it may still be held, K): `_finish_choice`
        self._finish_zero = False  # the current K = 0 was the finish-time choice (tokens/s wanted a K > 0)
        self.catch_up_min_tokens = catch_up_min_tokens
        self.gap_window = gap_window
        self._gaps: dict[int, deque] = {}  # padded size -> the last idle times of steps not overlapped (`note_gap`)
        self._gap: dict[int, float] = {}  # padded size -> their median
        self._z: dict[tuple[int, int], float] = {}  # (c, b) -> the expected c-th largest of b standard normals
        self._cut: dict[int, tuple] = {}  # b -> `_cuts(b)`
        self._no_counts = [0.0] * (2 * self.k_max)  # a request not observed yet: the batch's rates alone
        self._adds: dict[int, np.ndarray] = {}  # K -> per drafts accepted, a request's counts' increments
        # The requests' own counts by slot (BatchLeft's and observe's `slots`): a row, and the id of its request (a
        # slot taken by another request starts from no counts)
        self._js: dict[int, np.ndarray] = {}  # K -> the draft positions 1..K (_moments)
        self._counts = np.zeros((0, 2 * self.k_max))
        self._owner = np.zeros(0, dtype=np.int64)

    def expected_tokens(self, k: int) -> float:
        """1 + sum_{i<k} prod_{j<=i} a_j: tokens a step at K emits per request on average."""
        total, p = 1.0, 1.0
        for a in self.rates[:k]:
            p *= a
            total += p
        return total

    def throughput(self, k: int, batch: int, ctx: float = 0.0) -> float | None:
        t = self.step_time(k, batch, ctx)
        return None if not t else self.expected_tokens(k) / t

    def choose(
        self,
        batch: int,
        ctx: float = 0.0,
        left: Left | Callable[[], Left | None] | None = None,
        ahead: int | None = None,
    ) -> int:
        """K for the next decode step of `batch` requests holding `ctx` cached tokens on average (counted in the
        histogram). `left`, when no request waits to join: per request of the batch, (the tokens it may still
        emit, its acceptance counts as `observe` keeps them), or a BatchLeft, or a function giving either (called
        only where K > 0 is in question: a step at K = 0 builds nothing); then K minimises the time to finish them,
        after a step at K = `ahead` that is launched but not read yet (None: none)."""
        if self._probe_left:  # the probe's second step: it verifies the drafts the first one proposed
            self._probe_left -= 1
            return self._count(self.ks[1])
        k = self._best(batch, ctx)
        if k and callable(left):
            left = left()
        finish = bool(k) and left is not None
        if finish:  # (tokens/s's K = 0 stands: it observes nothing, so only probes bring K back from it)
            k = self._finish_choice(left, ctx, ahead)
        self._finish_zero = finish and k == 0
        if k == 0:
            if not finish:
                self._held = None  # (back above K = 0, the finish-time choice is made afresh)
            self.steps_at_zero += 1
            if self.steps_at_zero > self._probe_interval(batch, ctx):  # then two steps at the smallest K > 0
                self.steps_at_zero = 0
                self.probe = min(2 * self.probe, self.max_probe)  # the next one later, unless this one pays
                self.probes += 1
                self._probe_left = 1
                return self._count(self.ks[1])  # current stays 0
        else:
            self.steps_at_zero = 0
            self.probe = self.min_probe
        self.current = k
        return self._count(k)

    def prompt_k(self) -> int:
        """K for a step with prompt chunks (runtime/engine.py): 0 while tokens/s has K at 0 (the drafter does not pay:
        it skips the prompts and catches up if K returns), else K_max (the drafter writes their KV). A K = 0 that the
        finish-time choice made (a batch's last steps) ends here: the new prompts' step runs K_max and the controller
        continues from it, so a batch that follows one ended at K = 0 neither skips its drafter on its prompts nor
        has to catch it up on them to leave K = 0 (an H200, 2026-11-28: two runs of nine at B = 64 stayed at K = 0 for
        all 256 steps that way, 16 % slower)."""
        if self.current == 0 and not self._finish_zero:
            return 0
        if self.current == 0:
            self.current, self._finish_zero, self._held, self.steps_at_zero = self.k_max, False, None, 0
        return self.k_max

    def probe_cost(self, batch: int, ctx: float = 0.0) -> float | None:
        """Seconds a probe adds to the steps at K = 0 it replaces: its two steps at the smallest K > 0, about one
        step more for the switches there and back (steps not overlapped), and a draft model's catch-up on the
        batch's cached tokens (at the last catch-ups' seconds per token; before any, one step at that K)."""
        t0, t1 = self.step_time(0, batch, ctx), self.step_time(self.ks[1], batch, ctx)
        if not t0 or not t1:
            return None
        per = self.catch_up_per_token
        catch_up = t1 if per is None else per * batch * ctx
        return 2 * (t1 - t0) + t0 + catch_up

    def _probe_interval(self, batch: int, ctx: float = 0.0) -> int:
        """Steps at K = 0 before the next probe: `probe` (doubled after each probe), and at least as many as keep the
        probe's cost within `probe_budget` of the time at K = 0."""
        cost = self.probe_cost(batch, ctx)
        if cost is None:
            return self.probe
        return max(self.probe, math.ceil(cost / (self.probe_budget * self.step_time(0, batch, ctx))))

    def note_catch_up(self, tokens: int, seconds: float) -> None:
        """A draft model's catch-up fed `tokens` in `seconds` (runtime/engine.py times it, synchronised). Only one of
        `catch_up_min_tokens` or more moves the seconds a token: a small one's time is its launches' (64 tokens in
        a few ms read 30-50 us a token, and a batch's whole prompts caught up at that rate would seem to cost more
        than K = 0 loses)."""
        if tokens >= max(self.catch_up_min_tokens, 1):
            per = seconds / tokens
            prev = self.catch_up_per_token
            self.catch_up_per_token = per if prev is None else prev + 0.5 * (per - prev)

    def note_gap(self, batch: int, seconds: float) -> None:
        """A step of `batch` requests that was not overlapped: the device idled `seconds` between the read of the step
        before it and its launch (runtime/engine.py: the host's bookkeeping, scheduling, this choice and the launch,
        which an overlapped step hides under the step before). The median of the padded size's last `gap_window` is
        what `finish_time` charges each step it expects not to overlap."""
        b = self._padded(batch)
        window = self._gaps.setdefault(b, deque(maxlen=self.gap_window))
        window.append(seconds)
        self._gap[b] = statistics.median(window)

    def gap(self, batch: int) -> float:
        """Seconds a step of `batch` requests that is not overlapped idles the device (`note_gap`: its padded size's, or
        the nearest one measured; 0 before any)."""
        if not self._gap:
            return 0.0
        b = self._padded(batch)
        got = self._gap.get(b)
        return got if got is not None else self._gap[min(self._gap, key=lambda s: (abs(s - b), s))]

    def _padded(self, batch: int) -> int:
        return next((s for s in self.sizes if s >= batch), batch)

    def _count(self, k: int) -> int:
        self.histogram[k] += 1
        return k

    def _best(self, batch: int, ctx: float = 0.0) -> int:
        scores = {k: self.throughput(k, batch, ctx) for k in self.ks}
        if any(s is None for s in scores.values()):  # no time for this batch: K_max, as "fixed"
            return self.k_max
        best = max(self.ks, key=lambda k: (scores[k], k))
        cur = self.current if self.current in scores else self.k_max
        return cur if scores[best] <= scores[cur] * (1 + self.margin) else best

    def _finish_choice(self, left: Left, ctx: float, ahead: int | None) -> int:
        """`_best_to_finish`, computed again every `recheck` steps of the same batch (its size and the step ahead
        unchanged), and at every step once a request is within a few steps of its end (where the choice decides
        the batch's last steps): the choice moves slowly, and computing it is most of the host's time a step
        spends in this controller (about 100 us at 128 requests on a CPU core, a step's time of a few ms)."""
        tokens = left.tokens if isinstance(left, BatchLeft) else np.array([r for r, _ in left], dtype=np.float64)
        near = len(tokens) == 0 or float(tokens.min()) <= 4 * (self.k_max + 1)
        key = (len(tokens), ahead)
        held = self._held
        if not near and held is not None and held[0] == key and held[1] > 0:
            self._held = (key, held[1] - 1, held[2])
            return held[2]
        k = self._best_to_finish(left, ctx, ahead)
        self._held = None if near else (key, self.recheck - 1, k)  # (a choice at a batch's end is not held)
        return k

    def _best_to_finish(self, left: Left, ctx: float, ahead: int | None = None) -> int:
        """The K of the least expected time to finish the batch's requests (`finish_time`), K = 0 included (a batch
        at K > 0 ends with its slowest request, and its steps near the requests' ends are not overlapped)."""
        r, p = self._table(left)
        if ahead is not None:  # the step launched and not read: its expected tokens off, once for every K
            r = r - self._moments(ahead, r, p)[0]
        times = {k: self.finish_time(k, left, ctx, None, (r, p)) for k in self.ks}
        if any(t is None for t in times.values()):
            return self.k_max
        cur = self.current
        # A K above the current one verifies, at its first step, the current K's drafts padded (runtime/step.py
        # fit_drafts): that step emits the current K's tokens at the new K's time; the tokens it misses cost about
        # (e_K - e_cur) / e_K of a step at K more. Up from K = 0, a draft model also catches up on what it skipped
        # (as `probe_cost` counts it: the batch's cached tokens, or before any catch-up was timed, a step at K).
        e_cur = self.expected_tokens(cur)
        for k in times:
            if k > cur:
                e, t = self.expected_tokens(k), self.step_time(k, len(left), ctx)
                times[k] += t * (e - e_cur) / e
                if cur == 0:  # the positions skipped: since the finish-time K = 0 began, or (tokens/s's) at most all
                    per = self.catch_up_per_token
                    lag = self.steps_at_zero if self._finish_zero else ctx
                    times[k] += t if per is None else per * len(left) * lag
        best = min(times, key=lambda k: (times[k], -k))
        # a switch must save `finish_margin` of the time left, and where the step would have been relaunched (a
        # step `ahead` runs), the overlap it gives up: at most one step
        switch = self.switch_steps * self.step_time(cur, len(left), ctx) if ahead is not None else 0.0
        return cur if times[cur] <= times[best] * (1 + self.finish_margin) + switch else best

    def finish_time(self, k: int, left: Left, ctx: float = 0.0, ahead: int | None = None, table=None) -> float | None:
        """Expected seconds until every request of `left` (tokens it may still emit, its acceptance counts) has
        finished at K. Request i needs n_i steps, about normal with mean r_i / e_i and variance r_i v_i / e_i^3 (a
        renewal process's; e_i, v_i: mean and variance of the tokens a step emits for it, at most r_i); the c-th
        last to finish is taken as the c-th largest mean plus z(c, B) of its standard deviations (z(c, B): the
        expected c-th largest of B standard normals, Blom's). While c requests are left a step takes step_time(K,
        c): the sum over c of step_time(K, c) x (the c-th largest n - the (c+1)-th). `ahead`: the K of a step
        launched but not read yet; its expected tokens are taken off r_i first."""
        b = len(left)
        cuts, rows, z = self._cuts(b)
        times = [self.step_time(k, c, ctx) for c in cuts]
        if not all(times):
            return None
        mean, sd = self.steps_left(k, left, ahead, table)
        i = np.argsort(-mean, kind="stable")[rows]  # the c-th longest request for each c of `cuts`
        # the sum by parts: n_c x (step_time(K, c) - step_time(K, c - 1)), nonzero at c = 1 and past each padded size
        ns = np.maximum(mean[i] + z * sd[i], 0.0).tolist()
        total, prev = 0.0, 0.0
        for n, t in zip(ns, times):
            total += n * (t - prev)
            prev = t
        gap = self.gap(b)
        if gap and b:
            # steps not overlapped: one where any request may end (it is within K + 1 tokens of its end: about
            # (K + 1) / e steps of each), from the first request's end to the last's
            first = float(np.min(mean + self._order_z(b, b) * sd))
            total += gap * min(ns[0] - first + 1.0, b * (k + 1) / self.expected_tokens(k))
        return total

    def _cuts(self, b: int) -> tuple[tuple[int, ...], np.ndarray, np.ndarray]:
        """For a batch of b requests: the request counts c where a step's padded size changes (1, and one past each
        padded size below b), their rows (c - 1) and z(c, b)."""
        got = self._cut.get(b)
        if got is None:
            cuts = (1, *(s + 1 for s in self.sizes if s < b))
            got = self._cut[b] = (cuts, np.array([c - 1 for c in cuts]), np.array([self._order_z(c, b) for c in cuts]))
        return got

    def _order_z(self, c: int, b: int) -> float:
        """The expected c-th largest of b standard normals (Blom's approximation)."""
        z = self._z.get((c, b))
        if z is None:
            z = self._z[(c, b)] = NormalDist().inv_cdf((b - c + 1 - 0.375) / (b + 0.25)) if b > 1 else 0.0
        return z

    def _table(self, left: Left) -> tuple[np.ndarray, np.ndarray]:
        """Per request of `left`: its tokens left [B], and P(A >= j + 1) for each draft position j [B, K_max], from
        its own rates: its counts with `prior` observations at the batch's rates. `left`: a BatchLeft (its counts
        the controller's, by slot), or per request (tokens left, its counts list as `observe` keeps them)."""
        n = self.k_max
        if isinstance(left, BatchLeft):
            self._own(left.slots, left.ids)  # (first: it may grow the counts)
            r, counts = left.tokens, self._counts[left.slots]
        else:
            r = np.fromiter((x for x, _ in left), dtype=np.float64, count=len(left))
            counts = np.array([c if c else self._no_counts for _, c in left], dtype=np.float64).reshape(
                len(left), 2 * n
            )
        rates = (counts[:, :n] + self.prior * np.asarray(self.rates)) / (counts[:, n:] + self.prior)
        return r, np.cumprod(rates, axis=1)

    def _own(self, slots: np.ndarray, ids: np.ndarray) -> None:
        """The rows of `slots` made to belong to `ids` (grown as needed; a row of another request starts at zero)."""
        if len(slots) and int(slots.max()) >= len(self._owner):
            grow = int(slots.max()) + 1 - len(self._owner)
            self._counts = np.concatenate([self._counts, np.zeros((grow, self._counts.shape[1]))])
            self._owner = np.concatenate([self._owner, np.full(grow, -1, dtype=np.int64)])
        stale = self._owner[slots] != ids
        if stale.any():
            self._counts[slots[stale]] = 0.0
            self._owner[slots[stale]] = ids[stale]

    def steps_left(self, k: int, left: Left, ahead: int | None = None, table=None) -> tuple[np.ndarray, np.ndarray]:
        """Mean and standard deviation of the steps each request of `left` needs at K for its remaining tokens,
        after a step at K = `ahead` not read yet (None: none) has emitted its expected share."""
        r, p = table if table is not None else self._table(left)
        if ahead is not None:
            r = r - self._moments(ahead, r, p)[0]
        if k == 0:
            return np.maximum(r, 0.0), np.zeros_like(r)
        e, var = self._moments(k, r, p)
        done = r <= 1
        mean = np.where(done, np.maximum(r, 0.0), r / e)
        sd = np.where(done, 0.0, np.sqrt(np.maximum(r, 0.0) * var / e**3))
        return mean, sd

    def _moments(self, k: int, r: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean and variance of the tokens a step at K emits per request (at most its r tokens left): E = 1 + sum_j
        P(A >= j), E[tokens^2] = 1 + sum_j (2j + 1) P(A >= j), over the drafts j <= min(K, r - 1)."""
        j = self._js.get(k)
        if j is None:
            j = self._js[k] = np.arange(1, k + 1, dtype=np.float64)
        q = p[:, :k] * (j < np.ceil(r)[:, None])  # draft j counts while j <= r - 1
        e = 1.0 + q.sum(axis=1)
        m2 = 1.0 + (q @ (2 * j + 1))
        return e, np.maximum(m2 - e * e, 0.0)

    def observe(
        self,
        k: int,
        accepted: list[int],
        counts: Sequence[list] | None = None,
        slots: np.ndarray | None = None,
        ids: np.ndarray | None = None,
    ) -> None:
        """One verified step at K: `accepted` drafts per request. Position i's observation is the fraction of the
        requests that reached it (accepted >= i) that accepted it (accepted > i). Each request's own (accepted,
        reached) counts per position, fading by `request_decay`: the controller's rows of `slots` (requests
        `ids`: BatchLeft's), in one array operation; or `counts`, per request a list (empty at first, filled here)."""
        if not k or not accepted:
            return
        d, add = self.request_decay, self._increments(k)
        if slots is not None:
            self._own(slots, ids)  # (first: it may grow the counts)
            self._counts[slots] = self._counts[slots] * d + add[np.minimum(np.asarray(accepted), k)]
        elif counts is not None:  # one comprehension a request
            for a, c in zip(accepted, counts):
                inc = add[min(a, k)].tolist()
                c[:] = [x * d + y for x, y in zip(c, inc)] if c else inc
        at = [0] * (k + 1)  # requests by drafts accepted
        for a in accepted:
            at[min(a, k)] += 1
        reached = len(accepted)  # requests that accepted at least i drafts
        for i in range(k):
            if not reached:
                break
            got = reached - at[i]  # ... at least i + 1
            w = self.ema * min(1.0, reached / self.full_weight_at)  # (one request's 0 or 1 moves it less)
            self.rates[i] += w * (got / reached - self.rates[i])
            reached = got
        for i in range(k, self.k_max):  # positions this K does not reach drift toward its last one's rate
            self.rates[i] += self.ema * (self.rates[k - 1] - self.rates[i])

    def _increments(self, k: int) -> np.ndarray:
        """Per drafts accepted a (0..K) at K, a row [K + 1, 2 K_max]: what a request's counts gain, accepted positions
        0..a - 1 and reached positions 0..a, below K (the layout of `observe`'s counts: accepted, then reached)."""
        add = self._adds.get(k)
        if add is None:
            n = self.k_max
            add = self._adds[k] = np.array(
                [[float(i < min(a, k)) for i in range(n)] + [float(i < min(a + 1, k)) for i in range(n)]
                 for a in range(k + 1)]
            )  # fmt: skip
        return add

    def stats(self) -> dict:
        return {
            "choices": list(self.ks),
            "histogram": {k: self.histogram.get(k, 0) for k in self.ks},
            "acceptance_rates": [round(a, 4) for a in self.rates],
            "probes": self.probes,
        }

    def reset_stats(self) -> None:
        self.histogram.clear()
        self.probes = 0
