"""Ranks of a torchrun launch for the benchmark scripts (bench_8b.py, bench_tp.py): which rank this process is,
printing from rank 0 only, and joining the process group once, before any engine is built (compile_model then
uses it and leaves it up). Each rank builds its own engine (LaunchedEngine.engine) and the ranks step it in
lock-step (SPMD), so no driver round trip is timed. Without torchrun: one rank, no process group."""

from __future__ import annotations

import os

import torch


def rank_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) of a torchrun launch, or (0, 1, 0)."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_RANK", 0))


def say(*args) -> None:
    """print on rank 0 only (flushed)."""
    if rank_env()[0] == 0:
        print(*args, flush=True)


def join_ranks() -> torch.device:
    """This rank's device (cuda:LOCAL_RANK, or the CPU without CUDA), made current; at a world size above 1 the
    default process group joined (NCCL on CUDA, gloo on the CPU)."""
    _, world, local = rank_env()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    return device


def inner_engine(engine):
    """A launched rank's own Engine (the ranks step it together), or `engine` itself at one rank."""
    return getattr(engine, "engine", engine)
