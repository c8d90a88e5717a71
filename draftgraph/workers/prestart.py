"""Worker ranks started before the command imports torch (issue 44: a tensor-parallel start).

`draftgraph generate --tp 2` (and `serve`) spawns its ranks only once it has imported torch and draftgraph and found
its models; each rank then imports them again and makes its CUDA context, seconds on the start's critical path
(2 x H200, the 8B shape, warm: 1.5 s of rank imports, then 1.7 s of CUDA init, after 3.4 s of the command's own
imports). `prestart_ranks(n)` spawns the n rank processes first thing: each imports what a rank runs (torch,
draftgraph's worker) and, on a GPU, makes its device's context, beside the command's imports, then waits for its
`RankSpec`. driver.start_workers takes them (`take`) and sends each its spec; the rank goes on as one it started
itself (worker.worker_main). Held ranks nobody takes (another world size, a failure before the build, the end of
the command) are told to stop (`discard`, also at exit); a held rank whose command is gone sees its pipe close and
ends.

Nothing here imports torch: the command calls it before its imports. A held rank runs the environment of the
command's start; worker_main applies the command's environment at the build (RankSpec.env) as before, but its
device context is made already (CUDA_VISIBLE_DEVICES set in between does not move it).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
from dataclasses import dataclass


@dataclass
class HeldRanks:
    procs: list  # multiprocessing.Process, rank order
    conns: list  # this side of each rank's pipe


_held: list[HeldRanks] = []


def prestart_ranks(world_size: int, cuda: bool) -> None:
    """Spawn `world_size` rank processes now, held until `take` (rank r on cuda:r when `cuda`)."""
    discard()
    ctx = multiprocessing.get_context("spawn")
    procs, conns = [], []
    for rank in range(world_size):
        proc, conn = start_rank(ctx, rank, held_rank, cuda)
        procs.append(proc)
        conns.append(conn)
    _held.append(HeldRanks(procs, conns))
    atexit.register(discard)


def start_rank(ctx, rank: int, target, arg):
    """Start rank `rank`'s process running `target(rank, arg, its end of a pipe)`; returns (process, this end)."""
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=target, args=(rank, arg, theirs), name=f"draftgraph-rank{rank}")
    proc.start()
    theirs.close()
    return proc, ours


def take(world_size: int) -> HeldRanks | None:
    """The held ranks, when there are `world_size` of them and all still run; else None (any held are stopped)."""
    if not _held:
        return None
    held = _held.pop()
    if len(held.procs) == world_size and all(p.is_alive() for p in held.procs):
        return held
    _stop(held)
    return None


def discard() -> None:
    """Stop the ranks held for a build that did not take them (without waiting for them to end)."""
    while _held:
        _stop(_held.pop())


def _stop(held: HeldRanks) -> None:
    """A held rank waiting for its spec ends on the None sent; one still importing is terminated (it holds
    nothing yet): a command that fails before its build does not wait for its ranks' imports."""
    for conn in held.conns:
        with contextlib.suppress(OSError, ValueError):
            conn.send(None)
        conn.close()
    for proc in held.procs:
        proc.join(0.05)
        if proc.is_alive():
            proc.terminate()


def held_rank(rank: int, cuda: bool, conn) -> None:
    """A held rank's process: its imports and device context, then its spec (None: stop), then the rank's work."""
    from draftgraph import timeline
    from draftgraph.workers.worker import freeze_rank, worker_main  # torch and the rank's modules

    timeline.mark("imports", freeze_rank())
    if cuda:
        import torch

        with contextlib.suppress(Exception):  # (worker_main sets the device again and reports what fails)
            torch.cuda.set_device(rank)
            torch.empty(1, device=f"cuda:{rank}")  # the context
            timeline.mark("CUDA init", "held rank, before the build")
    try:
        spec = conn.recv()
    except (EOFError, OSError):  # the command is gone
        os._exit(0)
    if spec is None:
        os._exit(0)
    worker_main(rank, spec, conn, spawned=True)
