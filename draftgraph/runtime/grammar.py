"""Structured output (json_schema, regex, grammar): one xgrammar matcher per request, and the token bitmask the
target's logits are masked with on the device.

xgrammar is imported only when a request asks for structured output (`xgrammar()`; missing, it names the extra to
install). `parsed_grammar` checks a request's schema / regex / EBNF when its SamplingParams is built (no tokenizer
needed); `GrammarState.matcher` compiles it against the engine's tokenizer (one `TokenizerInfo` with the target's
vocabulary size, one `GrammarCompiler` per engine, compiled grammars cached) when the request is added.

Exact under speculation: verify row i of a request sees drafts 0..i-1 as generated. Before a step, `fill` writes
row 0 of a request from its matcher's state, then advances the matcher through draft i and writes row i + 1, and
rolls back what it advanced (a draft the grammar refuses ends the walk: its row forbids it, so the target rejects
it there, and the rows after it are never emitted from; they allow everything, as do the rows of requests without
a grammar and of padding). After the step the request's matcher advances through the tokens it emitted
(`RequestGrammar.advance`, from Request.append); once it accepts one of its stop tokens it has terminated and the
request finishes with "stop". Its stop tokens are the request's (eos unless ignore_eos, and stop_token_ids), else
the tokenizer's eos.

On the device the bitmask ([rows, ceil(V / 32)] int32 words, bit j of word w: token 32 w + j) is a buffer made with
the first request that asks for structured output and read in place by the steps (the one-graph step's "_grammar"
variants); `apply` sets the forbidden tokens' logits to -inf after the penalties, before acceptance and sampling:
greedy picks an allowed token, and rejection sampling stays lossless with respect to the masked target.

The drafter proposes from its raw logits: the state after a step's new token is known on the host only after the
step (whose draft loop runs on the device in the same graph), so drafts are not masked; exactness comes from the
target's mask. A drafter close to the target then proposes what the unmasked target prefers, which the grammar
often refuses: before each step, a request's refused drafts are replaced on the host by the first token of the
text the grammar forces there (`repair`; forced keys and punctuation of a JSON schema: acceptance 0.02 -> 0.78
with a draft model that copies a random target). Greedy output does not depend on the drafts; a sampled request's
replaced draft gets a one-hot draft distribution, so its acceptance stays lossless. Only steps with a grammar wait
for the host between steps (the next verify's rows need the drafts the last step proposed): runtime/engine.py does
not overlap them.
"""

from __future__ import annotations

import functools
import json
import re

import torch

STRUCTURED_FIELDS = ("json_schema", "regex", "grammar")
HOW_TO_INSTALL = "pip install draftgraph[structured]"
_XGR_PREFIX = re.compile(r"^\s*\[[^\]]*\]\s*\S+:\d+:\s*")  # xgrammar's "[time] file.cc:line: " before a message


def xgrammar():
    """The xgrammar module, imported on first use."""
    try:
        import xgrammar as xgr
    except ImportError as e:
        raise ImportError(
            f"structured output (json_schema, regex, grammar) needs the xgrammar package, which is not installed "
            f"({e}); install it with `{HOW_TO_INSTALL}`"
        ) from e
    return xgr


def _message(e: Exception) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return _XGR_PREFIX.sub("", lines[0] if lines else type(e).__name__).rstrip(".")


_EXAMPLES = {
    "json_schema": "e.g. {'type': 'object', 'properties': {'name': {'type': 'string'}}, 'required': ['name']}",
    "regex": "e.g. '(yes|no)' or '[0-9]{3}-[0-9]{4}'",
    "grammar": 'an EBNF in xgrammar\'s syntax with a root rule, e.g. \'root ::= "yes" | "no"\'',
}


