"""One rank's process: join the process group, build this rank's engine, then run the driver's calls on it
until told to stop. Rank r is tensor-parallel rank r % tp of data-parallel replica r // tp. The ranks of a
replica run the same scheduler on the same requests (SPMD), so they take the same steps and replay the same
graphs; replicas have their own requests. With expert parallelism every rank is an expert-parallel rank (EP =
tp x dp, models/parallel/experts.py): a replica's TP ranks split its experts, and with several replicas each TP
rank gathers the tokens of its peers in the others, so the replicas' steps agree on one shape (runtime/lockstep.py)."""

from __future__ import annotations

import gc
import os
import threading
import time
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import torch

from draftgraph import timeline
from draftgraph.build.engine import build_engine
from draftgraph.build.request import BuildRequest
from draftgraph.compiler.config import CompileConfig
from draftgraph.ops.collectives.op import ExpertGroups, ParallelGroup, register_group
from draftgraph.ops.collectives.peer import PeerAllReduce, peer_for, register_peer
from draftgraph.workers.process_end import exit_now, run_exit_handlers
from draftgraph.workers.sources import open_sources


@dataclass(frozen=True)
class RankSpec:
    """What every rank is started with (pickled to the fork server's child, driver.start_workers)."""

    world_size: int  # data_parallel_size x tensor_parallel_size
    init_method: str  # "file://..." (a file in the driver's temporary directory)
    device_type: str  # "cuda" (rank r on cuda:r, NCCL) or "cpu" (gloo)
    # The build request, its target and drafter as SourceRefs (sources.py) and no tokenizer (the driver's)
    request: BuildRequest
    timeout_s: float = 600.0  # a collective waiting longer than this raises (a peer died or hung)
    env: tuple[tuple[str, str], ...] = ()  # the driver's environment when it started the ranks


@dataclass(frozen=True)
class RankGroups:
    """This rank's groups: tensor-parallel (within its replica), expert-parallel (None without expert
    parallelism) and the lock-step's CPU group (across replicas; "" where there is none)."""

    tp: ParallelGroup
    ep: ExpertGroups | None = None
    lockstep: str = ""


def make_groups(rank: int, world_size: int, config: CompileConfig) -> RankGroups:
    """Create (every rank, every group, in one order, as torch.distributed requires) and register the groups; on
    CUDA with all_reduce "auto", set the tensor-parallel group up for peer-memory all-reduces where its ranks
    reach each other's memory (ops/collectives/peer.py; refused with a logged reason otherwise: NCCL)."""
    import torch.distributed as dist

    tp_size = config.tensor_parallel_size
    tp = replicas = ParallelGroup.single()
    tp_group = None
    for first in range(0, world_size, tp_size):  # replica first // tp_size
        ranks = list(range(first, first + tp_size))
        group = dist.new_group(ranks) if tp_size > 1 else None
        if group is not None and rank in ranks:
            register_group(group.group_name, group)  # what the collective ops find by name
            tp, tp_group = ParallelGroup(rank - first, tp_size, group.group_name), group
    if tp_group is not None and config.all_reduce == "auto" and _on_cuda(config):
        peer = PeerAllReduce.setup(tp_group, tp.rank, torch.cuda.current_device())  # collective over the group
        if peer is not None:
            register_peer(tp.group_name, peer)
    if not config.expert_parallel:
        return RankGroups(tp)
    dp = world_size // tp_size
    lockstep = ""
    if dp > 1:  # expert parallelism across replicas: each tp rank's peers in the others, and the lock-step
        for t in range(tp_size):
            ranks = list(range(t, world_size, tp_size))
            group = dist.new_group(ranks)
            if rank in ranks:
                register_group(group.group_name, group)
                replicas = ParallelGroup(rank // tp_size, dp, group.group_name)
        counts = dist.new_group(list(range(world_size)), backend="gloo")  # step counts: host values, no device
        register_group(counts.group_name, counts)
        lockstep = counts.group_name
    return RankGroups(tp, ExpertGroups(replicas, tp), lockstep)


def _on_cuda(config: CompileConfig) -> bool:
    return config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())


