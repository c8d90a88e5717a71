"""SamplingParams (what a user asks for), Request (what the engine tracks) and RequestOutput (what returns)."""

from __future__ import annotations

from dataclasses import dataclass, field

from draftgraph.runtime.kv_cache import BlockTable


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
    block_table: BlockTable | None = None
    finish_reason: str | None = None
    stop_ids: frozenset[int] = frozenset()  # eos (unless ignore_eos) + stop_token_ids
    num_verify_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def __post_init__(self):
        self.tokens = list(self.prompt)
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
        )

    def append(self, new_tokens: list[int], stop_ids: frozenset[int]) -> None:
        """Append emitted tokens up to max_tokens or the first stop token (kept in the output)."""
        for tok in new_tokens:
            self.tokens.append(tok)
            self.output.append(tok)
            if tok in stop_ids:
                self.finish_reason = "stop"
                return
            if len(self.output) >= self.params.max_tokens:
                self.finish_reason = "length"
                return


def check_stop_token_ids(params: SamplingParams) -> None:
    """stop_token_ids: a list or tuple of ids >= 0, kept as a tuple (the params stay hashable)."""
    ids = params.stop_token_ids
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
        raise ValueError(f"stop_token_ids={ids!r} must be a list of token ids, e.g. [2] or [2, 32000]")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"stop_token_ids={list(ids)} must hold token ids: ints >= 0")
    object.__setattr__(params, "stop_token_ids", tuple(ids))  # frozen: a list given is kept as a tuple
