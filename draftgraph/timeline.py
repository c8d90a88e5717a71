"""The process's start-up timeline (issue 44): when each phase of a command ended, in seconds since the process
started, not since draftgraph was imported.

The start is the kernel's start time of this process (/proc/self/stat, field 22, in clock ticks since boot:
10 ms steps), so the interpreter's own start and every import before ours are counted; where /proc is missing,
the first import of this module stands in. `mark(phase)` records that a phase ended now (or at `at`, a
`time.monotonic()` reading, for a phase another thread or process reported); `report()` gives one line per
phase, in time order. Marks cost a list append: they are always recorded, and `draftgraph -v` prints them.
A phase marked twice (a second engine in one process) keeps both marks.
"""

from __future__ import annotations

import os
import threading
import time

# The phases `draftgraph generate` marks, in the order a cold start passes them: (name, what ended there).
PHASES = (
    ("imports", "python started, the command parsed, torch and draftgraph imported"),
    ("models", "the model pair built or found (the built-in pair: random weights on the CPU)"),
    ("process group", "a worker rank: torch.distributed's default group joined"),
    ("groups", "a worker rank: its tensor-parallel group, the group's NCCL communicator and peer memory"),
    ("CUDA init", "the CUDA context made, the device's memory read"),
    ("compile workers ready", "the compile workers' processes started (in the background)"),
    ("weight load", "target and drafter weights on the device"),
    ("kernel loads", "artifacts checked and their compiled code loaded (with --artifacts)"),
    ("tracing", "Dynamo's traces and the first runs of every function"),
    ("compiles", "every piece compiled (waiting for the compile workers) and loaded"),
    ("capture", "CUDA graphs captured (or left to the first steps that need them)"),
    ("KV sizing", "device memory measured and the KV cache sized"),
    ("engine ready", "the engine built"),
    ("first token", "the first step that emitted tokens"),
    ("exit", "output flushed, the process about to end"),
    ("exit handlers", "the exit handlers run (compile and worker processes, caches, finalizers); -v only"),
)


def _process_start() -> float:
    """When this process started, on time.monotonic()'s clock (this module's import time where /proc is missing)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # past "pid (comm)": fields[0] is field 3
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time since boot
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - started
        return time.monotonic() - max(0.0, age)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.monotonic()


PROCESS_START = _process_start()
_marks: list[tuple[float, str, str]] = []  # (monotonic time, phase, detail)
_lock = threading.Lock()


def since_start(at: float | None = None) -> float:
    """Seconds from the process's start to `at` (a time.monotonic() reading; now when None)."""
    return (time.monotonic() if at is None else at) - PROCESS_START


def mark(phase: str, detail: str = "", at: float | None = None) -> None:
    """Record that `phase` ended now (or at `at`, a time.monotonic() reading)."""
    with _lock:
        _marks.append((time.monotonic() if at is None else at, phase, detail))


def mark_once(phase: str, detail: str = "") -> None:
    """`mark`, unless `phase` was marked already (the first token of the process, not of every request)."""
    with _lock:
        if any(p == phase for _, p, _ in _marks):
            return
        _marks.append((time.monotonic(), phase, detail))


def marks() -> list[tuple[str, float, str]]:
    """(phase, seconds since the process started, detail), in time order."""
    with _lock:
        rows = sorted(_marks)
    return [(phase, at - PROCESS_START, detail) for at, phase, detail in rows]


def raw() -> list[tuple[float, str, str]]:
    """(time.monotonic() reading, phase, detail) of every mark, in time order, with the process's start first as
    "process started": what another process on this host marks into its own timeline (CLOCK_MONOTONIC is the
    host's: a worker rank's marks, workers/driver.py)."""
    with _lock:
        return [(PROCESS_START, "process started", ""), *sorted(_marks)]


def report() -> str:
    """One line per phase: when it ended (seconds since the process started), how long after the line before,
    its name and detail."""
    lines, before = ["start-up timeline (seconds since the process started; + since the line before):"], 0.0
    for phase, t, detail in marks():
        lines.append(f"  {t:7.2f} s  +{t - before:6.2f} s  {phase}" + (f": {detail}" if detail else ""))
        before = t
    return "\n".join(lines)


def reset() -> None:
    """Forget every mark (tests)."""
    with _lock:
        _marks.clear()
