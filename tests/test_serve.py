"""`draftgraph serve` on the CPU, through the official `openai` client: one server process for the module (mode
NONE, a tiny target with a 2-layer draft model cut from it, a byte-level BPE tokenizer trained here), on a free
port of 127.0.0.1. The oracle is `engine.generate` in this process on the same checkpoints and config: greedy
speculative decoding is lossless, so every served text must equal it, and a request stopped after m tokens must
equal the first m reference tokens decoded."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import draftgraph as dg
from draftgraph.models.builtin import BuiltinSpec, builtin_hf_target
from tests.test_text import train_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = "tiny"
K = 2
ENGINE = dict(mode="NONE", num_speculative_tokens=K, device="cpu", max_num_seqs=8, max_num_batched_tokens=128,
              max_model_len=128, drafter_kind="draft_model")  # fmt: skip
PROMPTS = ["hello world", "the quick brown fox", "speculative decoding"]
MAX = 12
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"  # noqa: E501
STARTUP_S = 300


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(target dir, drafter dir, tokenizer): the built-in target (no eos) with the tokenizer and a chat template
    saved beside it, and a draft model of its first 2 layers (the same weights)."""
    root = tmp_path_factory.mktemp("serve")
    tok = train_tokenizer()
    tok.chat_template = TEMPLATE
    spec = BuiltinSpec(vocab_size=len(tok))
    hf = builtin_hf_target(spec)
    hf.generation_config.eos_token_id = None
    hf.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    hf.model.layers = hf.model.layers[:2]
    hf.config.num_hidden_layers = 2
    hf.save_pretrained(root / "drafter")
    return str(root / "target"), str(root / "drafter"), tok


@pytest.fixture(scope="module")
def engine(ckpts):
    target, drafter, _ = ckpts
    with dg.compile_model(target, drafter, dg.CompileConfig(**ENGINE)) as e:
        yield e


@pytest.fixture(scope="module")
def reference(engine):
    """Greedy ids of each prompt, MAX tokens."""
    return [o.token_ids for o in engine.generate(PROMPTS, dg.SamplingParams(max_tokens=MAX))]


class Server:
    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines, self.url = proc, [], None
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:  # ends when the process closes its output
            self.lines.append(line)
            if line.startswith("serving ") and "http://" in line:
                self.url = line.split("http://")[1].split()[0]
                self.ready.set()
        self.ready.set()

    def output(self) -> str:
        return "".join(self.lines)


@pytest.fixture(scope="module")
def server(ckpts):
    target, drafter, _ = ckpts
    cmd = [sys.executable, "-m", "draftgraph", "serve", "--target", target, "--drafter", drafter, "--drafter-kind",
           "draft_model", "-k", str(K), "--mode", "NONE", "--device", "cpu", "--max-num-seqs", "8",
           "--max-num-batched-tokens", "128", "--max-model-len", "128", "--host", "127.0.0.1", "--port", "0",
           "--served-model-name", NAME]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    srv = Server(proc)
    try:
        assert srv.ready.wait(STARTUP_S) and srv.url, f"the server did not start:\n{srv.output()}"
        base = f"http://{srv.url}"
        deadline = time.monotonic() + 60
        while httpx.get(f"{base}/health").status_code != 200:
            assert time.monotonic() < deadline, "GET /health never answered 200"
            time.sleep(0.2)
        srv.url = base
        yield srv
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def metrics(server) -> dict[str, float]:
    """/metrics parsed as Prometheus text: sample name (with labels) -> value."""
    text = httpx.get(f"{server.url}/metrics").text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_serve_takes_every_engine_flag_of_generate():
    from tests.test_cli import _parsers

    _, commands = _parsers()
    flags = {name: {o for a in commands[name]._actions for o in a.option_strings} for name in ("generate", "serve")}
    # generate's own request and workload flags are per request in the server (the JSON body)
    per_request = {"--num-prompts", "--prompt-len", "--max-tokens", "--temperature", "--top-k", "--top-p", "--prompt",
                   "--prompts-file", "--stream", "--ignore-eos", "--stop-token-ids", "--profile"}  # fmt: skip
    assert flags["generate"] - per_request <= flags["serve"]
    assert {"--host", "--port", "--served-model-name", "--max-queue"} <= flags["serve"]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_completions_equal_generate(client, ckpts, reference):
    tok = ckpts[2]
    got = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=MAX, temperature=0)
    assert [c.index for c in got.choices] == [0, 1, 2]
    for c, ref in zip(got.choices, reference):
        assert c.token_ids == ref and c.finish_reason == "length"
        assert c.text == tok.decode(ref, skip_special_tokens=True)
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    assert got.usage.prompt_tokens == sum(map(len, prompt_ids)) and got.usage.completion_tokens == 3 * MAX
    spec = got.usage.spec_decode  # the extension block: K drafts per verify step
    assert spec["draft_tokens"] == K * spec["verify_steps"] and 0 <= spec["accepted_tokens"] <= spec["draft_tokens"]
    assert spec["mean_accepted_length"] == pytest.approx(1 + spec["accepted_tokens"] / spec["verify_steps"])
    # token-id prompts, one and several
    one = client.completions.create(model=NAME, prompt=prompt_ids[1], max_tokens=MAX, temperature=0)
    assert one.choices[0].token_ids == reference[1]
    many = client.completions.create(model=NAME, prompt=prompt_ids[::-1], max_tokens=MAX, temperature=0, n=2)
    assert [c.token_ids for c in many.choices] == [r for r in reference[::-1] for _ in range(2)]


