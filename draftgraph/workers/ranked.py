"""The Engine's API over several ranks, whatever carries the calls to them.

`RankedEngine` holds what is the same for worker processes started by the engine (driver.py: pipes to each
rank) and for ranks started by a launcher such as torchrun (launched.py: every process runs its own rank and
the answers are exchanged with a collective): the ranks of one replica get every call alike (SPMD) and the
replica's first rank answers; replicas have their own requests, spread by router.py (least loaded); outputs
come back in the caller's order under the engine's own request ids, and stats are added up. A subclass says
how `name(*args)` reaches the ranks (`_call_each`) and how they stop (`close`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from draftgraph.runtime.request import RequestOutput, SamplingParams
from draftgraph.runtime.streaming import per_prompt_args, stream_requests
from draftgraph.runtime.text import decode_text, encode_prompt
from draftgraph.workers.router import Router, merge_stats


class WorkerError(RuntimeError):
    """A worker rank raised or died; every rank has been stopped."""


class RankedEngine:
    """The Engine's API over `world_size` ranks, `tensor_parallel_size` per replica: add_request, abort, step,
    has_unfinished, generate, stream, stats, warm_up_report, close (also a context manager). `config` and
    `warm_up_report` are rank 0's; `rank_info` lists what every rank reported once built."""

    def _setup(self, world_size: int, tensor_parallel_size: int, tokenizer, infos: list[dict]) -> None:
        self.world_size = world_size
        self.tp = tensor_parallel_size
        self.dp = world_size // tensor_parallel_size
        self.router = Router(self.dp)
        self.tokenizer = tokenizer
        self.last_step_tokens: list[tuple[int, list[int]]] = []
        self.last_step_logprobs: dict[int, list[dict[int, float]]] = {}
        self.rank_info = infos
        info = infos[0]
        self.config, self.k, self.warm_up_report = info["config"], info["k"], info["warm_up_report"]
        self.vocab_size, self.eos_token_ids = info["vocab_size"], info["eos_token_ids"]

    def replica_ranks(self, replica: int) -> range:
        return range(replica * self.tp, (replica + 1) * self.tp)

    # ---- talking to the ranks (a subclass carries the calls: _call_each) ----------------------------

    def _call_each(self, name: str, args: dict[int, tuple]) -> dict[int, Any]:
        """`name(*args[rank])` on each rank given; their answers by rank (WorkerError when one fails)."""
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, name: str, *args) -> list:
        """`name(*args)` on every rank; every rank's answer, in rank order."""
        got = self._call_each(name, {rank: args for rank in range(self.world_size)})
        return [got[rank] for rank in range(self.world_size)]

    def _call_replicas(self, name: str, args: dict[int, tuple]) -> dict[int, Any]:
        """`name(*args[d])` on every rank of each replica d given; each replica's answer (its first rank's,
        once its ranks are seen to agree when `name` is add_request or abort)."""
        every = self._call_each(name, {r: a for d, a in args.items() for r in self.replica_ranks(d)})
        out = {}
        for d in args:
            answers = [every[r] for r in self.replica_ranks(d)]
            if name in ("add_request", "abort") and len(set(answers)) != 1:
                raise WorkerError(f"ranks gave one request different ids {answers}: their schedulers diverged")
            out[d] = answers[0]
        return out

    # ---- the Engine's API -------------------------------------------------------------------------

    def check_request(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        return self._call_replicas("check_request", {0: (encode_prompt(self.tokenizer, prompt), params)})[0]

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> int:
        """Queue the request on the least-loaded replica; returns the engine's id for it."""
        d = self.router.pick()
        args = (encode_prompt(self.tokenizer, prompt), params or SamplingParams())
        return self.router.admit(d, self._call_replicas("add_request", {d: args})[d])

    def abort(self, request_id: int) -> bool:
        """Engine.abort on every rank of the replica holding the request: its KV blocks and slot go back on each
        of them, and it emits nothing more. False when no unfinished request has that id."""
        where = self.router.locate(request_id)
        if where is None:
            return False
        d, local = where
        found = self._call_replicas("abort", {d: (local,)})[d]
        self.router.dropped(d, local)
        return found

    def occupancy(self) -> dict:
        """Requests running and waiting, and KV blocks free and in all, added up over the replicas (each
        replica's first rank: its ranks hold the same requests and blocks)."""
        every = self._call_replicas("occupancy", {d: () for d in range(self.dp)})
        return {key: sum(every[d][key] for d in range(self.dp)) for key in every[0]}

    def has_unfinished(self) -> bool:
        return any(self._call("has_unfinished"))

    def step(self) -> list[RequestOutput]:
        """One step on every rank (a replica with no request runs none, or a dummy one in lock-step)."""
        every = self._call("step")
        done, self.last_step_tokens, self.last_step_logprobs = [], [], {}
        for d in range(self.dp):
            outs, tokens, logprobs = every[d * self.tp]
            self.last_step_tokens += [(self.router.global_id(d, rid), new) for rid, new in tokens]
            self.last_step_logprobs.update({self.router.global_id(d, rid): lp for rid, lp in logprobs.items()})
            done += self.router.finished(d, outs)
        return self._with_text(done)

    def reset_stats(self) -> None:
        self._call("reset_stats")

    def traced(self) -> bool:
        """Whether any rank traced (compiled) its functions, rather than loading them all from artifacts."""
        return any((info.get("compile") or {}).get("traces") for info in self.rank_info)

    def write_artifacts(self, out: str) -> list[dict]:
        """Every rank's compiled code into out/rank-R (artifacts/ranks.py); their manifests, in rank order."""
        return self._call("write_artifacts", out)

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
        params, arrivals = per_prompt_args(n, sampling, arrival_steps)
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
