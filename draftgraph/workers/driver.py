"""The driver: start one worker process per rank (data_parallel_size replicas of tensor_parallel_size ranks),
send each call to the ranks it concerns, and answer for them all.

The ranks of one replica get every call alike (SPMD) and the replica's first rank answers. Replicas have
their own requests: the driver spreads them (router.py: least loaded), returns outputs in the caller's order
under its own request ids, and adds their stats up. A rank that raises, or whose process dies, ends every
rank: the driver raises `WorkerError` naming the rank and its exception or exit code, and terminates the
others (which may be waiting in a collective)."""

from __future__ import annotations

import contextlib
import tempfile
import weakref
from collections.abc import Sequence
from multiprocessing.connection import wait
from typing import Any

import torch

from draftgraph.compiler.config import CompileConfig
from draftgraph.preflight import check_checkpoints
from draftgraph.runtime.request import RequestOutput, SamplingParams
from draftgraph.runtime.streaming import stream_requests
from draftgraph.runtime.text import decode_text, encode_prompt, resolve_tokenizer
from draftgraph.workers.router import Router, merge_stats
from draftgraph.workers.sources import portable_sources
from draftgraph.workers.worker import RankSpec, worker_main


class WorkerError(RuntimeError):
    """A worker rank raised or died; every rank has been stopped."""


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


def start_workers(
    target: Any,
    drafter: Any,
    config: CompileConfig,
    artifacts: str | None = None,
    strict_artifacts: bool = False,
    tokenizer: Any = None,
) -> ParallelEngine:
    """Start tensor_parallel_size x data_parallel_size ranks (torch.multiprocessing spawn), each building its
    engine; return once all are ready (or raise WorkerError naming the first rank that failed)."""
    import torch.multiprocessing as mp

    world = config.tensor_parallel_size * config.data_parallel_size
    device_type = _device_type(config, world)
    tok = resolve_tokenizer(tokenizer, target)  # the driver encodes and decodes text; ranks see ids only
    check_checkpoints(target, drafter)
    tmp = tempfile.TemporaryDirectory(prefix="draftgraph-workers-")
    target_ref, drafter_ref = portable_sources(target, drafter, tmp.name)
    spec = RankSpec(
        world, f"file://{tmp.name}/init", device_type, target_ref, drafter_ref, config, artifacts, strict_artifacts
    )
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for rank in range(world):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=worker_main, args=(rank, spec, theirs), name=f"draftgraph-rank{rank}")
        proc.start()
        theirs.close()
        procs.append(proc)
        conns.append(ours)
    return ParallelEngine(procs, conns, tmp, tok, config.tensor_parallel_size)


def _shutdown(procs, conns, tmp, grace_s: float = 10.0) -> None:
    """Ask every rank to stop, then terminate (and kill) what is left; remove the temporary directory."""
    for conn in conns:
        with contextlib.suppress(OSError, ValueError):  # already closed or broken
            conn.send(None)
    for proc in procs:
        proc.join(grace_s if proc.exitcode is None else 0)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()
    tmp.cleanup()


