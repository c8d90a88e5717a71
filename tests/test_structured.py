"""Structured output under speculation (runtime/grammar.py; CPU, a draft model at K = 3, NONE and FULL_AND_PIECEWISE,
the checkpoint, tokenizer and engines of tests/test_stop_strings.py).

Oracle: a greedy loop over transformers' logits of the same weights, masked by a fresh xgrammar matcher per token
(no speculation): the engine's greedy structured outputs equal it token for token, so every verify row was masked
after the drafts before it. Every structured output matches its regex / validates against its schema / parses by
its grammar and finishes with "stop"; a request without a grammar in the same batch gives transformers' plain
greedy tokens; uniform batches with grammars run the one-graph step's "_grammar" variants."""

import json
import re

import pytest
import torch
import transformers

import draftgraph as dg
from draftgraph.runtime import grammar as grammar_mod
from draftgraph.runtime.grammar import GrammarState, parsed_grammar, xgrammar
from tests.test_stop_strings import ckpt, engine  # noqa: F401 - the module's fixtures, reused

K = 3
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "tag": {"enum": ["fox", "dog"]},
    },
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}
REGEX = "(yes|no)-[a-c]{1,3}"
EBNF = 'root ::= item ("," item){0,2}\nitem ::= "fox" | "dog" | [0-9]'
EBNF_AS_REGEX = "(fox|dog|[0-9])(,(fox|dog|[0-9])){0,2}"
PROMPTS = ["hello world", "the quick brown fox", "speculative decoding", "hello world"]
PARAMS = [
    dg.SamplingParams(max_tokens=24, regex=REGEX, ignore_eos=True),  # no eos: ends on the tokenizer's </s>
    dg.SamplingParams(max_tokens=48, json_schema=SCHEMA),
    dg.SamplingParams(max_tokens=24, grammar=EBNF, temperature=0.8, seed=3),
    dg.SamplingParams(max_tokens=12),  # no grammar: plain greedy, as alone
]
ARRIVALS = [0, 0, 1, 1]  # mixed steps (prefills beside verifies) first, uniform verify batches after


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bool [rows, vocab] from xgrammar's int32 bitmask words (bit j of word w: token 32 w + j)."""
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab].bool()


def masked_greedy(hf, tok, prompt: str, p: dg.SamplingParams, stops: list[int], vocab: int) -> list[int]:
    """transformers' greedy tokens, masked at each position by a matcher advanced through the output so far."""
    xgr = xgrammar()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    matcher = xgr.GrammarMatcher(
        xgr.GrammarCompiler(info).compile_grammar(parsed_grammar(*p.structured)), override_stop_tokens=stops
    )
    ids, out = tok(prompt).input_ids, []
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    while len(out) < p.max_tokens and not matcher.is_terminated():
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out])).logits[0, -1]
        matcher.fill_next_token_bitmask(bitmask, 0)
        t = int(logits.masked_fill(~allowed_tokens(bitmask, vocab)[0], float("-inf")).argmax())
        assert matcher.accept_token(t)
        out.append(t)
    return out


def check_schema(value, schema=SCHEMA) -> None:
    try:
        import jsonschema
    except ImportError:  # by hand: the required keys and their types
        assert isinstance(value, dict) and set(value) == set(schema["required"])
        assert isinstance(value["ok"], bool) and value["tag"] in ("fox", "dog")
        assert isinstance(value["n"], int) and not isinstance(value["n"], bool) and 0 <= value["n"] <= 99
        return
    jsonschema.validate(value, schema)


@pytest.fixture(scope="module")
def hf(ckpt):  # noqa: F811
    return transformers.AutoModelForCausalLM.from_pretrained(ckpt[0], local_files_only=True).eval()


@pytest.fixture(scope="module")
def run(engine):  # noqa: F811
    """The mixed batch, then the JSON request alone (batch 1)."""
    mixed = engine.generate(PROMPTS, PARAMS, ARRIVALS)
    stats = engine.stats()
    alone = engine.generate([PROMPTS[1]], PARAMS[1])[0]
    return mixed, stats, alone, engine.stats()


