"""GPU tier options. `pytest tests/gpu --compile-workers N`: every engine whose config leaves compile_workers
unset gets N compile worker processes instead of the automatic count, so that the tier can be timed with and
without the pool (scripts/gpu_tier.sh: W=N). Those engines share one pool for the whole session
(`draftgraph.shared_compile_workers`): the workers start once, at pytest_configure (before collection), not once
per engine. Tests marked `side_reference` have their eager reference runs started in processes of their own once
the tests are collected (tests/gpu/side_process.py)."""

import contextlib
import os
import time

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--compile-workers", type=int, default=None, help="compile workers for engines that leave it unset (0: none)"
    )


@pytest.fixture(autouse=True)
def _compile_workers(request, monkeypatch):
    n = request.config.getoption("--compile-workers", default=None)  # unknown when tests/ is the root given
    if n is not None:
        from draftgraph.compiler.pool import pool_lifetime

        monkeypatch.setattr(pool_lifetime, "auto_workers", lambda device_type, local_ranks=1: n)


_SESSION = contextlib.ExitStack()  # the session's compile pool, from pytest_configure to pytest_unconfigure
_POOL: list = []  # [the pool or None] once started


def _start_shared_pool(config) -> None:
    n = config.getoption("--compile-workers", default=None)
    if n == 0:
        _POOL.append(None)
        return
    import draftgraph as dg

    _POOL.append(_SESSION.enter_context(dg.shared_compile_workers(n)))


def pytest_configure(config):
    """The session's compile workers start before the tests are collected (their start, seconds of importing
    torch and Inductor, overlaps the collection instead of the first test's wait). Not in an xdist controller,
    which runs no test, nor for --collect-only."""
    controller = config.getoption("numprocesses", default=None) and not os.environ.get("PYTEST_XDIST_WORKER")
    if not controller and not config.option.collectonly:
        _start_shared_pool(config)


@pytest.fixture(scope="session", autouse=True)
def _shared_compile_workers(request):
    if not _POOL:
        _start_shared_pool(request.config)
    yield _POOL[0]


@pytest.fixture(scope="session", autouse=True)
def _fixed_speculation():
    """The tier's engines keep K fixed unless a test asks for speculation="adaptive" (tests/gpu/test_adaptive_cuda.py):
    their structural counts (graphs captured, replays by key, drafts verified) are derived for a fixed K, and the
    default, "auto", is adaptive where CUDA graphs time the steps. "auto" resolves as where nothing is measured."""
    from draftgraph.compiler import config

    resolve = config.resolve_speculation
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(config, "resolve_speculation", lambda cfg, k, measured=False: resolve(cfg, k, measured=False))
        yield


_SIDE_RUNS: dict = {}  # reference name -> tests.gpu.side_process.SideRun, started once the tests are collected


def pytest_collection_modifyitems(config, items):
    """Tests that read the device's free memory (`whole_device`) run last, when the session's compile workers
    are long up and idle (`settled_device` still waits for them). The selected tests' side references
    (tests/gpu/side_process.py) start now, in processes beside this one."""
    items.sort(key=lambda item: item.get_closest_marker("whole_device") is not None)  # stable: order kept
    if os.environ.get("PYTEST_XDIST_WORKER") or os.environ.get("DRAFTGRAPH_SIDE_REFERENCES", "1") == "0":
        return  # each xdist worker collects every test but runs a share: references run in the test instead
    from tests.gpu import side_process

    names = [side_process.qualname(m.args[0]) for item in items for m in item.iter_markers("side_reference")]
    if names:
        _SIDE_RUNS.update(side_process.start(names))


def pytest_unconfigure(config):
    for run in _SIDE_RUNS.values():
        run.stop()
    _SESSION.close()


@pytest.fixture(scope="session")
def side_reference():
    """`side_reference(fn)`: what `fn()` returned in its side process (waiting for it), or `fn()` run here
    when no side process runs it (tests/gpu/side_process.py)."""
    from tests.gpu import side_process

    def get(fn):
        run = _SIDE_RUNS.get(side_process.qualname(fn))
        if run is None:
            return fn()
        t0 = time.monotonic()
        data = run.result()
        line = f"{run.wall_s:.1f} s in its own process, the test waited {time.monotonic() - t0:.1f} s for it"
        print(f"side reference {run.name}: {line}")
        if os.environ.get("DRAFTGRAPH_TEST_TIMES") and not run.reported:  # once per reference, not per test
            run.reported = True
            with open(os.environ["DRAFTGRAPH_TEST_TIMES"], "a") as f:
                f.write(f"{run.wall_s:7.1f} s  side     passed  {run.name} ({line})\n")
        return data

    return get


def pytest_runtest_logreport(report):
    """`DRAFTGRAPH_TEST_TIMES=FILE`: each test phase over a second is appended to FILE as it ends (a run
    stopped at its time limit still tells where the time went; --durations prints only at the end)."""
    path = os.environ.get("DRAFTGRAPH_TEST_TIMES")
    if getattr(report, "node", None) is not None:  # xdist's controller, for a report its worker wrote already
        return
    if path and report.duration >= 1.0:
        with open(path, "a") as f:
            f.write(f"{report.duration:7.1f} s  {report.when:<8} {report.outcome:<7} {report.nodeid}\n")


@pytest.fixture
def settled_device(_shared_compile_workers):
    """For tests that read the device's free memory: the session's compile workers, whose CUDA contexts count
    as memory held outside the engine, are all up (or gone) before the test reads it."""
    for run in _SIDE_RUNS.values():  # a side reference's CUDA context is memory held outside the engine too
        run.wait()
    pool = _shared_compile_workers
    deadline = time.monotonic() + 180
    while pool is not None and time.monotonic() < deadline:
        up = [w for w in pool.workers if w.ready_s is not None or not w.alive()]
        if len(up) == pool.n or not pool.accepting and len(up) == len(pool.workers):
            break
        time.sleep(0.2)
    yield


@pytest.fixture(scope="session", autouse=True)
def _sample_profile():
    """`DRAFTGRAPH_SAMPLE_PROFILE=FILE`: a wall-clock sampling profile of the whole session's main thread
    (scripts/sample_profile.py; where the tier's time goes, by draftgraph and test function), written to FILE."""
    path = os.environ.get("DRAFTGRAPH_SAMPLE_PROFILE")
    if not path:
        yield
        return
    from scripts.sample_profile import PACKAGES, SampleProfiler

    with SampleProfiler(packages=PACKAGES + ("tests/",), inclusive_of=("draftgraph", "tests/"), by_test=True) as prof:
        yield
    with open(path, "w") as f:
        f.write(prof.report(top=120, min_share=0.002) + "\n" + prof.test_report())