class ParallelEngine:
    """The Engine's API over several ranks: add_request, step, has_unfinished, generate, stream, stats,
    warm_up_report, close (also a context manager). Each call runs on the ranks it concerns (see the module
    docstring); `config` and `warm_up_report` are rank 0's."""

    def __init__(self, procs, conns, tmp, tokenizer, tensor_parallel_size: int = 1):
        self.procs, self._conns = procs, conns
        self.world_size = len(procs)
        self.tp = tensor_parallel_size
        self.dp = self.world_size // self.tp
        self.router = Router(self.dp)
        self.tokenizer = tokenizer
        self.last_step_tokens: list[tuple[int, list[int]]] = []
        self._closed = False
        # Runs at close(), when the driver is collected, or at interpreter exit (before multiprocessing joins).
        self._finalizer = weakref.finalize(self, _shutdown, procs, conns, tmp)
        info = self._gather("ready", range(self.world_size))[0]
        self.config, self.k, self.warm_up_report = info["config"], info["k"], info["warm_up_report"]
        self.vocab_size, self.eos_token_ids = info["vocab_size"], info["eos_token_ids"]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def replica_ranks(self, replica: int) -> range:
        return range(replica * self.tp, (replica + 1) * self.tp)

    # ---- talking to the ranks ---------------------------------------------------------------------

    def _call(self, name: str, *args) -> list:
        """`name(*args)` on every rank; every rank's answer, in rank order."""
        got = self._call_each(name, {rank: args for rank in range(self.world_size)})
        return [got[rank] for rank in range(self.world_size)]

    def _call_replicas(self, name: str, args: dict[int, tuple]) -> dict[int, Any]:
        """`name(*args[d])` on every rank of each replica d given; each replica's answer (its first rank's,
        once its ranks are seen to agree when `name` is add_request)."""
        every = self._call_each(name, {r: a for d, a in args.items() for r in self.replica_ranks(d)})
        out = {}
        for d in args:
            answers = [every[r] for r in self.replica_ranks(d)]
            if name == "add_request" and len(set(answers)) != 1:
                raise WorkerError(f"ranks gave one request different ids {answers}: their schedulers diverged")
            out[d] = answers[0]
        return out

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
            dead = [r for r, p in enumerate(self.procs) if r != rank and p.exitcode is not None]
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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- the Engine's API -------------------------------------------------------------------------

    def check_request(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        return self._call_replicas("check_request", {0: (encode_prompt(self.tokenizer, prompt), params)})[0]

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue the request on the least-loaded replica; returns the driver's id for it."""
        d = self.router.pick()
        args = (encode_prompt(self.tokenizer, prompt), params or SamplingParams())
        return self.router.admit(d, self._call_replicas("add_request", {d: args})[d])

    def has_unfinished(self) -> bool:
        return any(self._call("has_unfinished"))

    def step(self) -> list[RequestOutput]:
        """One step on every rank (a replica with no request runs none, or a dummy one in lock-step)."""
        every = self._call("step")
        done, self.last_step_tokens = [], []
        for d in range(self.dp):
            outs, tokens = every[d * self.tp]
            self.last_step_tokens += [(self.router.global_id(d, rid), new) for rid, new in tokens]
            done += self.router.finished(d, outs)
        return self._with_text(done)

    def reset_stats(self) -> None:
        self._call("reset_stats")

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        arrival_steps: Sequence[int] | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Engine.generate, the prompts spread over the replicas (one round trip; `progress` is not shown across
        processes); outputs in the prompts' order. Request i joins its replica at its step arrival_steps[i]."""
        del progress
        n = len(prompts)
        params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * n
        arrivals = list(arrival_steps) if arrival_steps is not None else [0] * n
        if len(params) != n or len(arrivals) != n:
            raise ValueError(f"{n} prompts but {len(params)} sampling params and {len(arrivals)} arrival steps")
        ids = [encode_prompt(self.tokenizer, p) for p in prompts]
        where = self.router.spread(n)
        mine = {d: [i for i in range(n) if where[i] == d] for d in range(self.dp)}
        args = {d: ([ids[i] for i in idx], [params[i] for i in idx], [arrivals[i] for i in idx])
                for d, idx in mine.items()}  # fmt: skip
        answers = self._call_replicas("generate", args)
        outputs: list[RequestOutput | None] = [None] * n
        for d, idx in mine.items():
            for i, out in zip(idx, answers[d]):
                outputs[i] = out
        for rid, out in zip(self.router.new_ids(n), outputs):
            out.request_id = rid
        return self._with_text(outputs)

    def stream(self, prompts, sampling=None, arrival_steps=None, progress=False, detokenize=True):
        """Engine.stream, a round trip to every rank per step."""
        return stream_requests(self, prompts, sampling, arrival_steps, progress, detokenize)

    def stats(self) -> dict:
        """The replicas' stats added up (router.merge_stats; `per_replica`: each replica's own, with
        `dummy_steps`), once the ranks of each replica are seen to have taken the same number of steps."""
        every = self._call("stats")
        for d in range(self.dp):
            steps = [every[r]["steps"] for r in self.replica_ranks(d)]
            if len(set(steps)) != 1:
                raise WorkerError(f"ranks took different numbers of steps {steps}: their schedulers diverged")
        merged = merge_stats([every[d * self.tp] for d in range(self.dp)])
        return {**merged, "tensor_parallel_size": self.tp, "data_parallel_size": self.dp}

    def _with_text(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        if self.tokenizer is not None:
            for out in outputs:
                out.text = decode_text(self.tokenizer, out.token_ids)
        return outputs
