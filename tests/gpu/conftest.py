"""GPU tier options. `pytest tests/gpu --compile-workers N`: every engine whose config leaves compile_workers
unset gets N compile worker processes instead of the automatic count, so that the tier can be timed with and
without the pool (scripts/gpu_next.sh)."""

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--compile-workers", type=int, default=None, help="compile workers for engines that leave it unset (0: none)"
    )


@pytest.fixture(autouse=True)
def _compile_workers(request, monkeypatch):
    n = request.config.getoption("--compile-workers", default=None)  # unknown when tests/ is the root given
    if n is not None:
        from draftgraph.compiler import compile_pool

        monkeypatch.setattr(compile_pool, "auto_workers", lambda device_type, local_ranks=1: n)
