"""The driver: start one worker process per rank (data_parallel_size replicas of tensor_parallel_size ranks),
send each call to the ranks it concerns through a pipe, and answer for them all (ranked.py: the Engine's API
over ranks, the same for ranks a launcher such as torchrun started, launched.py).

A rank that raises, or whose process dies, ends every rank: the driver raises `WorkerError` naming the rank
and its exception or exit code, and terminates the others (which may be waiting in a collective)."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
import weakref
from dataclasses import replace
from multiprocessing.connection import wait
from typing import Any

import torch

from draftgraph import timeline
from draftgraph.build.preflight import check_checkpoints
from draftgraph.build.request import BuildRequest
from draftgraph.compiler.config import CompileConfig
from draftgraph.runtime.text import resolve_tokenizer
from draftgraph.workers import prestart
from draftgraph.workers.ranked import RankedEngine, WorkerError
from draftgraph.workers.sources import portable_sources
from draftgraph.workers.worker import RankSpec, worker_main

__all__ = ["ParallelEngine", "WorkerError", "start_workers"]

PEER_EXIT_WAIT_S = 2.0  # how long a rank's error waits for a peer's exit to show, which would be the cause


def _device_type(config: CompileConfig, world_size: int) -> str:
    cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if not cuda:
        return "cpu"
    found = torch.cuda.device_count()
    if found < world_size:
        raise ValueError(
            f"tensor_parallel_size={config.tensor_parallel_size} x data_parallel_size={config.data_parallel_size} "
            f"needs {world_size} CUDA devices (one per rank), but {found} are visible; lower them to at most "
            f"{found} ranks in all or use device='cpu'"
        )
    return "cuda"


def start_workers(request: BuildRequest) -> ParallelEngine:
    """Start tensor_parallel_size x data_parallel_size ranks, each building its engine; return once all are ready
    (or raise WorkerError naming the first rank that failed). With `request.build_dir`, each rank writes its
    artifacts into build_dir/rank-R once built (worker.setup_rank).

    CPU ranks are forked from multiprocessing's fork server, which imported the worker's modules (torch,
    draftgraph: about 3 s of a core) once, when this process first started ranks: later engines' ranks start
    without importing, and ranks beyond the core count do not import in turn. CUDA ranks are spawned. Each rank
    applies this process's environment as it is now (RankSpec.env): the fork server's is the one it started with."""
    import torch.multiprocessing as mp

    config = request.config
    world = config.tensor_parallel_size * config.data_parallel_size
    device_type = _device_type(config, world)
    tok = resolve_tokenizer(request.tokenizer, request.target)  # the driver encodes and decodes text; ranks see ids
    check_checkpoints(request.target, request.drafter)
    tmp = tempfile.TemporaryDirectory(prefix="draftgraph-workers-")
    target_ref, drafter_ref = portable_sources(request.target, request.drafter, tmp.name)
    portable = replace(request, target=target_ref, drafter=drafter_ref, tokenizer=False)
    spec = RankSpec(world, f"file://{tmp.name}/init", device_type, portable, env=tuple(os.environ.items()))
    # CPU ranks (gloo) fork from the fork server. CUDA ranks are spawned: a process forked from one that has
    # initialised the CUDA driver cannot use CUDA, and nothing yet checks on a GPU machine that no module the server
    # imports does (a GPU host's cores import the ranks' modules side by side anyway).
    ctx = mp.get_context("forkserver" if device_type == "cpu" else "spawn")
    if device_type == "cpu":
        ctx.set_forkserver_preload(["draftgraph.workers.worker"])  # only read when the server starts
    procs, conns, started = [], [], time.monotonic()
    held = prestart.take(world)  # ranks the command spawned before its imports (prestart.py)
    if held is not None:
        procs, conns, started = held.procs, held.conns, 0.0
        for conn in conns:
            conn.send(spec)
    for rank in range(len(procs), world):
        proc, conn = prestart.start_rank(ctx, rank, worker_main, spec)
        procs.append(proc)
        conns.append(conn)
    return ParallelEngine(procs, conns, tmp, tok, config.tensor_parallel_size, started)


def _shutdown(procs, conns, tmp, grace_s: float = 10.0) -> None:
    """Ask every rank to stop, then terminate (and kill) what is left; remove the temporary directory."""
    for conn in conns:
        with contextlib.suppress(OSError, ValueError):  # already closed or broken
            conn.send(None)
    # The ranks stop side by side: one deadline for all of them, then for the terminated ones
    _join_by(procs, time.monotonic() + grace_s)
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    _join_by(procs, time.monotonic() + 5)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
    tmp.cleanup()


def _join_by(procs, deadline: float) -> None:
    """Join every process that is still running, by `deadline` (a time.monotonic() reading) at the latest."""
    for proc in procs:
        if proc.exitcode is None:
            proc.join(max(0.0, deadline - time.monotonic()))


class ParallelEngine(RankedEngine):
    """The Engine's API over worker processes this engine started (ranked.py): each call goes to the ranks
    it concerns through their pipes; a rank that fails or dies stops them all (WorkerError)."""

    def __init__(self, procs, conns, tmp, tokenizer, tensor_parallel_size: int = 1, started: float | None = None):
        self.procs, self._conns = procs, conns
        self._closed = False
        # Runs at close(), when the driver is collected, or at interpreter exit (before multiprocessing joins).
        self._finalizer = weakref.finalize(self, _shutdown, procs, conns, tmp)
        self.world_size = len(procs)
        infos = self._gather("ready", range(self.world_size))
        if started is not None:  # rank 0's start-up into this process's timeline, from when the ranks started
            for at, phase, detail in infos[0].get("timeline", ()):
                if at >= started:  # (a forked CPU rank's "process started" is its fork server's)
                    timeline.mark(f"rank 0 {phase}", detail, at=at)
        self._setup(len(procs), tensor_parallel_size, tokenizer, [infos[r] for r in range(len(procs))])

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _call_each(self, name: str, args: dict[int, tuple]) -> dict[int, Any]:
        """`name(*args[rank])` on each rank given; their answers by rank."""
        if self._closed:
            raise RuntimeError(f"this engine is closed; {name}() needs a new compile_model(...)")
        for rank, a in args.items():
            try:
                self._conns[rank].send((name, a))
            except (OSError, ValueError):
                break  # that rank is gone: _gather names it
        return self._gather(name, args)

    def _gather(self, what: str, ranks) -> dict[int, Any]:
        """The answers of `ranks` to the last call, or WorkerError at the first rank that raised or died (any
        rank: the others may wait for it in a collective)."""
        results: dict[int, Any] = {}
        waiting = {self._conns[rank]: rank for rank in ranks}
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        while waiting:
            for ready in wait([*waiting, *sentinels]):
                if ready in waiting:
                    rank = waiting.pop(ready)
                    try:
                        status, value = ready.recv()
                    except (EOFError, OSError):
                        self._fail(rank, what, None)
                    if status == "error":
                        self._fail(rank, what, value)
                    results[rank] = value
                elif ready in sentinels:
                    rank = sentinels[ready]
                    if rank in waiting.values() and self._conns[rank].poll():
                        continue  # it answered before it exited: read that first
                    if rank not in results:
                        self._fail(rank, what, None)
        return results

    def _fail(self, rank: int, what: str, error: str | None) -> None:
        if error is not None:  # a peer that died makes the others' collectives raise: name the dead one first
            peers = {r: p for r, p in enumerate(self.procs) if r != rank}
            # A rank's exit code comes from the fork server once it has reaped it, a moment after the peer's
            # collective saw the connection drop: wait that moment (a failure path only) before blaming `rank`.
            running = [p.sentinel for p in peers.values() if p.exitcode is None]
            if running and len(running) == len(peers):
                wait(running, timeout=PEER_EXIT_WAIT_S)
            # (exit code 0: a peer that reported its own error and returned, not a cause)
            dead = [r for r, p in peers.items() if p.exitcode not in (None, 0)]
            if dead:
                error, rank = None, dead[0]
        proc = self.procs[rank]
        proc.join(1)
        why = error.rstrip() if error else f"its process exited with code {proc.exitcode}"
        self.close(grace_s=0.5)  # the others may wait in a collective for the failed rank: do not wait long
        raise WorkerError(f"worker rank {rank} of {self.world_size} failed during {what}: {why}")

    def close(self, grace_s: float = 10.0) -> None:
        """Stop every rank: each finishes its call and exits, or is terminated after `grace_s` (idempotent)."""
        self._closed = True
        found = self._finalizer.detach()
        if found is not None:
            _, func, args, _ = found
            func(*args, grace_s=grace_s)