def test_structured_outputs_match_and_equal_masked_greedy(engine, ckpt, hf, run):  # noqa: F811
    tok, vocab = ckpt[1], engine.vocab_size
    mixed, stats, alone, alone_stats = run
    eos = sorted(engine.eos_token_ids)
    # regex (ignore_eos: the grammar ends on the tokenizer's eos); the schema; the sampled EBNF
    assert re.fullmatch(REGEX, mixed[0].text) and mixed[0].finish_reason == "stop"
    assert mixed[0].token_ids[-1] == tok.eos_token_id
    assert mixed[0].token_ids == masked_greedy(hf, tok, PROMPTS[0], PARAMS[0], [tok.eos_token_id], vocab)
    for out in (mixed[1], alone):
        check_schema(json.loads(out.text))
        assert out.finish_reason == "stop" and out.token_ids[-1] in eos
        assert out.token_ids == masked_greedy(hf, tok, PROMPTS[1], PARAMS[1], eos, vocab)
    assert re.fullmatch(EBNF_AS_REGEX, mixed[2].text) and mixed[2].finish_reason == "stop"
    # the request without a grammar: transformers' plain greedy, as alone
    ids = torch.tensor([tok(PROMPTS[3]).input_ids])
    with torch.no_grad():
        plain = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                            min_new_tokens=12, eos_token_id=None)[0, ids.shape[1] :].tolist()  # fmt: skip
    assert mixed[3].token_ids == plain and mixed[3].finish_reason == "length"
    # The drafter is the target's copy: it proposes what the unmasked target prefers, which the grammar mostly
    # refuses; greedy requests' refused drafts are replaced by the tokens the grammar forces (RequestGrammar.repaired)
    assert stats["draft_tokens"] > 0 and alone_stats["acceptance_rate"] > 0.5, alone_stats["acceptance_rate"]


SAMPLED_REGEX = "a-[a-c]b-[a-c]"  # forced stretches ("a-", "b-") around two free letters: 9 outcomes


def exact_outcomes(hf, tok, prompt: str, regex: str, stops: list[int], vocab: int) -> dict[str, float]:
    """{text: probability} of sampling at temperature 1 from transformers' logits masked by the grammar, by walking
    every token path the grammar allows (with probability above 1e-9) to its stop token."""
    xgr = xgrammar()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(parsed_grammar("regex", regex)),
                                 override_stop_tokens=stops)  # fmt: skip
    bitmask, out = xgr.allocate_token_bitmask(1, vocab), {}

    def walk(ids: list[int], prob: float) -> None:
        if matcher.is_terminated():
            text = tok.decode(ids[len(prefix) :], skip_special_tokens=True)
            out[text] = out.get(text, 0.0) + prob
            return
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        matcher.fill_next_token_bitmask(bitmask, 0)
        p = torch.softmax(logits.masked_fill(~allowed_tokens(bitmask, vocab)[0], float("-inf")), -1)
        for t in (p > 1e-9).nonzero().flatten().tolist():
            assert matcher.accept_token(t)
            walk(ids + [t], prob * float(p[t]))
            matcher.rollback(1)

    prefix = tok(prompt).input_ids
    walk(prefix, 1.0)
    return out


def test_one_hot_draft_distribution_keeps_sampling_exact():
    """A replaced draft t of a sampled request gets q = one-hot(t) (GrammarState.repair): the token emitted at its
    row still follows the (masked) target p, whether p(t) is large or small."""
    from scipy.stats import chisquare

    from draftgraph.runtime.rejection import rejection_sample
    from draftgraph.runtime.sampler import SamplingTensors

    b, v = 20000, 6
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, float("-inf"), -1.0])  # token 4: masked by the grammar
    p = torch.softmax(logits, -1)
    st = SamplingTensors(torch.ones(b), torch.zeros(b, dtype=torch.long), torch.ones(b), torch.arange(b), (False,))
    positions = torch.arange(2).expand(b, 2) + 7
    for t in (3, 5):  # a likely and an unlikely proposal
        q = torch.zeros(b, 1, v)
        q[..., t] = 1.0
        tokens, _ = rejection_sample(logits.expand(b, 2, v), torch.full((b, 1), t), q, st, positions, False)
        counts = torch.bincount(tokens[:, 0], minlength=v).float()
        assert counts[4] == 0
        keep = p > 0
        assert chisquare(counts[keep], p[keep] * b).pvalue > 1e-3, (t, counts, p * b)


