"""Streaming: a generator over an engine's steps that yields each request's new tokens and text.

`Engine.generate` is this generator drained; `Engine.stream` hands it to the caller. A speculative step
can emit several tokens of one request at once; they arrive as one delta, already cut at a stop token or
stop string (a stream holds back the text a stop string may still start in).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tqdm import tqdm

from draftgraph.runtime.request import RequestOutput, SamplingParams
from draftgraph.runtime.text import IncrementalDetokenizer, StopStrings

if TYPE_CHECKING:
    from draftgraph.runtime.engine import Engine


@dataclass(frozen=True)
class StreamDelta:
    """What one step added to one request."""

    index: int  # the prompt's position in the list given to stream / generate
    request_id: int
    token_ids: list[int]  # the ids emitted in this step (one or more; the stop token, if any, is last)
    text: str | None  # the text they complete (None without a tokenizer); the pieces add up to output.text
    finish_reason: str | None = None  # "stop" or "length" on the request's last delta
    output: RequestOutput | None = None  # the whole result, on the request's last delta


class StreamedText:
    """What a request's stream has sent of its text. With stop strings the last `hold` characters wait for
    the next step (a stop string may start among them: nothing past a stop reaches the stream); the request's
    last delta sends the rest of its final text (cut at the stop)."""

    def __init__(self, hold: int):
        self.hold, self.pending, self.sent = hold, "", 0

    def push(self, piece: str, out: RequestOutput | None) -> str:
        if out is not None:
            text = (out.text or "")[self.sent :]
        else:
            self.pending += piece
            cut = max(0, len(self.pending) - self.hold)
            text, self.pending = self.pending[:cut], self.pending[cut:]
        self.sent += len(text)
        return text


def per_prompt_args(
    n: int, sampling: SamplingParams | Sequence[SamplingParams] | None, arrival_steps: Sequence[int] | None
) -> tuple[list, list[int]]:
    """generate()'s sampling and arrival arguments as one entry per prompt (one value for all, or a list of n)."""
    params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * n
    arrivals = list(arrival_steps) if arrival_steps is not None else [0] * n
    if len(params) != n or len(arrivals) != n:
        raise ValueError(f"{n} prompts but {len(params)} sampling params and {len(arrivals)} arrival steps")
    return params, arrivals


def stream_requests(
    engine: Engine,
    prompts: Sequence[str | Sequence[int]],
    sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    arrival_steps: Sequence[int] | None = None,
    progress: bool = False,
    detokenize: bool = True,
) -> Iterator[StreamDelta]:
    """Run `engine` until every prompt finished, yielding a StreamDelta per request per step it emitted in.
    Request i joins at step arrival_steps[i] (all at once by default). Every prompt is encoded (and a text
    prompt without a tokenizer refused) before the first request starts. A caller that stops iterating
    early leaves its unfinished requests in the engine."""
    n = len(prompts)
    params, arrivals = per_prompt_args(n, sampling, arrival_steps)
    params = [p or SamplingParams() for p in params]
    # Every request is checked (and text encoded) before any runs; then stats() reports this call alone.
    encoded = [engine.check_request(prompt, p) for prompt, p in zip(prompts, params)]
    engine.reset_stats()
    order = sorted(range(n), key=lambda i: arrivals[i])
    index: dict[int, int] = {}  # request id -> prompt index (other requests in the engine are not ours)
    detoks: dict[int, IncrementalDetokenizer] = {}
    streamed: dict[int, StreamedText] = {}
    step, nxt, finished = 0, 0, 0
    bar = tqdm(total=n, desc="generating", unit="req", disable=not progress)
    try:
        while finished < n:
            while nxt < n and arrivals[order[nxt]] <= step:
                i = order[nxt]
                rid = engine.add_request(encoded[i], params[i])
                index[rid] = i
                if detokenize and engine.tokenizer is not None:
                    detoks[rid] = IncrementalDetokenizer(engine.tokenizer)
                    streamed[rid] = StreamedText(StopStrings.holdback(params[i].stop))
                nxt += 1
            if not engine.has_unfinished():
                step = arrivals[order[nxt]]  # idle until the next arrival
                continue
            done = {o.request_id: o for o in engine.step() if o.request_id in index}
            for rid, new in engine.last_step_tokens:
                if rid not in index:
                    continue
                out = done.get(rid)
                text = None
                if rid in detoks:
                    text = streamed[rid].push(detoks[rid].push(new), out)
                    if out is not None:
                        del detoks[rid], streamed[rid]
                yield StreamDelta(index[rid], rid, new, text, out.finish_reason if out else None, out)
            finished += len(done)
            bar.update(len(done))
            step += 1
    finally:
        bar.close()