@functools.lru_cache(maxsize=256)
def parsed_grammar(kind: str, spec: str):
    """xgrammar's Grammar for a request's structured output: `kind` one of STRUCTURED_FIELDS, `spec` its text (a
    JSON schema as JSON text). JSON schemas are compact: no whitespace beyond ", " and ": " (xgrammar's
    any_whitespace=False), so a model cannot stall in blanks. A ValueError names the field, the problem and the
    fix."""
    xgr = xgrammar()
    try:
        if kind == "json_schema":
            return xgr.Grammar.from_json_schema(spec, any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        return xgr.Grammar.from_ebnf(spec)
    except (RuntimeError, ValueError, TypeError) as e:
        what = {"json_schema": "a JSON schema", "regex": "a regular expression", "grammar": "an EBNF grammar"}[kind]
        raise ValueError(
            f"{kind}={spec[:80]!r} is not {what} xgrammar can compile: {_message(e)}; fix it, {_EXAMPLES[kind]}"
        ) from None


def check_structured(params) -> None:
    """json_schema (a dict, or its JSON text), regex and grammar (strings): at most one, parsed now; json_schema is
    kept as JSON text so the params stay hashable."""
    given = [f for f in STRUCTURED_FIELDS if getattr(params, f) is not None]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} are set together; give at most one of json_schema, regex and grammar")
    if not given:
        return
    kind = given[0]
    spec = getattr(params, kind)
    if params.min_tokens:
        raise ValueError(
            f"min_tokens={params.min_tokens} with {kind}: once the {kind} is complete it allows only a stop token, "
            "which min_tokens holds back, leaving no token to choose; leave min_tokens at 0"
        )
    if kind == "json_schema":
        if isinstance(spec, str):
            try:
                schema = json.loads(spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema={spec[:80]!r} is not valid JSON ({e}); {_EXAMPLES[kind]}") from None
        else:
            schema = spec
        if not isinstance(schema, dict):
            raise ValueError(f"json_schema={str(spec)[:80]} must be a JSON schema object (a dict), {_EXAMPLES[kind]}")
        try:
            spec = json.dumps(schema)
        except (TypeError, ValueError) as e:
            why = f"json_schema is not JSON-serializable ({e})"
            raise ValueError(f"{why}; give dicts, lists, strings and numbers") from None
        object.__setattr__(params, "json_schema", spec)
    elif not isinstance(spec, str) or not spec:
        raise ValueError(f"{kind}={spec!r} must be a non-empty string, {_EXAMPLES[kind]}")
    parsed_grammar(kind, spec)


class RequestGrammar:
    """A request's matcher (xgrammar GrammarMatcher) at the state after its output so far; `encode`: text -> ids
    (the engine's tokenizer, no special tokens), for `repaired`."""

    def __init__(self, matcher, request_id: int, encode=None):
        self.matcher, self.request_id, self.encode = matcher, request_id, encode

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def advance(self, token: int) -> bool:
        """Accept an emitted token; returns whether the matcher has terminated (it accepted a stop token)."""
        if not self.matcher.accept_token(token):
            raise RuntimeError(
                f"request {self.request_id} emitted token {token}, which its grammar forbids: its logits were not "
                "masked (a step without the grammar bitmask ran it)"
            )
        return self.matcher.is_terminated()

    def repaired(self, drafts: list[int]) -> list[int]:
        """`drafts` with each one the grammar refuses replaced by the first token of the text the grammar forces
        there (xgrammar's jump-forward string), where it forces some: drafts are only proposals (a greedy output is
        the target's choice whatever they are; a sampled one keeps its distribution when the proposal's probability
        is known: `GrammarState.repair`), and a forced token is a better one than a refused token, which the target
        rejects for sure. Drafts after one that cannot be replaced stay as they are."""
        m, out, walked = self.matcher, [int(d) for d in drafts], 0
        for i, d in enumerate(out):
            if m.is_terminated():
                break
            if not m.accept_token(int(d)):
                forced = m.find_jump_forward_string() if self.encode is not None else ""
                ids = self.encode(forced) if forced else []
                if not ids or not m.accept_token(ids[0]):
                    break
                out[i] = ids[0]
            walked += 1
        if walked:
            m.rollback(walked)
        return out

    def fill(self, host: torch.Tensor, row: int, drafts) -> None:
        """Rows row..row + len(drafts) of `host`: the allowed tokens after drafts[:i] for row + i, as far as the
        grammar accepts the drafts (later rows are left as they are: all allowed)."""
        m = self.matcher
        m.fill_next_token_bitmask(host, row)
        walked = 0
        for i, d in enumerate(drafts):
            if not m.accept_token(int(d)):
                break
            walked += 1
            if m.is_terminated():  # a stop token: the request ends there, nothing after it is emitted
                break
            m.fill_next_token_bitmask(host, row + i + 1)
        if walked:
            m.rollback(walked)


class GrammarState:
    """The engine's grammar side: tokenizer info and compiler (made on first use), the bitmask buffers."""

    def __init__(self, rows: int, vocab_size: int, device):
        self.rows, self.vocab_size, self.device = rows, vocab_size, torch.device(device)
        self.words = (vocab_size + 31) // 32
        # The grammar's vocabulary: the tokenizer's ids (set with the first matcher). A model's LM head is often
        # padded past them (Qwen: 151936 rows, 151665 ids). The padding ids stay out of xgrammar's vocabulary,
        # whose mask fill and token checks cost about 200x more with them (537 against 2.4 us a row on the CPU for a
        # 300-id tokenizer under a 128256-row head); `fill` forbids them in a grammar's rows itself.
        self.grammar_vocab = vocab_size
        self.allocated = False  # the buffers come with the first request that asks for structured output
        self._compiler = None  # (tokenizer, TokenizerInfo, GrammarCompiler)
        self._compiled: dict[tuple[str, str], object] = {}

    def _allocate(self) -> None:
        """The device bitmask (graphs read it in place: never reallocated) and its host twin (pinned on CUDA)."""
        shape, pin = (self.rows, self.words), self.device.type == "cuda"
        self.bitmask = torch.full(shape, -1, dtype=torch.int32, device=self.device)
        host = torch.full(shape, -1, dtype=torch.int32)
        self.host = host.pin_memory() if pin else host
        self.scratch = torch.full((self.rows, (self.grammar_vocab + 31) // 32), -1, dtype=torch.int32)  # xgrammar's
        self._shifts = torch.arange(8, dtype=torch.uint8, device=self.device)
        self.allocated = True

    # ---- the host side ------------------------------------------------------------------------------

    def matcher(self, tokenizer, params, stop_ids: frozenset[int], request_id: int) -> RequestGrammar:
        """A matcher for a request's structured output (params.structured), compiled for `tokenizer`."""
        xgr = xgrammar()
        if self._compiler is None or self._compiler[0] is not tokenizer:
            vocab = min(len(tokenizer), self.vocab_size) if not self.allocated else self.grammar_vocab
            try:
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
            except Exception as e:  # noqa: BLE001 - xgrammar raises what the tokenizer's internals raise
                raise ValueError(
                    f"structured output needs a transformers tokenizer xgrammar can read; the engine's "
                    f"{type(tokenizer).__name__} failed ({_message(e)}); pass compile_model(..., tokenizer=DIR)"
                ) from e
            self._compiler = (tokenizer, info, xgr.GrammarCompiler(info))
            self._compiled.clear()
            self.grammar_vocab = vocab
        _, info, compiler = self._compiler
        kind, spec = params.structured
        compiled = self._compiled.get((kind, spec))
        if compiled is None:
            compiled = compiler.compile_grammar(parsed_grammar(kind, spec))
            self._compiled[(kind, spec)] = compiled
        stops = sorted(stop_ids) or list(info.stop_token_ids)
        if not stops:
            raise ValueError(
                f"{kind} needs a stop token to end on, and the request has none (no eos: the model and tokenizer "
                "define none, or ignore_eos is set); give stop_token_ids, e.g. [2]"
            )
        if not self.allocated:
            self._allocate()
        encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        return RequestGrammar(xgr.GrammarMatcher(compiled, override_stop_tokens=stops), request_id, encode)

    def repair(self, decodes, draft_probs: torch.Tensor | None) -> None:
        """Before a step: the drafts of requests with a grammar, repaired (`RequestGrammar.repaired`). A sampled
        request's replaced draft gets a one-hot draft distribution (its row of `draft_probs` [slots, K, V], which
        its acceptance reads): a deterministic proposal t is accepted with probability p(t) and on rejection the
        residual is p without t, so the emitted token still follows the masked target p."""
        for r in decodes:
            if r.grammar is None or not r.drafts:
                continue
            new = r.grammar.repaired(r.drafts)
            if r.params.temperature > 0:
                if draft_probs is None:
                    continue
                for j in (j for j, (a, b) in enumerate(zip(r.drafts, new)) if a != b):
                    draft_probs[r.slot, j].zero_()
                    draft_probs[r.slot, j, new[j]] = 1.0
            r.drafts = new

    def fill(self, layout, num_rows: int) -> None:
        """The bitmask rows of a step, sent to the device: `layout` lists (request, rows) in row order (a verify:
        1 + K rows after its drafts; a last prefill chunk: 1 row); rows of requests without a grammar and rows past
        the layout allow every token."""
        if num_rows > self.rows:
            raise ValueError(f"a step with {num_rows} sampled rows exceeds the grammar bitmask's {self.rows} rows")
        host = self.host[:num_rows]
        host.fill_(-1)
        row = 0
        gw = self.scratch.shape[1]
        for req, n in layout:
            if req.grammar is not None:
                self.scratch[row : row + n].fill_(-1)
                req.grammar.fill(self.scratch, row, req.drafts[: n - 1] if n > 1 else ())
                host[row : row + n, :gw] = self.scratch[row : row + n]
                host[row : row + n, gw:] = 0  # the LM head's padding ids: never in a grammar's output
                if self.grammar_vocab % 32:  # nor the padding ids that share the last grammar word
                    host[row : row + n, gw - 1] &= (1 << (self.grammar_vocab % 32)) - 1
            row += n
        self.bitmask[:num_rows].copy_(host, non_blocking=True)

    # ---- the device side ----------------------------------------------------------------------------

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., V] (rows in the order `fill` wrote) with the tokens the bitmask forbids at -inf."""
        v = logits.shape[-1]
        n = logits.numel() // v
        # int32 words viewed as little-endian bytes: bit j of byte c is token 8 c + j
        words = self.bitmask[:n].view(torch.uint8)  # [n, 4 W]
        allowed = ((words[:, :, None] >> self._shifts) & 1).view(n, -1)[:, :v]  # [n, 32 W] -> [n, V]
        return logits.masked_fill(allowed.view(logits.shape) == 0, float("-inf"))