def build_rank_engine(request: BuildRequest, groups: RankGroups):
    """This rank's engine: the one-device build (build/engine.py) with this rank's groups, so each rank loads
    its share of the target (and of the drafter when draft_tensor_parallel_size > 1) and of its experts; with
    expert parallelism across replicas, its steps in lock-step with theirs (runtime/lockstep.py). Ranks see
    token ids only: the driver, or each launched rank's LaunchedEngine, holds the tokenizer."""
    return build_engine(replace(request, tokenizer=False), groups.tp, groups.ep, groups.lockstep)


def _step(engine) -> tuple[list, list, dict]:
    done = engine.step()  # a step with nothing scheduled here emits nothing: last_step_tokens starts empty
    return done, list(engine.last_step_tokens), dict(engine.last_step_logprobs)


def _generate(engine, prompts, sampling, arrival_steps):
    if engine.lockstep is not None:
        engine.lockstep.reset()
    outputs = engine.generate(prompts, sampling, arrival_steps)
    if engine.lockstep is not None:  # keep stepping with the others until every rank is done
        engine.lockstep.drain()
    return outputs


def _stats(engine) -> dict:
    """The rank's engine stats, its dummy steps (lock-step) and, where its tensor-parallel group sums small
    messages over peer memory, the all-reduces by kernel (eager calls and captures; replays run no Python)."""
    dummy = engine.lockstep.dummy_steps if engine.lockstep is not None else 0
    peer = peer_for(engine.target.tp.group_name) if not engine.target.tp.is_single else None
    return {**engine.stats(), "dummy_steps": dummy, "peer_all_reduce": dict(peer.calls) if peer else None}


def _reset_stats(engine) -> None:
    engine.reset_stats()
    if engine.lockstep is not None:
        engine.lockstep.reset()


def _occupancy(engine) -> dict:
    sched = engine.scheduler
    return {"running": len(sched.running), "waiting": len(sched.waiting), "kv_free": engine.num_free_kv_blocks,
            "kv_total": engine.config.num_kv_blocks}  # fmt: skip


def _write_artifacts(engine, out: str) -> dict:
    """This rank's compiled code into out/rank-R (artifacts/ranks.py), as `draftgraph build` lays ranks out: the
    start-up cache of `generate` at several ranks (cli/artifact_cache.py). Returns the rank's manifest."""
    from draftgraph.artifacts.ranks import rank_dir, this_rank
    from draftgraph.artifacts.store import build_artifacts

    return build_artifacts(engine, rank_dir(out, this_rank(engine.config)), progress=False)


