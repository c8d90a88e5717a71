"""The GPU tier's side references (tests/gpu/side_process.py): a function run in a process of its own gives
the value it gives in the test's process, and a failing one reports its error and output."""

import pytest

from tests.gpu import side_process


def reference() -> dict:
    import random  # (no torch: the side process starts niced beside busy pytest workers, and torch's import took
    # 20 s there on CI's two cores)

    rng = random.Random(3)
    return {"tokens": [[rng.randrange(96) for _ in range(5)] for _ in range(4)]}


def broken() -> dict:
    print("about to fail")
    raise ValueError("no such request: 7")


def test_side_run_returns_what_the_function_returns():
    runs = side_process.start([side_process.qualname(reference), side_process.qualname(reference)])
    assert list(runs) == ["tests.test_side_process:reference"]  # one process per distinct reference
    run = runs["tests.test_side_process:reference"]
    assert run.result(timeout=120) == reference()
    assert run.proc.pid != 0 and run.wall_s is not None and run.wall_s > 0


def test_side_run_failure_names_the_error():
    run = side_process.start([side_process.qualname(broken)])["tests.test_side_process:broken"]
    with pytest.raises(RuntimeError, match=r"(?s)broken exited with 1.*about to fail.*no such request: 7"):
        run.result(timeout=120)


def test_usage_error_without_a_function():
    assert side_process.main(["nocolon", "out.json"]) == 2
