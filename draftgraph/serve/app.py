"""The FastAPI app: OpenAI's /v1/completions and /v1/chat/completions (JSON or SSE streams), /v1/models,
/health and Prometheus /metrics, over an EngineLoop (engine_loop.py).

A completion request becomes one engine request per prompt and choice (n), submitted together; their tokens
come back step by step and are detokenized here (incrementally, for streams). A client that goes away has its
requests aborted: a stream when its response is cancelled, a plain request when the server sees the
disconnect while it waits.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from draftgraph.runtime.streaming import StreamedText
from draftgraph.runtime.text import IncrementalDetokenizer, StopStrings
from draftgraph.serve.engine_loop import EngineLoop, Submission
from draftgraph.serve.metrics import ServerMetrics, engine_snapshot
from draftgraph.serve.protocol import (
    Parsed,
    ServeError,
    chat_request,
    check_model,
    completion_request,
    logprobs_json,
)


@dataclass
class Choice:
    """One choice's progress: its text so far (streams), tokens, timings and, once finished, its output."""

    detok: IncrementalDetokenizer | None
    num_tokens: int = 0
    first_token: float | None = None
    output: object = None
    pieces: list[str] = field(default_factory=list)
    streamed: StreamedText | None = None  # what a stream sent: text a stop string may start in waits
    unsent_logprobs: list = field(default_factory=list)  # (id, {id: logprob}) of tokens no chunk carried yet
    text_offset: int = 0  # characters of text the stream's completions logprobs have covered


class ClientGone(Exception):
    pass


