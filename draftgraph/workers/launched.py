"""Ranks a launcher started: `torchrun --nproc-per-node N -m draftgraph generate --tp N` or a script calling
compile_model(...) on every rank of a torchrun launch.

torchrun (or anything that sets its environment: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)
starts one process per rank and runs the same program in each. compile_model sees the environment and,
instead of starting worker processes, makes this process rank RANK: it joins the default process group
(env://; NCCL with device cuda:LOCAL_RANK on CUDA, gloo on the CPU; one the program already initialized is
used as it is), creates the same groups as worker processes would (worker.make_groups) and builds this
rank's engine. Every rank must then make the same calls with the same arguments (SPMD), as a program under
torchrun does by nature. Each call runs on the ranks it concerns, then the ranks exchange their answers with
one `all_gather_object` over a gloo group (host values, never the device), so that an error on any rank
raises `WorkerError` naming it on every rank, and every rank returns the same value: outputs, stats and
request ids are those rank 0 sees (the CLI prints on rank 0 only).

A server (`draftgraph serve` under torchrun, over one node or several) is not SPMD: the requests arrive at rank
0 alone. There rank 0 leads (`lead`): it broadcasts each call to the other ranks before making it, and they
follow (`follow`): each receives the call, runs its part and joins the exchange, until rank 0 closes. An idle
server still calls `has_unfinished` twice a second (serve/engine_loop.py), so the followers never wait in the
broadcast for longer than the process group's timeout.
"""

from __future__ import annotations

