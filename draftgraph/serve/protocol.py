"""The OpenAI API's request bodies, read into what the engine takes (prompts, SamplingParams), and its errors.

Values are checked by the engine's own SamplingParams and check_request (their ValueErrors become 400s with the
same message); what the engine does not support yet is refused by name, never ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Parameters of the OpenAI API the engine cannot honour yet: refused when set to anything but their default.
MAX_STOP = 4  # stop strings per request (OpenAI's limit)
UNSUPPORTED = {
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "tool_choice": (None, "none"),
}
MAX_N = 64


class ServeError(Exception):
    """An error answered in the OpenAI shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 404: "not_found_error", 503: "server_overloaded", 500: "internal_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "error"),
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass
class Parsed:
    """One completion request: its prompts (text or ids), n choices each, the SamplingParams of each choice."""

    prompts: list[Any]
    n: int
    params: Any  # SamplingParams
    stream: bool
    include_usage: bool

    def choices(self) -> tuple[list, list]:
        """Engine requests: choice i = prompt i // n (OpenAI's order), each with the same params."""
        return [p for p in self.prompts for _ in range(self.n)], [self.params] * (len(self.prompts) * self.n)


def check_model(body: dict, served: str) -> None:
    model = body.get("model")
    if model is not None and model != served:
        raise ServeError(
            404, f"the model {model!r} does not exist; this server serves {served!r} (GET /v1/models)", "model",
            "model_not_found",
        )  # fmt: skip


def _int(body: dict, name: str, default):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ServeError(400, f"{name}={v!r} must be an integer", name)
    return v


def _float(body: dict, name: str, default: float) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ServeError(400, f"{name}={v!r} must be a number", name)
    return float(v)


def read_prompts(prompt: Any) -> list:
    """A completion's `prompt`: a string, a list of strings, a list of token ids, or a list of such lists."""
    how = "a string, a list of strings, a list of token ids, or a list of token-id lists"
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
               for p in prompt):  # fmt: skip
            return [list(p) for p in prompt]
    raise ServeError(400, f"prompt must be {how}, not {str(prompt)[:60]}", "prompt")


def _logprobs(body: dict, chat: bool) -> int | None:
    """The top logprobs to return per token, or None. Completions: `logprobs` is that count. Chat: `logprobs` is
    true or false and `top_logprobs` the count (0..20), which needs logprobs true."""
    lp = body.get("logprobs")
    if not chat:
        return None if lp is None else _int(body, "logprobs", None)
    if lp is not None and not isinstance(lp, bool):
        raise ServeError(400, f"logprobs={lp!r} must be true or false here; the count goes in top_logprobs", "logprobs")
    top = _int(body, "top_logprobs", None)
    if top is not None and not lp:
        raise ServeError(400, f"top_logprobs={top} needs logprobs=true", "top_logprobs")
    return (top or 0) if lp else None


RESPONSE_FORMATS = (
    "{'type': 'text'}, {'type': 'json_object'} (any JSON object) or {'type': 'json_schema', 'json_schema': "
    "{'name': ..., 'schema': {...}}}"
)
# vLLM's extra-body fields of structured output -> SamplingParams' (runtime/grammar.py)
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "grammar"}


def structured(body: dict) -> dict:
    """SamplingParams' json_schema / regex / grammar from OpenAI's `response_format` or vLLM's guided_json /
    guided_regex / guided_grammar (at most one of them); {} when none asks for structured output. The values
    themselves are checked by SamplingParams."""
    out, given = {}, []
    rf = body.get("response_format")
    if rf is not None:
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise ServeError(400, f"response_format={str(rf)[:80]} must be {RESPONSE_FORMATS}", "response_format")
        if kind == "json_object":
            out["json_schema"], given = {"type": "object"}, ["response_format"]
        elif kind == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema") if isinstance(js, dict) else None
            if not isinstance(schema, dict):
                raise ServeError(
                    400, f"response_format.json_schema={str(js)[:80]} needs a 'schema' object: {RESPONSE_FORMATS}",
                    "response_format",
                )  # fmt: skip
            out["json_schema"], given = schema, ["response_format"]
    for name, field in GUIDED.items():
        if body.get(name) is not None:
            given.append(name)
            out[field] = body[name]
    if len(given) > 1:
        raise ServeError(400, f"{' and '.join(given)} are set together; give one form of structured output", given[1])
    if given:
        out["_source"] = given[0]
    return out