def build_app(loop: EngineLoop, served_name: str, max_queue: int) -> FastAPI:
    """The app for `loop`'s engine, served as model `served_name`; more than --max-queue requests waiting for a
    place in the running batch get 503. Until the loop has built its engine, /health and every endpoint that
    needs the engine answer 503 (loading)."""
    metrics = ServerMetrics(served_name)
    created = int(time.time())

    def ready_engine():
        """The engine, or 503 while it loads (or when it failed to load)."""
        if loop.load_error is not None:
            raise ServeError(503, f"the engine failed to load: {loop.load_error}", code="load_failed")
        if not loop.ready.is_set():
            raise ServeError(503, "the engine is loading; retry once GET /health answers 200", code="loading")
        return loop.engine

    app = FastAPI(title="draftgraph", version="0.1")
    app.state.loop, app.state.metrics = loop, metrics

    @app.exception_handler(ServeError)
    async def _serve_error(request: Request, e: ServeError):
        metrics.errors.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(Exception)
    async def _fault(request: Request, e: Exception):
        metrics.errors.labels("500").inc()
        err = ServeError(500, f"internal error: {type(e).__name__}: {e}")
        return JSONResponse(err.body(), status_code=500)

    @app.get("/health")
    async def health():
        if loop.load_error is not None:
            return JSONResponse({"status": "failed", "message": f"the engine failed to load: {loop.load_error}"},
                                status_code=503)  # fmt: skip
        if loop.loading:
            return JSONResponse({"status": "loading", "message": "the engine is loading"}, status_code=503)
        if not loop.alive:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        card = {"id": served_name, "object": "model", "created": created, "owned_by": "draftgraph",
                "max_model_len": ready_engine().config.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus():
        ready_engine()
        snap = await loop.call(engine_snapshot)
        return Response(metrics.render(snap, loop.inflight), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _json(request)
        check_model(body, served_name)
        ready_engine()
        return await _run(request, completion_request(body), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _json(request)
        check_model(body, served_name)
        engine = ready_engine()
        return await _run(request, chat_request(body, engine.tokenizer or None, engine.config.max_model_len), chat=True)

    async def _run(request: Request, parsed: Parsed, chat: bool):
        engine = ready_engine()
        tokenizer = engine.tokenizer or None
        capacity = engine.config.max_num_seqs * getattr(engine, "dp", 1) + max_queue
        prompts, params = parsed.choices()
        if loop.inflight + len(prompts) > capacity:
            raise ServeError(
                503, f"the server is full: {loop.inflight} requests in flight, the running batch and --max-queue "
                f"hold {capacity}; retry later, or start the server with a larger --max-queue", code="queue_full",
            )  # fmt: skip
        if not loop.alive:
            raise ServeError(503, "the server is shutting down", code="shutting_down")
        try:
            sub = await loop.submit(prompts, params)
        except ValueError as e:  # the engine's own check (check_request): the value, the limit, the fix
            raise ServeError(400, str(e)) from e
        except (TypeError, RuntimeError) as e:
            raise ServeError(500, f"the engine could not take the request: {e}") from e
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        hold = StopStrings.holdback(parsed.params.stop)
        choices = [Choice(IncrementalDetokenizer(tokenizer) if tokenizer and parsed.stream else None,
                          streamed=StreamedText(hold)) for _ in prompts]  # fmt: skip
        if parsed.stream:
            gen = _stream(sub, choices, parsed, rid, chat)
            return StreamingResponse(gen, media_type="text/event-stream")
        try:
            await _collect(request, sub, choices)
        except ClientGone:
            return Response(status_code=499)
        return _response(rid, chat, parsed, choices)

    async def _next(sub: Submission, choices: list[Choice]) -> tuple[int, str, list[int]] | None:
        """The next event's (choice, new text, new token ids); None when every choice has finished."""
        if all(c.output is not None for c in choices):
            return None
        ev = await sub.events.get()
        if ev.error is not None:
            loop.finished(sub, sub.remaining)
            raise ServeError(500, f"engine fault: {type(ev.error).__name__}: {ev.error}; the request was aborted")
        c = choices[ev.choice]
        now = time.perf_counter()
        if ev.logprobs:
            c.unsent_logprobs += list(zip(ev.token_ids, ev.logprobs))
        if ev.token_ids:
            c.num_tokens += len(ev.token_ids)
            metrics.generated_tokens.inc(len(ev.token_ids))
            if c.first_token is None:
                c.first_token = now
        piece = c.detok.push(ev.token_ids) if c.detok is not None and ev.token_ids else ""
        if c.detok is not None:  # the last piece: the rest of the output's text (cut at a stop string)
            piece = c.streamed.push(piece, ev.output)
        if ev.output is not None:
            c.output = ev.output
            loop.finished(sub, 1)
            metrics.prompt_tokens.inc(len(ev.output.prompt_token_ids))
            ttft = c.first_token - sub.created if c.first_token is not None else None
            metrics.observe_request(ttft, now - sub.created, len(ev.output.token_ids), ev.output.finish_reason)
        return ev.choice, piece, ev.token_ids

    async def _collect(request: Request, sub: Submission, choices: list[Choice]) -> None:
        async def drain():
            while await _next(sub, choices) is not None:
                pass

        task = asyncio.ensure_future(drain())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if done:
                    task.result()
                    return
                if await request.is_disconnected():
                    raise ClientGone()
        finally:
            if not task.done():
                task.cancel()
                metrics.aborted.inc(sub.remaining)
                loop.abort(sub)
                loop.finished(sub, sub.remaining)

    async def _stream(sub: Submission, choices: list[Choice], parsed: Parsed, rid: str, chat: bool):
        tokenizer = loop.engine.tokenizer or None
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": rid, "object": obj, "created": int(time.time()), "model": served_name}
        top = parsed.params.logprobs
        try:
            if chat:
                for i in range(len(choices)):
                    first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}  # fmt: skip
                    yield _sse({**head, "choices": [first]})
            while True:
                try:
                    got = await _next(sub, choices)
                except ServeError as e:
                    yield _sse(e.body())
                    break
                if got is None:
                    break
                i, piece, ids = got
                c = choices[i]
                fr = c.output.finish_reason if c.output is not None else None
                if not piece and fr is None and (tokenizer or not ids):
                    continue  # text held back (a character's bytes not all generated yet)
                lp = None
                if top is not None:  # the tokens since the last chunk that carried logprobs
                    lp = logprobs_json(c.unsent_logprobs, top, tokenizer, chat, c.text_offset)
                    c.unsent_logprobs, c.text_offset = [], c.text_offset + len(piece)
                if chat:
                    ch = {"index": i, "delta": {"content": piece} if piece else {}, "logprobs": lp,
                          "finish_reason": fr}  # fmt: skip
                else:
                    ch = {"index": i, "text": piece, "logprobs": lp, "finish_reason": fr, "token_ids": ids}
                yield _sse({**head, "choices": [ch]})
            if parsed.include_usage and all(c.output is not None for c in choices):
                yield _sse({**head, "choices": [], "usage": _usage(choices, parsed.n)})
            yield "data: [DONE]\n\n"
        finally:
            if sub.remaining:  # the client left (or the engine failed) before every choice finished
                metrics.aborted.inc(sub.remaining)
                loop.abort(sub)
                loop.finished(sub, sub.remaining)

    def _response(rid: str, chat: bool, parsed: Parsed, choices: list[Choice]) -> dict:
        tokenizer = loop.engine.tokenizer or None
        out = []
        for i, c in enumerate(choices):
            text = (c.output.text or "") if tokenizer else ""
            lp = c.output.logprobs
            if lp is not None:
                lp = logprobs_json(list(zip(c.output.token_ids, lp)), parsed.params.logprobs, tokenizer, chat)
            ch = {"index": i, "logprobs": lp, "finish_reason": c.output.finish_reason,
                  "token_ids": list(c.output.token_ids)}  # fmt: skip
            if chat:
                ch["message"] = {"role": "assistant", "content": text}
            else:
                ch["text"] = text
            out.append(ch)
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": served_name,
            "choices": out,
            "usage": _usage(choices, parsed.n),
        }

    return app


def _usage(choices: list[Choice], n: int) -> dict:
    """Prompt tokens (each prompt once), completion tokens, and the speculative decoding extension."""
    outs = [c.output for c in choices]
    prompt = sum(len(o.prompt_token_ids) for i, o in enumerate(outs) if i % n == 0)
    completion = sum(len(o.token_ids) for o in outs)
    verify = sum(o.num_verify_steps for o in outs)
    accepted = sum(o.num_accepted_tokens for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "spec_decode": {
            "draft_tokens": sum(o.num_draft_tokens for o in outs),
            "accepted_tokens": accepted,
            "verify_steps": verify,
            "mean_accepted_length": 1 + accepted / verify if verify else 0.0,
        },
    }


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _json(request: Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ServeError(400, f"the request body is not valid JSON ({e})") from e
    if not isinstance(body, dict):
        raise ServeError(400, "the request body must be a JSON object")
    return body
