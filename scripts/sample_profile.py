"""A wall-clock sampling profiler of one thread (the main thread by default), for where a cold start waits.

cProfile counts CPU time of Python calls and slows them several-fold; a cold start also waits on subprocesses
(ptxas, compile workers), locks and the GPU. This samples the thread's stack every `interval` seconds from a
second thread and reports the share of wall time each of draftgraph's functions was on the stack (inclusive), and
the innermost frame of the packages named (the rest, e.g. the standard library, folds into its caller).

    with SampleProfiler() as prof:
        work()
    print(prof.report())
"""

from __future__ import annotations

import collections
import sys
import threading
import time

PACKAGES = ("draftgraph", "torch/_dynamo", "torch/_inductor", "torch/fx", "torch/_subclasses", "triton", "scripts")


# What a sample was doing, by frames on its stack (first match wins): where a test's time goes.
CATEGORIES = {
    "triton": lambda top, seen: top.startswith(("triton/backends", "triton/compiler", "triton/runtime/build")),
    "workers": lambda top, seen: any("compile_pool.py" in k and k.endswith(("(load)", "(wait_all)")) for k in seen),
    "capture": lambda top, seen: any(k.endswith("(_capture)") and "cuda_graphs.py" in k for k in seen),
    "inductor": lambda top, seen: top.startswith("torch/_inductor"),
    "trace": lambda top, seen: top.startswith(("torch/_dynamo", "torch/_subclasses", "torch/fx")),
    "steps": lambda top, seen: any(k.endswith(("(step)", "(generate)")) and "runtime/engine.py" in k for k in seen),
    "build": lambda top, seen: any(k.endswith("(compile_model)") for k in seen),
}


def category(top: str | None, seen: set[str]) -> str:
    for name, match in CATEGORIES.items():
        if top is not None and match(top, seen):
            return name
    return "other"


class SampleProfiler:
    def __init__(
        self,
        interval: float = 0.01,
        packages: tuple[str, ...] = PACKAGES,
        thread_id: int | None = None,
        inclusive_of: tuple[str, ...] = ("draftgraph", "scripts"),
        by_test: bool = False,
    ):
        self.interval, self.packages, self.inclusive_of = interval, packages, inclusive_of
        self.thread_id = thread_id if thread_id is not None else threading.main_thread().ident
        self.inclusive: collections.Counter = collections.Counter()
        self.self_time: collections.Counter = collections.Counter()
        # samples inside Triton's compiler, by the innermost of our functions on the stack: who compiles kernels
        self.waits_in = ("triton/backends", "triton/compiler")
        self.waits_by_caller: collections.Counter = collections.Counter()
        # `by_test`: for each test function on the stack (a frame in tests/ named test_*), samples per category
        self.by_test = by_test
        self.tests: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _key(self, code) -> str | None:
        path = code.co_filename.replace("\\", "/")
        for p in self.packages:
            at = path.rfind(p)
            if at >= 0:
                return f"{path[at:]}:{code.co_firstlineno}({code.co_name})"
        return None

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            frame = sys._current_frames().get(self.thread_id)
            if frame is None:
                continue
            self.samples += 1
            seen, top, ours, test = set(), None, None, None
            while frame is not None:
                key = self._key(frame.f_code)
                if key is not None:
                    top = top or key
                    if ours is None and key.startswith(self.inclusive_of):
                        ours = key
                    seen.add(key)
                    if key.startswith("tests/") and frame.f_code.co_name.startswith("test_"):
                        test = key  # the outermost test function wins (the walk goes outwards)
                frame = frame.f_back
            if self.by_test:
                self.tests[test or "(outside tests)"][category(top, seen)] += 1
            self.inclusive.update(k for k in seen if k.startswith(self.inclusive_of))
            self.self_time[top or "(outside the packages)"] += 1
            if top is not None and top.startswith(self.waits_in):
                self.waits_by_caller[ours or "(no caller of ours)"] += 1

    def test_report(self, top: int = 40) -> str:
        """Seconds per test function (the most first) and the share of each category in it."""
        n = max(1, self.samples)
        scale = self.seconds / n
        cats = list(CATEGORIES) + ["other"]
        totals = collections.Counter({cat: sum(c[cat] for c in self.tests.values()) for cat in cats})
        lines = ["-- by test function: seconds in all, then by category", " ".join(f"{c:>9}" for c in cats) + "  test"]
        rows = [("(every test)", totals)] + sorted(self.tests.items(), key=lambda kv: -sum(kv[1].values()))[:top]
        for name, c in rows:
            total = sum(c.values()) * scale
            lines.append(" ".join(f"{c[cat] * scale:9.1f}" for cat in cats) + f"  {total:6.1f} s {name}")
        return "\n".join(lines)

    def __enter__(self) -> SampleProfiler:
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.seconds = time.perf_counter() - self._t0

    def report(self, top: int = 45, min_share: float = 0.01) -> str:
        n = max(1, self.samples)
        lines = [f"sampled {self.samples} stacks over {self.seconds:.1f} s (every {self.interval * 1e3:.0f} ms)"]
        views = (
            ("draftgraph, inclusive", self.inclusive),
            ("innermost frame of the packages", self.self_time),
            ("Triton compiling, by the innermost of our functions above it", self.waits_by_caller),
        )
        for title, counter in views:
            lines.append(f"-- {title}: seconds, share, function")
            for key, c in counter.most_common(top):
                if c / n < min_share:
                    break
                lines.append(f"{c / n * self.seconds:7.2f} s {c / n:6.1%}  {key}")
        return "\n".join(lines)