def test_sampled_outputs_follow_the_masked_target(engine, ckpt, hf):  # noqa: F811
    """Sampled requests with a grammar in the engine (drafts refused in the forced stretches replaced, with a one-hot
    draft distribution): the outputs' frequencies pass a chi-square against the masked target's exact distribution
    (FULL_AND_PIECEWISE: the one-graph step's sampled variant; NONE's sampled rows are those of the mixed batch)."""
    from scipy.stats import chisquare

    if engine.config.mode.value == "NONE":
        pytest.skip("the sampled one-graph step is FULL_AND_PIECEWISE's; NONE samples the mixed batch's EBNF request")
    tok, n = ckpt[1], 80
    expected = exact_outcomes(hf, tok, PROMPTS[0], SAMPLED_REGEX, sorted(engine.eos_token_ids), engine.vocab_size)
    assert len(expected) == 9 and abs(sum(expected.values()) - 1) < 1e-4
    params = [dg.SamplingParams(max_tokens=12, regex=SAMPLED_REGEX, temperature=1.0, seed=s) for s in range(n)]
    outs = engine.generate([PROMPTS[0]] * n, params)
    assert all(o.finish_reason == "stop" and re.fullmatch(SAMPLED_REGEX, o.text) for o in outs)
    big = [t for t in sorted(expected) if expected[t] * n >= 5]  # outcomes expected under 5 times: pooled
    observed = [sum(o.text == t for o in outs) for t in big]
    want = [expected[t] * n for t in big]
    if n - sum(want) > 1e-6:
        observed, want = observed + [n - sum(observed)], want + [n - sum(want)]
    assert sum(observed) == n  # nothing outside the outcomes
    result = chisquare(observed, want)
    assert result.pvalue > 1e-3, (big, observed, [round(w, 1) for w in want])
    assert engine.stats()["accepted_tokens"] > 0


def test_uniform_batches_with_grammars_run_the_one_graph_step(engine, run):  # noqa: F811
    _, stats, _, alone_stats = run
    if engine.config.mode.value == "NONE":
        assert stats["fallbacks"] == 0 and not any(key.startswith("step/") for key in stats["dispatch"])
        return
    # On the CPU no graph replays: every forward is a fallback counted under the key it was dispatched to. Uniform
    # verify batches dispatched the whole step with grammar masks (sampled while the EBNF request ran, greedy
    # after; batch 1 alone), never the verify on its own (target/full/...).
    for s, variants in ((stats, ("/sample_grammar", "/greedy_grammar")), (alone_stats, ("/greedy_grammar",))):
        assert set(s["dispatch"]) <= {"target/none", "drafter/none", "step/none"}
        steps = [key for key in s["fallbacks_by_key"] if key.startswith(f"step/q{K + 1}/b")]
        for v in variants:
            assert any(key.endswith(v) for key in steps), steps
        assert not any(key.startswith("target/full/") for key in s["fallbacks_by_key"])
    assert any(key.startswith(f"step/q{K + 1}/b1/") for key in alone_stats["fallbacks_by_key"])


def test_verify_rows_follow_the_drafts_before_them(ckpt):  # noqa: F811
    """Row i of a request's bitmask is its matcher's after drafts 0..i-1; a draft the grammar refuses ends the walk
    (its row forbids it, later rows allow everything); the matcher is back where it was; rows of requests without a
    grammar allow everything; `apply` puts -inf exactly on the forbidden tokens."""
    tok = ckpt[1]
    vocab = len(tok) + 20  # the model's vocabulary may be larger than the tokenizer's
    state = GrammarState(rows=8, vocab_size=vocab, device="cpu")
    p = dg.SamplingParams(regex=REGEX)

    class Req:
        def __init__(self, drafts, grammar):
            self.drafts, self.grammar = drafts, grammar

    good = [t for s in ("n", "o", "-") for t in tok.encode(s, add_special_tokens=False)]
    assert len(good) == K
    bad = [good[0], tok.encode("x", add_special_tokens=False)[0], good[1]]
    a = Req(good, state.matcher(tok, p, frozenset({1}), 0))
    b = Req(bad, state.matcher(tok, p, frozenset({1}), 1))
    state.fill([(a, K + 1), (b, K + 1)], 8)
    got = allowed_tokens(state.bitmask, vocab)
    xgr = xgrammar()
    ref = xgr.GrammarMatcher(state._compiled[("regex", REGEX)], override_stop_tokens=[1])
    mask = xgr.allocate_token_bitmask(1, vocab)
    for i in range(K + 1):
        ref.fill_next_token_bitmask(mask, 0)
        assert torch.equal(got[i], allowed_tokens(mask, vocab)[0]), i
        if i < K:
            assert ref.accept_token(good[i])
    assert got[3].sum() < vocab and got[4].sum() < vocab  # "n-" and the start: masked
    n = len(tok)  # rows after a refused draft allow every id of the tokenizer; the head's padding ids never
    assert not got[5, bad[1]] and got[6, :n].all() and got[7, :n].all()  # "x" refused after "n": no mask after it
    assert not got[:8, n:].any()  # the LM head's padding ids (past the tokenizer's) are in no grammar's output
    for r in (a, b):  # rolled back: accepts "no-a" from the start
        assert all(r.grammar.matcher.accept_token(t) for t in tok.encode("no-a", add_special_tokens=False))
    state.fill([(Req([], None), 1), (a, 1)], 2)
    assert state.bitmask[0].eq(-1).all() and not allowed_tokens(state.bitmask[1:2], vocab)[0].all()
    logits = torch.randn(2, vocab)
    masked = state.apply(logits)
    allowed = allowed_tokens(state.bitmask[:2], vocab)
    assert torch.equal(masked[allowed], logits[allowed]) and masked[~allowed].eq(float("-inf")).all()


