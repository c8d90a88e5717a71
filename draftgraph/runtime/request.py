"""SamplingParams (what a user asks for), Request (what the engine tracks) and RequestOutput (what returns)."""

from __future__ import annotations

from dataclasses import dataclass, field

from draftgraph.runtime.grammar import STRUCTURED_FIELDS, RequestGrammar, check_structured
from draftgraph.runtime.kv_cache import BlockTable
from draftgraph.runtime.logprobs import MAX_LOGPROBS, RowLogprobs
from draftgraph.runtime.penalties import MAX_LOGIT_BIAS
from draftgraph.runtime.text import StopStrings


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings, checked when built. temperature 0 is greedy; top_k 0 (or -1) and
    top_p 1 switch those off."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # The top `logprobs` tokens' logprobs (and the chosen token's) per generated token, from the target's raw
    # logits; 0: the chosen token's alone; None: none (RequestOutput.logprobs stays None).
    logprobs: int | None = None
    # Stop strings: the request ends at the first one its output text contains (needs the engine's tokenizer);
    # the text is cut before it (or after it, with include_stop_str_in_output), the ids after its last token.
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    # Logits processing of the target (runtime/penalties.py), in vLLM's order before temperature and top-k / top-p:
    # logit_bias, then min_tokens, then the penalties. Under speculation verify position i counts drafts 0..i-1 as
    # generated. repetition_penalty (transformers' meaning, > 0, 1 = off): over prompt and output tokens, a logit > 0
    # is divided by it, else multiplied. presence / frequency_penalty (OpenAI's, in [-2, 2]): over output tokens,
    # logit -= frequency_penalty * count + presence_penalty * (count > 0).
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # While fewer than min_tokens tokens are generated, eos (unless ignore_eos) and stop_token_ids get -inf (vLLM's
    # meaning: stop strings are not held back and may still end the request earlier).
    min_tokens: int = 0
    # {token id: bias in [-100, 100]} added to the logit (OpenAI's); kept as a tuple of (id, bias) pairs sorted by
    # id so the params stay hashable; ids are checked against the vocabulary when the request is added.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Structured output (runtime/grammar.py, through xgrammar: `pip install draftgraph[structured]`), at most one: a
    # JSON schema (a dict, or its JSON text; kept as JSON text; compact whitespace), a regular expression, or an EBNF
    # grammar in xgrammar's syntax. The output follows it exactly (also under speculation) and ends with "stop" at
    # the stop token (eos, else stop_token_ids) the grammar allows once complete. Needs the engine's tokenizer.
    json_schema: dict | str | None = None
    regex: str | None = None
    grammar: str | None = None

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens} must be at least 1 (the tokens to generate per prompt)")
        if not self.temperature >= 0:  # also refuses NaN
            raise ValueError(f"temperature={self.temperature} must be >= 0; 0 is greedy, e.g. 0.7 samples")
        if self.top_k < -1:
            raise ValueError(f"top_k={self.top_k} must be >= 1 to keep the k likeliest tokens, or 0 (or -1) for off")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must lie in (0, 1]; 1 is off, e.g. 0.9 keeps the top 90% of mass")
        check_stop_token_ids(self)
        check_stop_strings(self)
        lp = self.logprobs
        if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= MAX_LOGPROBS):
            raise ValueError(
                f"logprobs={lp!r} must be None (off) or an int in [0, {MAX_LOGPROBS}]: the top tokens to return "
                "beside the chosen one, e.g. 5"
            )
        check_penalties(self)
        check_logit_bias(self)
        check_structured(self)

    @property
    def structured(self) -> tuple[str, str] | None:
        """(field, its text) of the structured output asked for (runtime/grammar.py), or None."""
        return next(((f, getattr(self, f)) for f in STRUCTURED_FIELDS if getattr(self, f) is not None), None)

    @property
    def uses_logits_processing(self) -> bool:
        """Whether the target's logits of this request are changed before sampling (runtime/penalties.py)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.min_tokens > 0
            or bool(self.logit_bias)
        )


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens, prompt excluded
    finish_reason: str  # "length" (max_tokens reached) or "stop" (an eos or stop token, kept as the last id)
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    text: str | None = None  # token_ids decoded, special tokens skipped (None when the engine has no tokenizer)
    # With SamplingParams.logprobs: per generated token, {chosen id and the top `logprobs` ids: logprob}
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None  # the sum of the chosen tokens' logprobs


@dataclass
class Request:
    """A request's host-side state. Target KV holds positions < num_computed; in decode the last token of
    `tokens` has no KV yet and `drafts` holds the K proposals to verify next. `tokens` (prompt, then
    output) and `output` are appended to, never rebuilt: a request's bookkeeping is linear in its length."""

    id: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    slot: int = -1  # persistent per-request index into device buffers while running (or preempted)
    tokens: list[int] = field(default_factory=list)
    output: list[int] = field(default_factory=list)  # generated tokens, prompt excluded
    num_computed: int = 0
    prefill_len: int = 0  # tokens to prefill before decoding starts (after a preemption: to recompute)
    resumes_decode: bool = False  # preempted while decoding: prefill_len ends before the last token, no sampling
    drafts: list[int] = field(default_factory=list)
    # The first position whose draft-model KV a K = 0 step skipped (adaptive speculation, StepRunner.catch_up); -1: none
    draft_lag: int = -1
    # Hybrid prefix caching (runtime/state_snapshots.py): a block boundary its prefill ends a chunk at, so that a
    # snapshot is taken there (where its lookup found cached blocks past the last snapshot); 0: none
    state_cut: int = 0
    block_table: BlockTable | None = None
    finish_reason: str | None = None
    stop_ids: frozenset[int] = frozenset()  # eos (unless ignore_eos) + stop_token_ids
    stops: StopStrings | None = None  # the output text's stop-string search (runtime/text.py), with params.stop
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None  # one per output token, when params.logprobs is set
    cumulative_logprob: float = 0.0
    grammar: RequestGrammar | None = None  # the matcher of params.structured (runtime/grammar.py), set when added

    def __post_init__(self):
        self.tokens = list(self.prompt)
        if self.params.logprobs is not None:
            self.logprobs = []
        self.prefill_len = len(self.prompt)

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.prefill_len

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            self.id,
            list(self.prompt),
            list(self.output),
            self.finish_reason or "length",
            self.num_verify_steps,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            cumulative_logprob=None if self.logprobs is None else self.cumulative_logprob,
            text=self.stops.text if self.stops is not None and self.stops.found else None,
        )

    def append(
        self, new_tokens: list[int], stop_ids: frozenset[int], logprobs: list[RowLogprobs] | None = None
    ) -> None:
        """Append emitted tokens up to max_tokens or the first stop token (kept in the output); with
        `logprobs` (one per emitted token) and params.logprobs set, their entries alongside. A stop string the
        output text comes to contain ends the request at the token that completes it, and so does a stop token
        that terminates the request's grammar."""
        for i, tok in enumerate(new_tokens):
            self.tokens.append(tok)
            self.output.append(tok)
            if self.logprobs is not None:
                if logprobs is None:
                    raise RuntimeError(f"request {self.id} asked for logprobs but its step gathered none")
                self.logprobs.append(logprobs[i].entry(tok, self.params.logprobs))
                self.cumulative_logprob += logprobs[i].chosen
            ended = self.grammar is not None and self.grammar.advance(tok)
            if ended or tok in stop_ids or (self.stops is not None and self.stops.push(tok)):
                self.finish_reason = "stop"
                return
            if len(self.output) >= self.params.max_tokens:
                self.finish_reason = "length"
                return