def sampling_params(body: dict, default_max_tokens: int, chat: bool = False):
    """SamplingParams from the body (its ValueErrors are the engine's messages: the caller answers 400)."""
    import draftgraph as dg

    for name, defaults in UNSUPPORTED.items():
        if name in body and not any(body[name] == d and type(body[name]) is type(d) or body[name] is d
                                    for d in defaults):  # fmt: skip
            raise ServeError(400, f"{name} is not supported yet; leave it out (or at its default)", name)
    stop = body.get("stop")
    stop = () if stop in (None, "") else stop  # OpenAI: a string or up to 4; SamplingParams checks the values
    if isinstance(stop, list) and len(stop) > MAX_STOP:
        raise ServeError(400, f"stop has {len(stop)} strings; at most {MAX_STOP} are allowed", "stop")
    ids = body.get("stop_token_ids") or []
    max_tokens = _int(body, "max_completion_tokens", None)
    max_tokens = _int(body, "max_tokens", max_tokens if max_tokens is not None else default_max_tokens)
    guided = structured(body)
    source = guided.pop("_source", None)  # the body field a structured-output error names
    try:
        return dg.SamplingParams(
            max_tokens=max_tokens,
            temperature=_float(body, "temperature", 1.0),
            top_p=_float(body, "top_p", 1.0),
            top_k=_int(body, "top_k", 0),
            seed=_int(body, "seed", None),
            stop_token_ids=ids,
            stop=stop,
            include_stop_str_in_output=bool(body.get("include_stop_str_in_output", False)),
            ignore_eos=bool(body.get("ignore_eos", False)),
            logprobs=_logprobs(body, chat),
            presence_penalty=_float(body, "presence_penalty", 0.0),
            frequency_penalty=_float(body, "frequency_penalty", 0.0),
            repetition_penalty=_float(body, "repetition_penalty", 1.0),
            min_tokens=_int(body, "min_tokens", 0),
            logit_bias=body.get("logit_bias") or {},
            **guided,
        )
    except ValueError as e:
        raise ServeError(400, str(e), source if str(e).split("=")[0] in guided else None) from e
    except ImportError as e:  # xgrammar missing (runtime/grammar.py): the server cannot honour it
        raise ServeError(400, str(e), source) from e


def common(body: dict) -> tuple[int, bool, bool]:
    """n, stream and stream_options.include_usage."""
    n = _int(body, "n", 1)
    if not 1 <= n <= MAX_N:
        raise ServeError(400, f"n={n} must lie in [1, {MAX_N}] (completions per prompt)", "n")
    stream = bool(body.get("stream", False))
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise ServeError(400, f"stream_options={opts!r} must be an object, e.g. {{'include_usage': true}}")
    if opts and not stream:
        raise ServeError(400, "stream_options is only allowed with stream=true", "stream_options")
    return n, stream, bool(opts.get("include_usage", False))


def completion_request(body: dict) -> Parsed:
    if "prompt" not in body:
        raise ServeError(400, "a completion request needs a prompt", "prompt")
    prompts = read_prompts(body["prompt"])
    n, stream, usage = common(body)
    return Parsed(prompts, n, sampling_params(body, 16), stream, usage)


def chat_request(body: dict, tokenizer, max_model_len: int) -> Parsed:
    """The messages rendered with the tokenizer's chat template into token ids."""
    ids = render_chat(tokenizer, body.get("messages"))
    n, stream, usage = common(body)
    default = max(1, min(256, max_model_len - len(ids)))  # OpenAI's default is "up to the context"
    return Parsed([ids], n, sampling_params(body, default, chat=True), stream, usage)


def render_chat(tokenizer, messages) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise ServeError(400, "messages must be a non-empty list of {'role': ..., 'content': ...}", "messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ServeError(400, f"each message needs a string role and content; got {str(m)[:80]}", "messages")
    if tokenizer is None:
        raise ServeError(
            400, "chat completions need a tokenizer and this server has none; start it with --tokenizer DIR, or use "
            "/v1/completions with token-id prompts",
        )  # fmt: skip
    if not getattr(tokenizer, "chat_template", None):
        raise ServeError(
            400, "the model's tokenizer has no chat template, so messages cannot be rendered; use /v1/completions "
            "with a prompt, or serve a tokenizer saved with a chat_template (tokenizer_config.json)",
        )  # fmt: skip
    msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
    ids = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    if hasattr(ids, "keys"):  # transformers may return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def token_text(tokenizer, token_id: int) -> str:
    """A token as the logprobs show it: its decoded text, or "token_id:N" without a tokenizer (vLLM's form)."""
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


def logprobs_json(tokens: list[tuple[int, dict[int, float]]], top: int, tokenizer, chat: bool, offset: int = 0):
    """OpenAI's logprobs object for (chosen id, {id: logprob}) per token (RequestOutput.logprobs' entries: the
    top `top` ids first, in order, then the chosen one where it is not among them). Chat: {"content": [{token,
    logprob, bytes, top_logprobs}]}. Completions: {tokens, token_logprobs, top_logprobs, text_offset}, offsets
    counted from `offset` characters."""
    rows = []
    for tok, entry in tokens:
        best = list(entry.items())[:top]
        rows.append((token_text(tokenizer, tok), entry[tok], [(token_text(tokenizer, i), v) for i, v in best]))
    if chat:
        return {
            "content": [
                {"token": s, "logprob": v, "bytes": list(s.encode()),
                 "top_logprobs": [{"token": t, "logprob": w, "bytes": list(t.encode())} for t, w in tops]}
                for s, v, tops in rows
            ]
        }  # fmt: skip
    offsets = []
    for s, _, _ in rows:
        offsets.append(offset)
        offset += len(s)
    return {
        "tokens": [s for s, _, _ in rows],
        "token_logprobs": [v for _, v, _ in rows],
        "top_logprobs": [dict(tops) for _, _, tops in rows],
        "text_offset": offsets,
    }
