"""The engine stepping in a background thread, fed by the HTTP server's asyncio loop (continuous batching).

The thread first builds the engine (`make_engine`), while the server already answers (/health: 503, loading),
then steps it. Every engine call happens in the one engine thread (an Engine is not thread-safe, and a parallel
engine's calls are round trips to its ranks): the server's coroutines post commands to an inbox (`submit`: add
a group of requests; `abort`; `call`: any function of the engine, such as a stats snapshot), and the thread runs them
between steps, so a new request joins the running batch at the next step and never waits for another's batch
to end. What a step emits goes back to each submission's asyncio queue through `loop.call_soon_threadsafe`.

A step that raises (an engine fault) fails the submissions in flight (their requests are aborted) and the
thread goes on serving the next ones.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("draftgraph.serve")


@dataclass
class Event:
    """What one step added to one choice of a submission: new token ids, and on its last event the output."""

    choice: int
    token_ids: list[int]
    output: Any = None  # RequestOutput, on the choice's last event
    logprobs: list | None = None  # {id: logprob} per token id, where the request asks for logprobs
    error: BaseException | None = None  # set on the one event of a submission that failed


@dataclass
class Submission:
    """One HTTP request's engine requests (a prompt x n choices each), and the queue its events arrive on."""

    prompts: list[list[int] | str]
    params: list[Any]  # SamplingParams per choice
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    admitted: asyncio.Future | None = None  # the engine's request ids, or the ValueError that refused them
    request_ids: list[int] = field(default_factory=list)
    remaining: int = 0  # choices not finished yet (counted in EngineLoop.inflight)
    created: float = field(default_factory=time.perf_counter)

    def post(self, item) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class EngineLoop:
    """Drives `engine` (an Engine or a parallel engine) from one background thread; see the module docstring."""

    def __init__(self, make_engine: Callable[[], Any], on_load_failure: Callable[[BaseException], None] | None = None):
        """`make_engine()` builds the engine, in the thread; `on_load_failure(error)` is called there when it
        raises (the server then stops)."""
        self.engine = None
        self._make_engine, self._on_load_failure = make_engine, on_load_failure
        self.ready = threading.Event()  # set once the engine is built
        self.load_error: BaseException | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._owner: dict[int, tuple[Submission, int]] = {}  # engine request id -> (submission, choice)
        self.faults = 0
        self.inflight = 0  # engine requests submitted and not finished (read by the server's loop)
        self._thread = threading.Thread(target=self._run, name="draftgraph-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def loading(self) -> bool:
        """The engine is being built (neither ready nor failed)."""
        return not self.ready.is_set() and self.load_error is None

    # ---- the server's side (asyncio) ----------------------------------------------------------------

    async def submit(self, prompts: Sequence, params: Sequence) -> Submission:
        """Queue requests (prompt i with params i); returns once the engine took them all, or raises the
        engine's ValueError for the first it refused (none of them then runs)."""
        loop = asyncio.get_running_loop()
        sub = Submission(list(prompts), list(params), loop)
        sub.admitted = loop.create_future()
        self.inflight += len(sub.prompts)
        self._post(("submit", sub))
        try:
            sub.request_ids = await asyncio.shield(sub.admitted)
        except asyncio.CancelledError:  # the client left first: abort the requests once the engine took them
            self.inflight -= len(sub.prompts)

            def taken(f: asyncio.Future) -> None:
                if not f.cancelled() and f.exception() is None:
                    sub.request_ids = f.result()
                    self.abort(sub)

            sub.admitted.add_done_callback(taken)
            raise
        except BaseException:
            self.inflight -= len(sub.prompts)
            raise
        sub.remaining = len(sub.prompts)
        return sub

    def abort(self, sub: Submission) -> None:
        """Drop a submission's unfinished requests (its client went away); their blocks are freed before the
        next step."""
        self._post(("abort", sub))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """`fn(engine)` run in the engine thread between steps; its result."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._post(("call", (fn, fut, loop)))
        return await fut

    def finished(self, sub: Submission, count: int) -> None:
        """`count` of the submission's choices are done (finished, failed or aborted)."""
        count = min(count, sub.remaining)
        sub.remaining -= count
        self.inflight -= count

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is in flight, stop the thread and wait for it (at most `timeout` seconds)."""
        self._stopping = True
        self._post(("stop", None))
        self._thread.join(timeout)

    def _post(self, item) -> None:
        self._inbox.put(item)
        self._wake.set()

    # ---- the engine thread --------------------------------------------------------------------------

    def _load(self) -> bool:
        """Build the engine (True), or record why it failed and say so (False)."""
        try:
            engine = self._make_engine()
            engine.reset_stats()  # /metrics reports what was served, not the build's warm-up
        except BaseException as e:  # noqa: BLE001 - the server reports it and stops
            self.load_error = e
            log.error("the engine could not be built", exc_info=e)
            if self._on_load_failure is not None:
                self._on_load_failure(e)
            return False
        self.engine = engine
        self.ready.set()
        return True

    def _run(self) -> None:
        if not self._load():
            return
        engine = self.engine
        while True:
            if not self._drain():
                break
            if not engine.has_unfinished():
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            try:
                done = engine.step()
            except Exception as e:  # noqa: BLE001 - an engine fault fails the requests in flight, not the server
                self._fault(e)
                continue
            # A request's last tokens come with its output, in one event: a stream then knows that no text past a
            # stop string may be sent (app.py holds back the characters a stop may start in until then).
            last = {out.request_id: out for out in done}
            lps = engine.last_step_logprobs
            for rid, new in engine.last_step_tokens:
                owner = self._owner.get(rid)
                if owner is not None and new and rid not in last:
                    owner[0].post(Event(owner[1], list(new), logprobs=lps.get(rid)))
            new_of = dict(engine.last_step_tokens)
            for out in done:
                owner = self._owner.pop(out.request_id, None)
                if owner is not None:
                    new = list(new_of.get(out.request_id, []))
                    owner[0].post(Event(owner[1], new, output=out, logprobs=lps.get(out.request_id)))
        self._abort_all()

    def _drain(self) -> bool:
        """Run the inbox's commands; False once told to stop."""
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return True
            if kind == "stop":
                return False
            if kind == "submit":
                self._admit(arg)
            elif kind == "abort":
                self._abort(arg)
            elif kind == "call":
                fn, fut, loop = arg
                try:
                    value, error = fn(self.engine), None
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    value, error = None, e
                loop.call_soon_threadsafe(_settle, fut, value, error)

    def _admit(self, sub: Submission) -> None:
        engine, ids = self.engine, []
        try:
            for prompt, params in zip(sub.prompts, sub.params):
                ids.append(engine.add_request(prompt, params))
        except Exception as e:  # noqa: BLE001 - a refused request (ValueError) or a fault: the caller says which
            for rid in ids:
                self._engine_abort(rid)
            sub.loop.call_soon_threadsafe(_settle, sub.admitted, None, e)
            return
        for choice, rid in enumerate(ids):
            self._owner[rid] = (sub, choice)
        sub.loop.call_soon_threadsafe(_settle, sub.admitted, ids, None)

    def _abort(self, sub: Submission) -> None:
        for rid in sub.request_ids:
            if self._owner.pop(rid, None) is not None:
                self._engine_abort(rid)

    def _engine_abort(self, rid: int) -> None:
        try:
            self.engine.abort(rid)
        except Exception:  # noqa: BLE001 - the request is gone either way
            log.exception("aborting request %d failed", rid)

    def _fault(self, error: Exception) -> None:
        self.faults += 1
        log.error("engine step failed; the requests in flight are failed and aborted", exc_info=error)
        owners, self._owner = self._owner, {}
        failed = set()
        for rid, (sub, _) in owners.items():
            self._engine_abort(rid)
            if id(sub) not in failed:
                failed.add(id(sub))
                sub.post(Event(-1, [], error=error))

    def _abort_all(self) -> None:
        owners, self._owner = self._owner, {}
        for rid, (sub, _) in owners.items():
            self._engine_abort(rid)
            sub.post(Event(-1, [], error=RuntimeError("the server is shutting down")))


def _settle(fut: asyncio.Future, value, error) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(value)
