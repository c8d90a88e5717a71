"""The step-time table adaptive speculation's controller (runtime/adaptive.py) reads: seconds of a decode step per (K,
padded request count), measured at start-up on the captured graphs (runtime/warmup.py) and corrected by the steady
steps the engine runs (runtime/engine.py)."""

from __future__ import annotations

import statistics
from collections import deque


class StepTimes:
    """Seconds of a decode step per (K, padded request count) as a line in the requests' mean cached length, the
    controller's `step_time`: `measured` (the step at cached length 0, every row a request) and `per_token` (its
    slope) filled at start-up on the captured one-graph steps (runtime/warmup.py), plus an `offset` per padded size
    shared by every K: the median of the last `window` residuals (a steady step's observed time less its entry's)
    of steps at any K (`calibrate`: what the start-up's rows lack, the host's share of a step with many requests).
    Shared, because an entry of its own per K was corrected only while its K ran: one that read too high kept its
    K from running and stayed so (an H100, 2026-11-28: with nothing accepted, batch 32 ran K = 4 throughout, 0.47 of
    plain's tokens/s, K = 0's time read 2.5x plain's step). The median: a stall (a collection, another process's
    burst) moves it by one sample at most. A time never falls below a quarter of its entry.
    Without measurements (no CUDA graphs), estimated from the bytes a step reads (the target's weights once, the
    drafter's once per draft), in units of the target's bytes, whatever the batch."""

    def __init__(self, full_sizes: tuple[int, ...], target, drafter, window: int = 15):
        self.sizes = tuple(sorted(full_sizes))
        self._bucket = [next((s for s in self.sizes if s >= b), None) for b in range(max(self.sizes, default=0) + 1)]
        self.measured: dict[tuple[int, int], float] = {}
        self.per_token: dict[tuple[int, int], float] = {}
        self.offset: dict[int, float] = {}  # padded size -> seconds a steady step takes past its entry (any K)
        self._residuals: dict[int, deque] = {}
        self.window = window
        t = param_bytes(target)
        self.t_target, self.t_draft = t, param_bytes(drafter) or t // 50  # (the n-gram drafter: its lookup)

    def bucket(self, batch: int) -> int | None:
        """The padded request count of a uniform batch (FULL sizes), None past them."""
        return self._bucket[batch] if batch < len(self._bucket) else None

    def __call__(self, k: int, batch: int, ctx: float = 0.0) -> float | None:
        if not self.measured:
            return (self.t_target + k * self.t_draft) / max(self.t_target, 1)
        b = self.bucket(batch)
        t = self.measured.get((k, b))
        if t is None:
            return None
        return max(t + self.per_token.get((k, b), 0.0) * ctx + self.offset.get(b, 0.0), 0.25 * t)

    def calibrate(self, k: int, batch: int, seconds: float, ctx: float = 0.0) -> None:
        """One steady step's time at K for `batch` requests of `ctx` cached tokens on average: its residual against
        the entry joins the padded size's window, whose median is the size's offset."""
        b = self.bucket(batch)
        t = self.measured.get((k, b))
        if t is None:
            return
        window = self._residuals.setdefault(b, deque(maxlen=self.window))
        window.append(seconds - (t + self.per_token.get((k, b), 0.0) * ctx))
        self.offset[b] = statistics.median(window)


def param_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters()) if module is not None else 0