import logging
import os
import traceback
import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from draftgraph.build.request import BuildRequest
from draftgraph.compiler.config import CompileConfig
from draftgraph.runtime.text import resolve_tokenizer
from draftgraph.workers.ranked import RankedEngine, WorkerError
from draftgraph.workers.worker import run_command, setup_rank

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT")
log = logging.getLogger("draftgraph.workers")
TIMEOUT = timedelta(seconds=600)  # a collective waiting longer than this raises (a peer died or hung)


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in a launch: global rank, number of processes, and rank on its node."""

    rank: int
    world_size: int
    local_rank: int


def launch_env(environ=None) -> LaunchEnv | None:
    """The launch this process belongs to, from torchrun's RANK / WORLD_SIZE / LOCAL_RANK; None when none of
    them is set. Some but not all of them, or values that do not fit together, are refused by name."""
    environ = os.environ if environ is None else environ
    present = [v for v in LAUNCH_VARS if v in environ]
    if not present:
        return None
    missing = [v for v in LAUNCH_VARS if v not in environ]
    if missing:
        raise ValueError(
            f"{', '.join(present)} set in the environment but not {', '.join(missing)}: launch with torchrun (it "
            "sets all of them), or unset them to let draftgraph start its own worker processes"
        )
    try:
        env = LaunchEnv(*(int(environ[v]) for v in LAUNCH_VARS))
    except ValueError as e:
        given = ", ".join(f"{v}={environ[v]!r}" for v in LAUNCH_VARS)
        raise ValueError(f"{given}: each must be an integer, as torchrun sets them") from e
    if not (0 <= env.rank < env.world_size and 0 <= env.local_rank <= env.rank):
        raise ValueError(
            f"RANK={env.rank}, WORLD_SIZE={env.world_size}, LOCAL_RANK={env.local_rank} do not fit together: "
            "RANK must be in [0, WORLD_SIZE) and LOCAL_RANK at most RANK"
        )
    return env


def uses_launch(config: CompileConfig) -> LaunchEnv | None:
    """The launch compile_model joins (None: it runs one process, or starts its own workers). Under a launch
    of several processes, or asked for several ranks under a launch of one, the launch must have exactly
    tensor_parallel_size x data_parallel_size processes."""
    env = launch_env()
    ranks = config.tensor_parallel_size * config.data_parallel_size
    if env is None or (env.world_size == 1 and ranks == 1):
        return None
    if env.world_size != ranks:
        raise ValueError(
            f"launched as {env.world_size} processes (WORLD_SIZE={env.world_size}), but tensor_parallel_size="
            f"{config.tensor_parallel_size} x data_parallel_size={config.data_parallel_size} needs {ranks} ranks: "
            f"launch {ranks} (torchrun --nproc-per-node {ranks}), or set --tp / --dp so that tp x dp = "
            f"{env.world_size}"
        )
    return env


def _join_process_group(env: LaunchEnv, cuda: bool) -> bool:
    """Join the default process group from the environment (True), or check the one already up (False)."""
    import torch.distributed as dist

    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (env.rank, env.world_size):
            raise ValueError(
                f"the process group already initialized is rank {dist.get_rank()} of {dist.get_world_size()}, but "
                f"the environment says RANK={env.rank} of WORLD_SIZE={env.world_size}; initialize it from them "
                "(init_method='env://') or leave it to draftgraph"
            )
        return False
    missing = [v for v in RENDEZVOUS_VARS if v not in os.environ]
    if missing:
        raise ValueError(
            f"{', '.join(missing)} not set: ranks meet at MASTER_ADDR:MASTER_PORT; launch with torchrun, which "
            "sets them"
        )
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method="env://", rank=env.rank, world_size=env.world_size, timeout=TIMEOUT)
    return True


def join_launch(env: LaunchEnv, request: BuildRequest) -> LaunchedEngine:
    """Make this process rank `env.rank` (compile_model under torchrun): join the process group, build this
    rank's engine, and return once every rank is ready (or raise WorkerError naming the first that failed).
    With `request.build_dir`, this rank writes its artifacts into build_dir/rank-R once built
    (worker.setup_rank)."""
    import torch.distributed as dist

    config = request.config
    cuda = config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available())
    if cuda:
        found = torch.cuda.device_count()
        if env.local_rank >= found:
            raise ValueError(
                f"LOCAL_RANK={env.local_rank} runs on cuda:{env.local_rank}, but {found} CUDA devices are visible; "
                f"launch at most {found} processes per node (torchrun --nproc-per-node {found})"
            )
        torch.cuda.set_device(env.local_rank)
    owned = _join_process_group(env, cuda)
    answers = dist.new_group(list(range(env.world_size)), backend="gloo")  # every rank, before any other group
    tok = resolve_tokenizer(request.tokenizer, request.target)  # each rank encodes and decodes alike; engines see ids
    engine = None
    try:
        engine, info = setup_rank(env.rank, env.world_size, request)
        mine = ("ok", info)
    except Exception as e:  # noqa: BLE001 - every rank hears of it, named
        mine = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    return LaunchedEngine(engine, env, answers, owned, tok, config.tensor_parallel_size, mine)


def _leave(owned: bool) -> None:
    import torch.distributed as dist

    if owned and dist.is_initialized():
        dist.destroy_process_group()


class LaunchedEngine(RankedEngine):
    """The Engine's API on one rank of a launch (ranked.py): each call runs here when this rank is concerned,
    then every rank gets every rank's answer (module docstring). `engine` is this rank's own Engine."""

    def __init__(self, engine, env: LaunchEnv, group, owned: bool, tokenizer, tensor_parallel_size: int, mine):
        self.engine, self.rank, self.local_rank = engine, env.rank, env.local_rank
        self.world_size, self._group, self._closed = env.world_size, group, False
        self._leading = False
        # The process group is left at close(), when the engine is collected, or at interpreter exit.
        self._finalizer = weakref.finalize(self, _leave, owned)
        self._setup(env.world_size, tensor_parallel_size, tokenizer, self._exchange("ready", mine))

    def _exchange(self, what: str, mine: tuple[str, Any]) -> list:
        import torch.distributed as dist

        every: list = [None] * self.world_size
        dist.all_gather_object(every, mine, group=self._group)
        for rank, (status, value) in enumerate(every):
            if status == "error":
                raise WorkerError(f"rank {rank} of {self.world_size} failed during {what}: {value.rstrip()}")
        return [value for _, value in every]

    def lead(self) -> None:
        """On rank 0 of a launch that serves: from now on each call goes to the other ranks first, which run it
        in `follow` (the module docstring)."""
        if self.rank != 0:
            raise ValueError(f"rank {self.rank} cannot lead: rank 0 leads, the others follow()")
        self._leading = True

    def follow(self) -> None:
        """On every rank but 0 of a launch that serves: run rank 0's calls as they come, until rank 0 closes;
        then close this rank. A call that failed on some rank is reported by rank 0; the ranks go on together."""
        if self.rank == 0:
            raise ValueError("rank 0 leads (lead()); only the other ranks follow")
        try:
            while True:
                name, args = self._broadcast(None)
                if name is None:
                    return
                mine = run_command(self.engine, name, args[self.rank]) if self.rank in args else ("ok", None)
                try:
                    self._exchange(name, mine)
                except WorkerError as e:
                    log.warning("rank %d: %s", self.rank, str(e).split("\n")[0])
        finally:
            self.close()

    def _broadcast(self, call: tuple | None) -> tuple:
        """Rank 0's (name, args) call, on every rank: rank 0 gives `call`, the others receive it."""
        import torch.distributed as dist

        box = [call]
        try:
            dist.broadcast_object_list(box, src=0, group=self._group)
        except Exception as e:  # noqa: BLE001 - a collective that fails: rank 0 died or hung
            raise WorkerError(f"rank {self.rank}: rank 0 stopped sending calls ({type(e).__name__}: {e})") from e
        return box[0]

    def _call_each(self, name: str, args: dict[int, tuple]) -> dict[int, Any]:
        if self._closed:
            raise RuntimeError(f"this engine is closed; {name}() needs a new compile_model(...)")
        if self._leading:
            self._broadcast((name, args))
        mine = run_command(self.engine, name, args[self.rank]) if self.rank in args else ("ok", None)
        values = self._exchange(name, mine)
        return {rank: values[rank] for rank in args}

    def close(self) -> None:
        """Drop this rank's engine and leave the process group when compile_model joined it (idempotent; every
        rank calls it); a leading rank 0 first tells the followers to stop."""
        if self._leading and not self._closed:
            self._leading = False
            try:
                self._broadcast((None, None))
            except WorkerError:
                log.warning("the following ranks could not be told to stop; they end with the process group")
        self._closed, self.engine = True, None
        self._finalizer()
