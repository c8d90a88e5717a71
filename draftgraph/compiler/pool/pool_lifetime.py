"""When a compile pool (compile_pool.py) starts, which engine build takes it, and when it ends.

By default an engine build starts its own pool when the build begins and closes it when its compile phase
ends (before KV-cache sizing measures the device: a worker holds a CUDA context). Two ways start one earlier:
`prestart` (the `draftgraph` command, before it imports torch: the next build takes it when its settings
match) and `shared_workers` (a block within which every matching build takes one running pool and leaves it
running: a process that builds several engines pays the workers' start once, and compiles each piece once:
`shared_pieces`).
"""

from __future__ import annotations

import contextlib
import logging
import os

from draftgraph.compiler.pool.compile_pool import CompilePool

log = logging.getLogger("draftgraph")


def auto_workers(device_type: str, local_ranks: int = 1) -> int:
    """Worker processes when `CompileConfig.compile_workers` is None: on CUDA half the cores (at most 8),
    shared by the ranks of this machine; on the CPU none (Inductor's C++ compiles use the cores already)."""
    if device_type != "cuda":
        return 0
    return max(1, min(8, (os.cpu_count() or 2) // 2 // max(1, local_ranks)))


def _indexed(device):
    """A CUDA device with its index (the current one when none is given): what workers and pools compare."""
    if device.type == "cuda" and device.index is None:
        import torch

        return torch.device("cuda", torch.cuda.current_device())
    return device


_prestarted: list[CompilePool] = []  # a pool started before the engine build knew its settings (prestart)


def prestart(workers: int, device: str, cache_dir: str = "") -> CompilePool:
    """Start a pool now, for the next engine build in this process to take (`start_pool`): the `draftgraph`
    command calls this before it imports torch, so that the workers' parent imports torch and Inductor
    beside it, not seconds later. Its workers are held (no CUDA start, no prewarm compile) until `release()`:
    the command releases them once it has imported torch, a build that takes the pool at the latest. A build
    whose settings differ closes it and starts its own; one that builds no pool (artifacts, mode NONE) closes it
    too, and so does the exit of this process."""
    discard_prestarted()
    pool = CompilePool(workers, device, progress=True, cache_dir=cache_dir, modules=(), held=True)
    _prestarted.append(pool)
    import atexit

    atexit.register(discard_prestarted)
    return pool


def discard_prestarted() -> None:
    """Close a prestarted pool no engine took."""
    while _prestarted:
        _prestarted.pop().close()


_shared: list[CompilePool] = []  # the pools of open `shared_workers` blocks, innermost last
# per shared pool: compiled pieces of the builds that took it, by scope (compile settings) and piece key
_shared_pieces: dict[CompilePool, dict] = {}


@contextlib.contextmanager
def shared_workers(workers: int | None = None, device: str = "cuda"):
    """Within this block, every engine build that compiles with `workers` workers on `device` (the automatic
    count when None, as CompileConfig.compile_workers=None gives) takes one pool, started on entry, and leaves
    it running for the next build: a process that builds several engines (a sweep, a test suite) pays the
    workers' start (seconds: torch, Inductor, CUDA) once, and a piece one build compiled is not compiled (nor
    waited for) again by the next (`shared_pieces`). Builds with
    other settings start pools of their own, as outside the block. Yields the pool (None when no worker is
    wanted: 0 workers, or the automatic count on the CPU). While it runs, each worker holds a CUDA context
    (about 0.5 GiB), which KV-cache sizing from free memory then leaves aside."""
    import torch

    dev = _indexed(torch.device(device))
    n = auto_workers(dev.type) if workers is None else workers
    if n < 1:
        yield None
        return
    pool = CompilePool(n, str(dev), progress=True)
    _shared.append(pool)
    _shared_pieces[pool] = {}
    try:
        yield pool
    finally:
        _shared.remove(pool)
        _shared_pieces.pop(pool, None)
        pool.close()


def shared_pieces(pool: CompilePool | None, scope: tuple) -> dict | None:
    """The compiled pieces that earlier builds taking `pool` published under `scope` (the settings compiled
    code depends on beyond the graph: backend, Inductor options, compile sizes, device), by piece key
    (piecewise.engine_key: the structural key, the ranges of its symbols, its constants); a build adds its own
    once its compiles are loaded (build.CompiledModels.finish_compiles). None when `pool` is not a
    `shared_workers` pool: outside such a block every build compiles its own pieces (Inductor's cache on disk
    still applies)."""
    store = _shared_pieces.get(pool) if pool is not None else None
    return None if store is None else store.setdefault(scope, {})


def release(pool: CompilePool) -> None:
    """A build is done with its pool: a shared one stays running (what the build left queued is dropped),
    any other is closed."""
    if pool in _shared and pool.usable():
        pool.drop_queued()
        return
    pool.close()


def start_pool(rc, cache_dir: str = "", progress: bool = True, wanted: bool = True) -> CompilePool | None:
    """The engine's compile pool: a shared one (`shared_workers`) or the prestarted one when its settings
    match, else one started now; None when `rc.compile_workers` is 0 or the build compiles nothing (`wanted`
    False: it loads artifacts)."""
    if not wanted or not rc.compile_workers:
        discard_prestarted()
        return None
    device = _indexed(rc.device)
    settings = (rc.compile_workers, str(device), cache_dir)
    for pool in reversed(_shared):
        if (pool.n, pool.device, pool.cache_dir) == settings and pool.usable():
            pool.begin(progress)
            log.info("took the %d shared compile workers (shared_workers)", pool.n)
            return pool
    if _prestarted:
        pool = _prestarted.pop()
        if (pool.n, pool.device, pool.cache_dir) == settings and pool.usable():
            pool.begin(progress)
            log.info("took the %d compile workers started %.1f s ago (compile_workers)", pool.n, pool.taken_s)
            return pool
        log.info("closing the prestarted compile workers (%d on %s): the build wants others", pool.n, pool.device)
        pool.close()
    pool = CompilePool(rc.compile_workers, str(device), progress, cache_dir)
    log.info("started %d compile worker processes (compile_workers)", rc.compile_workers)
    return pool
