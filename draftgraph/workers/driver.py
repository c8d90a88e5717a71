"""The driver: start one worker process per rank, send every call to all of them, return rank 0's answer.

A rank that raises, or whose process dies, ends every rank: the driver raises `WorkerError` naming the rank
and its exception or exit code, and terminates the others (which may be waiting in a collective)."""

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
            f"tensor_parallel_size={world_size} needs {world_size} CUDA devices (one per rank), but "
            f"{found} are visible; lower tensor_parallel_size to at most {found} or use device='cpu'"
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
    """Start config.tensor_parallel_size ranks (torch.multiprocessing spawn), each building its engine; return
    once all are ready (or raise WorkerError naming the first rank that failed)."""
    import torch.multiprocessing as mp

    world = config.tensor_parallel_size
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
    return ParallelEngine(procs, conns, tmp, tok)


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
    warm_up_report, close (also a context manager). Each call runs on every rank; rank 0's result returns."""

    def __init__(self, procs, conns, tmp, tokenizer):
        self.procs, self._conns = procs, conns
        self.world_size = len(procs)
        self.tokenizer = tokenizer
        self.last_step_tokens: list[tuple[int, list[int]]] = []
        self._closed = False
        # Runs at close(), when the driver is collected, or at interpreter exit (before multiprocessing joins).
        self._finalizer = weakref.finalize(self, _shutdown, procs, conns, tmp)
        info = self._gather("ready")[0]
        self.config, self.k, self.warm_up_report = info["config"], info["k"], info["warm_up_report"]
        self.vocab_size, self.eos_token_ids = info["vocab_size"], info["eos_token_ids"]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # ---- talking to the ranks ---------------------------------------------------------------------

    def _call(self, name: str, *args) -> list:
        if self._closed:
            raise RuntimeError(f"this engine is closed; {name}() needs a new compile_model(...)")
        for conn in self._conns:
            try:
                conn.send((name, args))
            except (OSError, ValueError):
                break  # that rank is gone: _gather names it
        return self._gather(name)

    def _gather(self, what: str) -> list:
        """Every rank's answer to the last call, or WorkerError at the first rank that raised or died."""
        results: dict[int, Any] = {}
        waiting = {conn: rank for rank, conn in enumerate(self._conns)}
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
                elif sentinels[ready] in waiting.values():
                    rank = sentinels[ready]
                    conn = self._conns[rank]
                    if conn.poll():  # it answered before it exited: read that first
                        continue
                    self._fail(rank, what, None)
        return [results[r] for r in range(self.world_size)]

    def _fail(self, rank: int, what: str, error: str | None) -> None:
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
        return self._call("check_request", encode_prompt(self.tokenizer, prompt), params)[0]

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> int:
        ids = self._call("add_request", encode_prompt(self.tokenizer, prompt), params or SamplingParams())
        if len(set(ids)) != 1:
            raise WorkerError(f"ranks gave one request different ids {ids}: their schedulers diverged")
        return ids[0]

    def has_unfinished(self) -> bool:
        return self._call("has_unfinished")[0]

    def step(self) -> list[RequestOutput]:
        done, self.last_step_tokens = self._call("step")[0]
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
        """Engine.generate on every rank (one round trip; `progress` is not shown across processes)."""
        del progress
        ids = [encode_prompt(self.tokenizer, p) for p in prompts]
        return self._with_text(self._call("generate", ids, sampling, arrival_steps)[0])

    def stream(self, prompts, sampling=None, arrival_steps=None, progress=False, detokenize=True):
        """Engine.stream, a round trip to every rank per step."""
        return stream_requests(self, prompts, sampling, arrival_steps, progress, detokenize)

    def stats(self) -> dict:
        """Rank 0's stats, once every rank is seen to have taken the same number of steps."""
        every = self._call("stats")
        steps = [s["steps"] for s in every]
        if len(set(steps)) != 1:
            raise WorkerError(f"ranks took different numbers of steps {steps}: their schedulers diverged")
        return {**every[0], "tensor_parallel_size": self.world_size}

    def _with_text(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        if self.tokenizer is not None:
            for out in outputs:
                out.text = decode_text(self.tokenizer, out.token_ids)
        return outputs