def check_stop_strings(params: SamplingParams) -> None:
    """stop: a string or a list / tuple of non-empty strings, kept as a tuple (the params stay hashable)."""
    stop = params.stop
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop={params.stop!r} must be a list of non-empty strings, e.g. ['\\n\\n', 'User:']")
    object.__setattr__(params, "stop", tuple(stop))


def check_stop_token_ids(params: SamplingParams) -> None:
    """stop_token_ids: a list or tuple of ids >= 0, kept as a tuple (the params stay hashable)."""
    ids = params.stop_token_ids
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
        raise ValueError(f"stop_token_ids={ids!r} must be a list of token ids, e.g. [2] or [2, 32000]")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"stop_token_ids={list(ids)} must hold token ids: ints >= 0")
    object.__setattr__(params, "stop_token_ids", tuple(ids))  # frozen: a list given is kept as a tuple


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_penalties(params: SamplingParams) -> None:
    """repetition_penalty > 0 (finite); presence / frequency_penalty in [-2, 2]; 0 <= min_tokens <= max_tokens."""
    rp = params.repetition_penalty
    if not _is_number(rp) or not 0 < rp < float("inf"):
        raise ValueError(
            f"repetition_penalty={rp!r} must be a finite number > 0: 1 is off, > 1 discourages repeating prompt and "
            "output tokens (e.g. 1.2), < 1 encourages it"
        )
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(params, name)
        if not _is_number(v) or not -2 <= v <= 2:
            raise ValueError(f"{name}={v!r} must be a number in [-2, 2] (OpenAI's range): 0 is off, e.g. 0.5")
    mt = params.min_tokens
    if not isinstance(mt, int) or isinstance(mt, bool) or not 0 <= mt <= params.max_tokens:
        raise ValueError(
            f"min_tokens={mt!r} must be an int in [0, max_tokens={params.max_tokens}]: the tokens generated before "
            "eos or a stop token may end the request; lower it or raise max_tokens"
        )
    for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
        object.__setattr__(params, name, float(getattr(params, name)))  # ints given are kept as floats


def check_logit_bias(params: SamplingParams) -> None:
    """logit_bias: a {token id: bias} dict (or (id, bias) pairs; ids may be digit strings, as OpenAI's JSON sends
    them), at most MAX_LOGIT_BIAS entries, biases in [-100, 100]; kept as a tuple of (id, bias) sorted by id."""
    lb = params.logit_bias
    example = "e.g. {50256: -100} bans token 50256"
    if lb is None:
        lb = ()
    items = lb.items() if isinstance(lb, dict) else lb
    if isinstance(items, (str, bytes)):
        raise ValueError(f"logit_bias={lb!r} must map token ids to biases, {example}")
    try:
        pairs = [tuple(p) for p in items]
    except TypeError:
        raise ValueError(f"logit_bias={lb!r} must map token ids to biases, {example}") from None
    out = {}
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"logit_bias entry {pair!r} must be a (token id, bias) pair, {example}")
        tok, bias = pair
        if isinstance(tok, str) and tok.isdigit():
            tok = int(tok)
        if not isinstance(tok, int) or isinstance(tok, bool) or tok < 0:
            raise ValueError(f"logit_bias key {pair[0]!r} must be a token id (an int >= 0), {example}")
        if not _is_number(bias) or not -100 <= bias <= 100:
            raise ValueError(f"logit_bias[{tok}]={bias!r} must be a number in [-100, 100] (OpenAI's range), {example}")
        if tok in out:
            raise ValueError(f"logit_bias gives token {tok} twice; give each id once")
        out[tok] = float(bias)
    if len(out) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(out)} entries; at most {MAX_LOGIT_BIAS} are allowed, bias fewer tokens")
    object.__setattr__(params, "logit_bias", tuple(sorted(out.items())))
