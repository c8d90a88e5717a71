"""The start-up timeline (draftgraph/timeline.py): marks in time order, counted from the process's start.

The CLI's printout of it (every phase of a start, in order) is checked in test_artifacts.py's fresh-process
test, which runs `draftgraph -v generate` anyway."""

import time

import pytest

from draftgraph import timeline


@pytest.fixture
def clean_timeline():
    saved = list(timeline._marks)
    timeline.reset()
    yield
    timeline.reset()
    timeline._marks.extend(saved)


def test_marks_in_time_order_since_the_process_started(clean_timeline):
    started = timeline.since_start()
    # The process started before this test and before draftgraph was imported (pytest's own imports): the
    # start comes from the kernel (/proc/self/stat), not from this module's import.
    assert started > 0
    timeline.mark("b")
    timeline.mark("a", "earlier, reported from another thread", at=time.monotonic() - 1.0)
    timeline.mark_once("c")
    timeline.mark_once("c")  # the first token is marked once, not at every step
    rows = timeline.marks()
    assert [phase for phase, _, _ in rows] == ["a", "b", "c"]
    assert rows[0][1] < rows[1][1] <= rows[2][1] and abs(rows[1][1] - started) < 5.0
    lines = timeline.report().splitlines()
    assert len(lines) == 4 and lines[1].endswith("a: earlier, reported from another thread")
    # "+" is the time since the line before: the second line's is the gap between a and b (1 s)
    assert abs(float(lines[2].split("+")[1].split(" s")[0]) - 1.0) < 0.5


def test_raw_marks_carry_the_hosts_clock_for_another_process(clean_timeline):
    """`raw()`: what a worker rank sends its driver (workers/driver.py marks rank 0's phases at their times)."""
    timeline.mark("weight load")
    timeline.mark("imports", at=time.monotonic() - 0.5)
    rows = timeline.raw()
    assert [p for _, p, _ in rows] == ["process started", "imports", "weight load"]
    assert rows[0][0] == timeline.PROCESS_START and rows[0][0] <= rows[1][0] <= rows[2][0] <= time.monotonic()
    for at, phase, detail in rows[1:]:  # into another timeline: the same seconds since that process's start
        timeline.mark(f"rank 0 {phase}", detail, at=at)
    by_phase = {p: t for p, t, _ in timeline.marks()}
    assert by_phase["rank 0 weight load"] == by_phase["weight load"]