def test_chat_equals_generate(client, ckpts, engine):
    tok = ckpts[2]
    messages = [{"role": "user", "content": "hello world"}]
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    ref = engine.generate([list(ids)], dg.SamplingParams(max_tokens=MAX))[0]
    got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=MAX, temperature=0)
    assert got.choices[0].message.role == "assistant" and got.choices[0].message.content == ref.text
    assert got.usage.prompt_tokens == len(ids) and got.choices[0].finish_reason == "length"
    chunks = client.chat.completions.create(model=NAME, messages=messages, max_tokens=MAX, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text


def test_streamed_chunks_join_to_the_same_text(client, ckpts, reference):
    tok = ckpts[2]
    stream = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=MAX, temperature=0, stream=True,
                                       stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == tok.decode(reference[0], skip_special_tokens=True)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == MAX  # the usage chunk comes last
    # The raw stream: SSE data lines, ending with [DONE].
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{client.base_url}completions", json=body, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_stop_strings_cut_the_text_and_the_stream(client, ckpts, reference):
    tok = ckpts[2]
    full = tok.decode(reference[1], skip_special_tokens=True)
    stop = next(full[i : i + 2] for i in range(len(full) // 2, len(full) - 1) if "\ufffd" not in full[i : i + 2])
    want = full[: full.find(stop)]
    got = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=MAX, temperature=0, stop=stop)
    assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=MAX, temperature=0, stop=[stop],
                                       stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want


def test_logprobs_are_the_engines_in_openai_shape(client, ckpts, engine):
    """completions `logprobs=N` and chat `logprobs`/`top_logprobs`, whole and streamed: the engine's values for
    the same request (the target's raw logits), each chosen token's and its top N."""
    tok = ckpts[2]
    ref = engine.generate([PROMPTS[0]], dg.SamplingParams(max_tokens=MAX, logprobs=3))[0]
    chosen = [lp[t] for t, lp in zip(ref.token_ids, ref.logprobs)]
    got = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=MAX, temperature=0, logprobs=3)
    lp = got.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(chosen, abs=1e-6)
    assert lp.tokens == [tok.decode([t]) for t in ref.token_ids]
    for top, entry in zip(lp.top_logprobs, ref.logprobs):  # the engine's top 3, keyed by their text
        assert top == pytest.approx({tok.decode([i]): v for i, v in list(entry.items())[:3]}, abs=1e-6)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=MAX, temperature=0,
                                            logprobs=3, stream=True))  # fmt: skip
    streamed = [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(chosen, abs=1e-6)
    messages = [{"role": "user", "content": "hello world"}]
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    cref = engine.generate([list(ids)], dg.SamplingParams(max_tokens=MAX, logprobs=2))[0]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=MAX, temperature=0,
                                          logprobs=True, top_logprobs=2)  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([lp[t] for t, lp in zip(cref.token_ids, cref.logprobs)])
    assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_penalties_and_logit_bias_reach_the_engine(client, ckpts, engine):
    """OpenAI's presence/frequency penalties, logit_bias (string ids, as JSON sends them), and the extensions
    repetition_penalty and min_tokens: the server's tokens equal engine.generate with the same SamplingParams."""
    kw = dict(presence_penalty=0.5, frequency_penalty=0.8)
    ref = engine.generate([PROMPTS[2]], dg.SamplingParams(max_tokens=MAX, **kw))[0]
    got = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=MAX, temperature=0, **kw)
    assert got.choices[0].token_ids == ref.token_ids
    rep = engine.generate([PROMPTS[2]], dg.SamplingParams(max_tokens=MAX, repetition_penalty=1.5, min_tokens=3))[0]
    got = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=MAX, temperature=0,
                                    extra_body={"repetition_penalty": 1.5, "min_tokens": 3})  # fmt: skip
    assert got.choices[0].token_ids == rep.token_ids
    forced = 7
    got = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=4, temperature=0,
                                    logit_bias={str(forced): 100})  # fmt: skip
    assert got.choices[0].token_ids == [forced] * 4