# The calls a driver may make: name -> what the rank runs.
COMMANDS = {
    "add_request": lambda e, prompt, params: e.add_request(prompt, params),
    "check_request": lambda e, prompt, params: e.check_request(prompt, params),
    "abort": lambda e, request_id: e.abort(request_id),
    "occupancy": _occupancy,
    "step": _step,
    "has_unfinished": lambda e: e.has_unfinished(),
    "generate": _generate,
    "stats": _stats,
    "reset_stats": _reset_stats,
    "write_artifacts": _write_artifacts,
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


def _build_config(config: CompileConfig, out: str, rank: int) -> CompileConfig:
    """The config rank `rank` compiles with when it writes artifacts into `out`: on the CPU, Inductor's cache
    (the built libraries a CPU artifact carries) inside `out`; on CUDA, a cache directory of its own."""
    from draftgraph.artifacts.store import CACHE

    if not _on_cuda(config):
        return replace(config, cache_dir=os.path.join(out, CACHE))
    return replace(config, cache_dir=os.path.join(config.cache_dir, f"rank-{rank}") if config.cache_dir else "")


def setup_rank(rank: int, world_size: int, request: BuildRequest):
    """In a rank whose default process group is up: its groups and its engine, and what it reports once ready
    (the driver's `rank_info`). Artifacts of several ranks are per rank (artifacts/ranks.py): rank r
    loads request.artifacts/rank-r and, given `request.build_dir`, writes build_dir/rank-r (its manifest in
    the report)."""
    from draftgraph.artifacts.ranks import rank_dir

    artifacts, build_dir, config = request.artifacts, request.build_dir, request.config
    if artifacts is not None and world_size > 1:
        artifacts = rank_dir(artifacts, rank)
    if build_dir is not None:
        build_dir = rank_dir(build_dir, rank) if world_size > 1 else build_dir
        config = _build_config(config, build_dir, rank)
    request = replace(request, config=config, artifacts=artifacts, build_dir=build_dir)
    groups = make_groups(rank, world_size, config)
    timeline.mark("groups")
    engine = build_rank_engine(request, groups)
    timeline.mark("engine ready")
    info = {
        "timeline": timeline.raw(),  # this rank's start-up, for the driver's timeline (rank 0's)
        "rank": rank,
        "config": engine.config,
        "k": engine.k,
        "warm_up_report": engine.warm_up_report,
        "vocab_size": engine.target.cfg.vocab_size,
        "eos_token_ids": engine.eos_token_ids,
        "compile": engine.compiled.counters.as_dict() if engine.compiled is not None else None,
    }
    if build_dir is not None:
        from draftgraph.artifacts.store import build_artifacts

        info["manifest"] = build_artifacts(engine, build_dir, progress=False)
    return engine, info


def run_command(engine, name: str, args: tuple) -> tuple[str, Any]:
    """("ok", what the driver's call `name(*args)` returns here), or ("error", the exception and traceback)."""
    try:
        return "ok", COMMANDS[name](engine, *args)
    except Exception as e:  # noqa: BLE001 - every failure goes back to the driver, named
        return "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"


def freeze_rank() -> str:
    """A rank process (ours: spawned or forked for an engine) keeps its imports, and once built its engine, as long as
    it lives: they are moved out of the garbage collector's sight (gc.freeze), as the command's own process does
    (cli/commands.py), so that the full collections of its start (KV sizing's, ~0.17 s each over torch's imports on a
    GPU host) and the automatic ones while it steps walk only what is new. Returns the count, for the timeline."""
    gc.freeze()
    return f"{gc.get_freeze_count()} objects frozen out of the collector's sight"


def worker_main(rank: int, spec: RankSpec, conn, spawned: bool | None = None) -> None:
    """The process's entry point (forked by the fork server for driver.start_workers on the CPU, spawned on GPUs and
    by prestart.py: `spawned`, default: on GPUs)."""
    import torch.distributed as dist

    if spec.env:  # the driver's environment now, not the fork server's from when it started
        os.environ.clear()
        os.environ.update(spec.env)
    frozen = freeze_rank()  # (a held rank froze its imports already: this adds what came since)
    timeline.mark_once("imports", frozen)  # (a spawned rank: its interpreter's start, torch's and draftgraph's imports)
    _exit_with_parent()
    try:
        if spec.device_type == "cuda":
            torch.cuda.set_device(rank)
        # The ranks share the host's cores: each its share of torch's threads (a GPU rank's host copies too, its
        # weights into pinned buffers: models/mapped_read.py), not every rank all of them, spinning on each other's.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
        dist.init_process_group(
            "nccl" if spec.device_type == "cuda" else "gloo",
            init_method=spec.init_method,
            rank=rank,
            world_size=spec.world_size,
            timeout=timedelta(seconds=spec.timeout_s),
        )
        timeline.mark("process group")
        target, drafter = open_sources(spec.request.target, spec.request.drafter)
        engine, info = setup_rank(rank, spec.world_size, replace(spec.request, target=target, drafter=drafter))
        freeze_rank()  # the engine lives as long as the rank
        conn.send(("ok", info))
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the driver, named
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the driver closed its end
            break
        if msg is None:
            break
        conn.send(run_command(engine, *msg))
    conn.close()
    if spawned is None:
        spawned = spec.device_type == "cuda"
    if spawned:
        # A spawned rank told to stop (or whose driver is gone): its exit handlers (compile pool, private caches),
        # then the process ends without the interpreter's teardown or the process group's: NCCL's and Inductor's
        # shutdowns took the driver's close 21 s at TP 2 (H200), which nobody waits for (the driver stops every
        # rank at once). A forked CPU rank returns: multiprocessing ends it without the exit handlers it inherited.
        run_exit_handlers()
        exit_now(0)
    if dist.is_initialized():
        dist.destroy_process_group()
