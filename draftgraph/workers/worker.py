"""One rank's process: join the process group, build this rank's engine, then run the driver's calls on it
until told to stop. Every rank runs the same scheduler on the same requests (SPMD), so all ranks take the same
steps and replay the same graphs."""

from __future__ import annotations

import os
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from draftgraph.compiler.config import CompileConfig
from draftgraph.ops.collectives.op import ParallelGroup, register_group
from draftgraph.workers.sources import SourceRef, open_sources


@dataclass(frozen=True)
class RankSpec:
    """What every rank is started with (pickled by spawn)."""

    world_size: int
    init_method: str  # "file://..." (a file in the driver's temporary directory)
    device_type: str  # "cuda" (rank r on cuda:r, NCCL) or "cpu" (gloo)
    target: SourceRef
    drafter: SourceRef | None
    config: CompileConfig
    artifacts: str | None
    strict_artifacts: bool
    timeout_s: float = 600.0  # a collective waiting longer than this raises (a peer died or hung)


def build_rank_engine(
    target: Any,
    drafter: Any,
    config: CompileConfig,
    rank: int,
    world_size: int,
    group_name: str,
    artifacts: str | None = None,
    strict_artifacts: bool = False,
):
    """This rank's engine: compile_model's one-device path with this rank's tensor-parallel group, so each
    rank loads its share of the target (and of the drafter when draft_tensor_parallel_size > 1)."""
    from draftgraph.api import build_engine

    tp = ParallelGroup(rank, world_size, group_name)
    return build_engine(target, drafter, config, artifacts, strict_artifacts, tokenizer=False, tp=tp)


def _step(engine) -> tuple[list, list]:
    done = engine.step()
    return done, list(engine.last_step_tokens)


# The calls a driver may make: name -> what the rank runs.
COMMANDS = {
    "add_request": lambda e, prompt, params: e.add_request(prompt, params),
    "check_request": lambda e, prompt, params: e.check_request(prompt, params),
    "step": _step,
    "has_unfinished": lambda e: e.has_unfinished(),
    "generate": lambda e, prompts, sampling, arrival_steps: e.generate(prompts, sampling, arrival_steps),
    "stats": lambda e: e.stats(),
    "reset_stats": lambda e: e.reset_stats(),
}


def _exit_with_parent(poll_s: float = 0.5) -> None:
    """A daemon thread: end this process when the driver's process is gone (even mid-collective)."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch():
        while parent.is_alive():
            time.sleep(poll_s)
        os._exit(3)

    threading.Thread(target=watch, name="draftgraph-parent-watch", daemon=True).start()


def worker_main(rank: int, spec: RankSpec, conn) -> None:
    """The process's entry point (spawned by driver.start_workers)."""
    import torch.distributed as dist

    _exit_with_parent()
    try:
        if spec.device_type == "cuda":
            torch.cuda.set_device(rank)
        else:  # the ranks share the CPU's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
        dist.init_process_group(
            "nccl" if spec.device_type == "cuda" else "gloo",
            init_method=spec.init_method,
            rank=rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=spec.timeout_s),
        )
        group = dist.new_group(list(range(spec.world_size)))  # the TP group (all ranks, while there is no DP)
        register_group(group.group_name, group)  # what the collective ops find by name
        target, drafter = open_sources(spec.target, spec.drafter)
        engine = build_rank_engine(
            target, drafter, spec.config, rank, spec.world_size, group.group_name, spec.artifacts, spec.strict_artifacts
        )
        conn.send(
            (
                "ok",
                {
                    "config": engine.config,
                    "k": engine.k,
                    "warm_up_report": engine.warm_up_report,
                    "vocab_size": engine.target.cfg.vocab_size,
                    "eos_token_ids": engine.eos_token_ids,
                },
            )
        )
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the driver, named
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # the driver closed its end
                return
            if msg is None:
                return
            name, args = msg
            try:
                conn.send(("ok", COMMANDS[name](engine, *args)))
            except Exception as e:  # noqa: BLE001
                conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