def test_refused_greedy_drafts_are_replaced_by_forced_tokens(ckpt):  # noqa: F811
    tok = ckpt[1]
    state = GrammarState(rows=4, vocab_size=len(tok), device="cpu")
    ids = {c: tok.encode(c, add_special_tokens=False)[0] for c in "nox-"}
    g = state.matcher(tok, dg.SamplingParams(regex=REGEX), frozenset({1}), 0)
    # after "no" the grammar forces "-": a refused "x" there is replaced; at the start nothing is forced
    assert g.repaired([ids["n"], ids["o"], ids["x"]]) == [ids["n"], ids["o"], ids["-"]]
    assert g.repaired([ids["x"], ids["o"], ids["x"]]) == [ids["x"], ids["o"], ids["x"]]
    assert all(g.matcher.accept_token(ids[c]) for c in "no-")  # rolled back to the start each time


def test_structured_params_are_checked(monkeypatch):
    p = dg.SamplingParams(json_schema=SCHEMA)
    assert json.loads(p.json_schema) == SCHEMA and p.structured[0] == "json_schema"
    assert hash(p) == hash(dg.SamplingParams(json_schema=json.dumps(SCHEMA)))  # kept as JSON text: hashable
    assert dg.SamplingParams().structured is None
    cases = [
        (dict(regex="a", grammar=EBNF), r"regex and grammar are set together; give at most one"),
        (dict(regex="(ab"), r"regex='\(ab' is not a regular expression xgrammar can compile: .*parenthesis"),
        (dict(regex=""), r"regex='' must be a non-empty string"),
        (dict(json_schema={"type": "objectx"}), r"json_schema=.* is not a JSON schema .*Unsupported type"),
        (dict(json_schema='{"type": '), r"json_schema=.* is not valid JSON"),
        (dict(json_schema=[1, 2]), r"json_schema=\[1, 2\] must be a JSON schema object"),
        (dict(regex="a+", min_tokens=2, max_tokens=4), r"min_tokens=2 with regex: .* leave min_tokens at 0"),
        (dict(grammar="root ::= foo"), r"grammar=.* is not an EBNF grammar .*Rule \"foo\" is not defined"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            dg.SamplingParams(**kwargs)
    monkeypatch.setitem(__import__("sys").modules, "xgrammar", None)
    grammar_mod.parsed_grammar.cache_clear()
    with pytest.raises(ImportError, match=r"pip install draftgraph\[structured\]"):
        dg.SamplingParams(regex="b+")
    monkeypatch.undo()
    grammar_mod.parsed_grammar.cache_clear()


def test_structured_output_needs_the_tokenizer(engine):  # noqa: F811
    bare = dg.compile_model(engine.target, None, dg.CompileConfig(num_speculative_tokens=0, progress=False))
    with bare, pytest.raises(ValueError, match=r"regex needs the engine's tokenizer"):
        bare.add_request([1, 2], dg.SamplingParams(regex="a+"))


def test_server_fields_map_onto_the_params():
    """OpenAI's response_format and vLLM's guided_* fields (serve/protocol.py), without a server."""
    from draftgraph.serve.protocol import ServeError, sampling_params

    read = lambda **body: sampling_params(body, 16).structured  # noqa: E731
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}
    assert read(response_format=fmt) == ("json_schema", json.dumps(SCHEMA))
    assert read(response_format={"type": "json_object"}) == ("json_schema", '{"type": "object"}')
    assert read(response_format={"type": "text"}) is None and read() is None
    assert read(guided_json=json.dumps(SCHEMA)) == ("json_schema", json.dumps(SCHEMA))
    assert read(guided_regex=REGEX) == ("regex", REGEX) and read(guided_grammar=EBNF) == ("grammar", EBNF)
    for body, param in [
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"response_format": "json"}, "response_format"),
        ({"guided_json": {"type": "nope"}}, "guided_json"),
    ]:
        with pytest.raises(ServeError) as e:
            sampling_params(body, 16)
        assert e.value.status == 400 and e.value.param == param, e.value.body()