def test_response_format_and_guided_fields_reach_the_engine(client, engine):
    """OpenAI's response_format (json_schema) and vLLM's guided_regex: the served text validates / matches, finishes
    with "stop", and its tokens equal engine.generate with the same SamplingParams; bad values are 400s that name
    the field."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["fox", "dog"]}},
              "required": ["ok", "tag"], "additionalProperties": False}  # fmt: skip
    messages = [{"role": "user", "content": "json please"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    got = client.chat.completions.create(model=NAME, messages=messages, max_tokens=40, temperature=0,
                                         response_format=fmt)  # fmt: skip
    value = json.loads(got.choices[0].message.content)
    assert set(value) == {"ok", "tag"} and isinstance(value["ok"], bool) and value["tag"] in ("fox", "dog")
    assert got.choices[0].finish_reason == "stop"
    ref = engine.generate([PROMPTS[1]], dg.SamplingParams(max_tokens=16, regex="(yes|no)-[a-c]{1,3}"))[0]
    got = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=16, temperature=0,
                                    extra_body={"guided_regex": "(yes|no)-[a-c]{1,3}"})  # fmt: skip
    assert got.choices[0].token_ids == ref.token_ids and got.choices[0].finish_reason == ref.finish_reason == "stop"
    cases = [
        (dict(extra_body={"response_format": {"type": "xml"}}), "response_format={'type': 'xml'} must be",
         "response_format"),
        (dict(extra_body={"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}),
         "is not a JSON schema xgrammar can compile", "response_format"),
        (dict(extra_body={"guided_regex": "(ab"}), "is not a regular expression", "guided_regex"),
        (dict(extra_body={"guided_regex": "a", "guided_grammar": "root ::= \"a\""}), "set together", "guided_grammar"),
    ]  # fmt: skip
    for kw, message, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=4, **kw)
        err = e.value.body
        assert e.value.status_code == 400 and message in err["message"] and err["param"] == param, (kw, err)


def test_32_concurrent_streams_each_get_their_own_text(server, ckpts, reference):
    tok = ckpts[2]
    # Request i: prompt i % 3, i % 5 + 4 tokens (the reference's first tokens: greedy decoding is a prefix).
    cases = [(i % 3, i % 5 + 4) for i in range(32)]

    async def one(client, p, m):
        stream = await client.completions.create(model=NAME, prompt=PROMPTS[p], max_tokens=m, temperature=0,
                                                 stream=True)  # fmt: skip
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:  # fmt: skip
            return await asyncio.wait_for(asyncio.gather(*(one(client, p, m) for p, m in cases)), 600)

    texts = asyncio.run(run())
    assert texts == [tok.decode(reference[p][:m], skip_special_tokens=True) for p, m in cases]


def test_a_client_that_disconnects_frees_its_blocks(server):
    before = metrics(server)
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 100, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")  # generating
        during = metrics(server)
    # The connection is closed: the server aborts the request and its blocks go back.
    assert during["draftgraph_kv_blocks_used"] > 0 and during["draftgraph_requests_in_flight"] == 1
    deadline = time.monotonic() + 60
    while (m := metrics(server))["draftgraph_kv_blocks_used"] != 0 or m["draftgraph_requests_in_flight"] != 0:
        assert time.monotonic() < deadline, f"the disconnected request still holds blocks: {m}"
        time.sleep(0.1)
    assert m["draftgraph_requests_aborted_total"] == before["draftgraph_requests_aborted_total"] + 1
    # aborted in the engine, not run to its 100 tokens (a CPU step takes milliseconds; the abort, one step)
    assert m["draftgraph_engine_generated_tokens"] - before["draftgraph_engine_generated_tokens"] < 100
    assert m["draftgraph_requests_running"] == 0 and m["draftgraph_requests_waiting"] == 0


def test_bad_values_get_400_with_the_engines_message(client):
    cases = [
        (dict(temperature=-1), "temperature=-1.0 must be >= 0"),
        (dict(top_p=1.5), "top_p=1.5 must lie in (0, 1]"),
        (dict(max_tokens=1000), "exceeds max_model_len=128"),
        (dict(stop=["fox", ""]), "must be a list of non-empty strings"),
        (dict(n=0), "n=0 must lie in [1, 64]"),
        (dict(prompt=[[1, 2, 100000]]), "lie outside the vocabulary"),
        (dict(extra_body={"top_k": -2}), "top_k=-2 must be >= 1"),
        (dict(presence_penalty=3), "presence_penalty=3.0"),
        (dict(logit_bias={"5": 500}), "logit_bias"),
        (dict(logprobs=50), "logprobs=50"),
    ]
    for kw, message in cases:
        args = dict(model=NAME, prompt=PROMPTS[0], max_tokens=4) | kw
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**args)
        err = e.value.body
        assert e.value.status_code == 400 and message in err["message"], (kw, err)
        assert err["type"] == "invalid_request_error" and set(err) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-nothing", prompt="hi", max_tokens=2)
    assert "'gpt-nothing' does not exist" in e.value.body["message"] and e.value.body["code"] == "model_not_found"
    # The server still serves after its refusals.
    assert client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=2, temperature=0).choices[0].text


def test_metrics_parse_as_prometheus_text(server, client):
    client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=MAX, temperature=0)
    m = metrics(server)
    assert m["draftgraph_kv_blocks_free"] > 0 and m["draftgraph_kv_blocks_used"] == 0
    assert m["draftgraph_prompt_tokens_total"] > 0 and m["draftgraph_generation_tokens_total"] >= MAX
    assert 0 <= m["draftgraph_spec_acceptance_rate"] <= 1 and m["draftgraph_spec_mean_accepted_length"] >= 1
    assert {f"draftgraph_spec_acceptance_by_position{{position={i}}}" for i in range(K)} <= set(m)
    assert m[f"draftgraph_spec_steps_by_k{{k={K}}}"] > 0  # fixed K: every step verified K drafts
    assert m["draftgraph_forwards{key=target/none}"] > 0  # mode NONE: every forward runs without a graph
    for h in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert m[f"draftgraph_{h}_count"] > 0
    # the same long prompt twice: the second finds the first one's full blocks in the prefix cache
    long = " ".join([PROMPTS[1]] * 12)
    for _ in range(2):
        client.completions.create(model=NAME, prompt=long, max_tokens=2, temperature=0)
    after = metrics(server)
    assert after["draftgraph_prefix_cache_hit_tokens"] - m["draftgraph_prefix_cache_hit_tokens"] >= 16
    assert after["draftgraph_prefix_cache_query_tokens"] > after["draftgraph_prefix_cache_hit_tokens"]


def test_no_chat_template_is_a_clear_400(ckpts):
    from draftgraph.serve.protocol import ServeError, render_chat

    tok = train_tokenizer()  # saved without a template
    with pytest.raises(ServeError, match="has no chat template") as e:
        render_chat(tok, [{"role": "user", "content": "hi"}])
    assert e.value.status == 400 and e.value.body()["error"]["type"] == "invalid_request_error"


def test_health_is_503_while_the_engine_loads(engine):
    """The HTTP server answers before the engine is built: /health and the API say 503 (loading), then /health
    answers 200 and requests are served. The build waits on a gate the test opens (the module's engine)."""
    from draftgraph.serve.server import bind, make_server

    gate = threading.Event()

    def make_engine():
        gate.wait()
        return engine

    sock = bind("127.0.0.1", 0)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = make_server(make_engine, NAME, max_queue=8)
    http = threading.Thread(target=server.http.run, kwargs={"sockets": [sock]}, daemon=True)
    server.loop.start()
    http.start()
    try:
        for _ in range(1000):  # uvicorn starts answering on the bound socket
            if server.http.started:
                break
            time.sleep(0.05)
        r = httpx.get(f"{base}/health")
        assert r.status_code == 503 and r.json() == {"status": "loading", "message": "the engine is loading"}
        body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 2}
        r = httpx.post(f"{base}/v1/completions", json=body)
        assert r.status_code == 503 and r.json()["error"]["code"] == "loading"
        assert "the engine is loading" in r.json()["error"]["message"]
        gate.set()
        assert server.loop.ready.wait(120)
        assert httpx.get(f"{base}/health").status_code == 200
        r = httpx.post(f"{base}/v1/completions", json=body | {"temperature": 0}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        gate.set()
        server.http.should_exit = True
        http.join(30)
        server.loop.stop()
        sock.close()


def test_sigterm_drains_and_stops_the_server(server):
    """Last in the module: the server's stream in flight ends with [DONE], then the process exits 0."""
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 40, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line).startswith("data: ")
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
    rc = server.proc.wait(timeout=60)
    assert rc == 0, server.output()
    assert "server stopped" in server.output()
