"""Logits processing under speculation: repetition / presence / frequency penalties, min_tokens and logit_bias
(runtime/penalties.py). CPU, float32, a draft model at K = 3, modes NONE and FULL_AND_PIECEWISE (eager backend:
the dispatch and the one-graph step's code are under test, not Inductor's).

Oracles: transformers' own `generate(repetition_penalty=...)` for the repetition penalty; for the others a greedy
loop over transformers' logits of the same weights that applies vLLM's order and OpenAI's formula (`processed`).
Sampling: a chi-square of the engine's speculative draws against the exact marginals of the processed target."""

import dataclasses
import itertools

import pytest
import torch
from scipy.stats import chisquare

import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.drafters import truncated_draft_model
from draftgraph.runtime.drafting import Chooser
from draftgraph.runtime.penalties import MAX_LOGIT_BIAS, PenaltyState
from tests.copy_drafters import make_drafter
from tests.helpers import hf_greedy, tiny_hf_model

K = 3
PROMPTS = [[5, 17, 3, 88, 41], [9, 2], [60, 61, 62, 63, 64, 65, 66], [1, 30, 30, 7], [44, 45], [8, 74, 8]]
ARRIVALS = [0, 0, 1, 2, 3, 3]  # mixed steps (a prefill beside verifies) first, uniform verify batches after
REP = dg.SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=1.3)


def params_for(stop_tok: int, bias_tok: int) -> list[dg.SamplingParams]:
    return [
        REP,
        dg.SamplingParams(max_tokens=14, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.6, logprobs=3),
        # stop_tok is what greedy emits second: min_tokens holds it back for 6 tokens, then it may stop the request
        dg.SamplingParams(max_tokens=12, ignore_eos=True, min_tokens=6, stop_token_ids=(stop_tok,)),
        dg.SamplingParams(max_tokens=10, ignore_eos=True, logit_bias={bias_tok: 100.0}),
        dg.SamplingParams(max_tokens=12, ignore_eos=True),  # no processing: plain greedy, unaffected
        dg.SamplingParams(
            max_tokens=8,
            ignore_eos=True,
            temperature=0.8,
            seed=5,
            repetition_penalty=1.2,
            frequency_penalty=-0.5,
            logit_bias={3: -4.0, 7: 2.5},
            logprobs=2,
        ),  # fmt: skip
    ]


@pytest.fixture(scope="module")
def models():
    hf = tiny_hf_model("llama")
    target = CausalLM.from_hf(hf)
    return hf, target, make_drafter("draft_model", target)


@pytest.fixture(scope="module")
def plain(models):
    """transformers' plain greedy tokens per prompt (to pick a stop token greedy emits early)."""
    return hf_greedy(models[0], PROMPTS, 12)


def config(mode, max_num_seqs=8):
    return dg.CompileConfig(
        mode=mode, num_speculative_tokens=K, max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
        compile_backend="eager", capture_sizes=(1, 4, 16), full_capture_sizes=(1, 2, 4, 8), progress=False,
    )  # fmt: skip


@pytest.fixture(scope="module", params=["NONE", "FULL_AND_PIECEWISE"])
def run(request, models, plain):
    _, target, drafter = models
    params = params_for(plain[2][1], 11)
    with dg.compile_model(target, drafter, config(request.param)) as eng:
        outs = eng.generate(PROMPTS, params, ARRIVALS)
        yield request.param, params, outs, eng.stats()


@pytest.fixture(scope="module", params=["NONE", "FULL_AND_PIECEWISE"])
def stepped(request, models):
    """A request stepped by hand, its slot's device counts read after each step (steps not overlapped: with them the
    device runs a step ahead of the host)."""
    _, target, drafter = models
    cfg = dataclasses.replace(config(request.param), overlap_steps=False)
    with dg.compile_model(target, drafter, cfg) as eng:
        eng.add_request(PROMPTS[3], dg.SamplingParams(max_tokens=30, ignore_eos=True, frequency_penalty=0.3))
        seen = []  # (output so far, its slot's counts row, generated length) after each step while it runs
        while eng.has_unfinished():
            eng.step()
            for r in eng.scheduler.running:
                if not r.prefilling and r.finish_reason is None:
                    pen = eng.runner.penalties
                    seen.append((list(r.output), pen.counts[r.slot].clone(), int(pen.generated[r.slot])))
        yield request.param, seen, eng.stats()


def processed(logits: torch.Tensor, prompt, out, p: dg.SamplingParams, stop_ids) -> torch.Tensor:
    """The reference: logits [V] of the position after prompt + out, processed in vLLM's order with OpenAI's formula
    (logit_bias, then min_tokens over stop_ids, then repetition over prompt and output, then frequency / presence)."""
    x = logits.float().clone()
    for t, b in p.logit_bias:
        x[t] += b
    if len(out) < p.min_tokens:
        x[list(stop_ids)] = float("-inf")
    counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=x.shape[0]).float()
    seen = counts > 0
    seen[torch.tensor(prompt)] = True
    rp = p.repetition_penalty
    x = torch.where(seen, torch.where(x > 0, x / rp, x * rp), x)
    return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()


def reference_greedy(hf, prompt, p: dg.SamplingParams) -> list[int]:
    """The greedy loop over transformers' logits with `processed` (stop_token_ids stop it, kept as the last id)."""
    out = []
    stop_ids = set(p.stop_token_ids)
    while len(out) < p.max_tokens:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
        tok = int(processed(logits, prompt, out, p, stop_ids).argmax())
        out.append(tok)
        if tok in stop_ids:
            break
    return out


def hf_generate_repetition(hf, prompt, max_tokens, penalty) -> list[int]:
    """transformers' greedy generate with its RepetitionPenaltyLogitsProcessor (no eos)."""
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                          min_new_tokens=max_tokens, repetition_penalty=penalty)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_repetition_penalty_equals_transformers_generate(models, run):
    hf = models[0]
    _, params, outs, stats = run
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"]  # accepted drafts and rejections both ran
    ref = hf_generate_repetition(hf, PROMPTS[0], params[0].max_tokens, params[0].repetition_penalty)
    assert outs[0].token_ids == ref
    assert ref != hf_greedy(hf, PROMPTS[:1], params[0].max_tokens)[0]  # the penalty changed the greedy tokens


def test_repetition_penalty_batched_equals_transformers(models):
    """Every prompt with the repetition penalty, batched with mixed arrival, both modes: transformers' tokens."""
    hf, target, drafter = models
    for mode in ("NONE", "FULL_AND_PIECEWISE"):
        with dg.compile_model(target, drafter, config(mode)) as eng:
            outs = eng.generate(PROMPTS, REP, ARRIVALS)
            stats = eng.stats()
        for prompt, out in zip(PROMPTS, outs):
            assert out.token_ids == hf_generate_repetition(hf, prompt, REP.max_tokens, REP.repetition_penalty), mode
        assert stats["fallbacks"] == 0 or mode != "NONE"
        assert stats["accepted_tokens"] > 0


@pytest.mark.parametrize("mode", ["NONE", "FULL_AND_PIECEWISE"])
def test_drafts_get_the_penalties_so_acceptance_stays_high(models, mode):
    """A draft model of all the target's layers agrees with it: every draft is accepted. Under repetition penalty
    1.5 a drafter proposing from its raw logits had 0.245 of its drafts accepted (here, 2026-11-27, before drafts
    were processed: measured again below with the processing turned off); processed as the next verify's rows
    (runtime/penalties.py process_draft), every draft again. Greedy tokens equal transformers' generate."""
    hf, target, _ = models
    drafter = truncated_draft_model(target, target.cfg.num_layers)
    p = dg.SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=1.5)
    prompts = PROMPTS[:4]
    rates = {}
    with dg.compile_model(target, drafter, config(mode)) as eng:
        for processed_drafts in (False, True):
            eng.runner.proposer.processes_drafts = processed_drafts  # False: as before drafts were processed
            outs = eng.generate(prompts, p)
            stats = eng.stats()
            rates[processed_drafts] = stats["acceptance_rate"]
            for prompt, out in zip(prompts, outs):
                assert out.token_ids == hf_generate_repetition(hf, prompt, p.max_tokens, p.repetition_penalty)
        if mode != "NONE":  # the uniform batches ran the one-graph step's penalties variant
            assert any(key.endswith("/greedy_penalties") for key in stats["fallbacks_by_key"]), stats  # CPU: no graphs
    assert rates[False] < 0.5 and rates[True] >= 0.95, rates


def test_a_reduced_draft_vocabulary_is_processed_at_its_target_ids(models):
    """EAGLE-3 over 5/8 of the vocabulary (d2t): a draft step's logits [B, Vd] are processed inside the target's
    vocabulary (Chooser.processed), which equals processing the target-sized logits and reading the draft ids'
    columns (the processing is per column); an engine with it gives transformers' tokens under a repetition
    penalty."""
    hf, target, _ = models
    drafter = make_drafter("eagle3_reduced", target)
    vocab, vd = target.cfg.vocab_size, drafter.draft_vocab_size
    assert vd < vocab
    ids = drafter.to_target_ids(torch.arange(vd))
    pen = PenaltyState(max_num_seqs=2, vocab_size=vocab, device="cpu")
    a, b, c, d = (int(ids[i]) for i in (1, 3, 5, 7))
    p = dg.SamplingParams(max_tokens=20, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.2,
                          min_tokens=4, logit_bias={b: 2.0, d: -1.0}, stop_token_ids=(c,))  # fmt: skip
    pen.admit([_Req(0, [a, 2], [b, b], p, frozenset({c})), _Req(1, [1], [], dg.SamplingParams())])
    full = torch.randn(2, vocab, generator=torch.Generator().manual_seed(1))
    slots, prior = torch.tensor([0, 1]), [ids[[3, 9]], ids[[7, 7]]]  # drafts 0, 1 of this step (target ids)
    choose = Chooser(drafter, vocab, race_kernel=False)
    got = choose.processed(full[:, ids], slots, pen.process_draft, prior)
    want = pen.process_draft(full, slots, prior)[:, ids]
    torch.testing.assert_close(got, want)
    assert not torch.equal(got[0], full[0, ids]) and torch.equal(got[1], full[1, ids])  # processed / untouched
    q = dg.SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=1.5)
    with dg.compile_model(target, drafter, config("NONE")) as eng:
        outs = eng.generate(PROMPTS[:4], q)
    for prompt, out in zip(PROMPTS[:4], outs):
        assert out.token_ids == hf_generate_repetition(hf, prompt, q.max_tokens, q.repetition_penalty)


def test_presence_frequency_min_tokens_logit_bias_equal_the_reference(models, plain, run):
    hf = models[0]
    _, params, outs, _ = run
    for i in (1, 2, 3, 4):
        assert outs[i].token_ids == reference_greedy(hf, PROMPTS[i], params[i]), f"request {i}"
    # presence / frequency changed the greedy tokens
    assert outs[1].token_ids != plain[1][: params[1].max_tokens]
    # min_tokens: greedy would stop at its second token; it is held back for 6 tokens, then may stop the request
    stop_tok = params[2].stop_token_ids[0]
    assert plain[2][1] == stop_tok
    out2 = outs[2].token_ids
    assert len(out2) >= 6 and stop_tok not in out2[:6]
    assert outs[2].finish_reason == ("stop" if out2[-1] == stop_tok else "length")
    # a +100 bias forces its token at every position
    assert outs[3].token_ids == [11] * params[3].max_tokens
    # the request without processing is transformers' plain greedy
    assert outs[4].token_ids == plain[4][: params[4].max_tokens]


def test_logprobs_stay_raw_with_penalties(models, run):
    """Logprobs are the log-softmax of the raw logits (before bias and penalties), greedy and sampled rows."""
    hf = models[0]
    _, params, outs, _ = run
    for i in (1, 5):
        prompt, out = PROMPTS[i], outs[i]
        assert len(out.token_ids) == params[i].max_tokens and len(out.logprobs) == len(out.token_ids)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out.token_ids])).logits[0].float()
        ref = torch.log_softmax(logits, -1)[len(prompt) - 1 : len(prompt) + len(out.token_ids) - 1]
        for j, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert abs(entry[tok] - float(ref[j, tok])) < 1e-4, f"request {i}, token {j}"


def test_uniform_batches_with_penalties_run_the_one_graph_step(run):
    mode, _, _, stats = run
    if mode == "NONE":
        assert stats["fallbacks"] == 0 and not any(key.startswith("step/") for key in stats["dispatch"])
        return
    # On the CPU no graph replays: every forward is a fallback counted under the key it was dispatched to. Uniform
    # verify batches dispatched the whole step with penalties (and logprobs, sampled while request 5 ran) and never
    # the verify on its own (target/full/...), so no uniform batch left the one-graph step.
    by_key = stats["fallbacks_by_key"]
    assert set(stats["dispatch"]) == {"target/none", "drafter/none", "step/none"}
    step_keys = [key for key in by_key if key.startswith(f"step/q{K + 1}/b")]
    assert any(key.endswith("/sample_penalties_logprobs") for key in step_keys), step_keys
    assert any(key.endswith("/greedy_penalties_logprobs") for key in step_keys), step_keys
    assert not any(key.startswith("target/full/") for key in by_key)


def test_device_counts_follow_the_output_with_accepted_drafts(stepped):
    """After every step, the slot's counts equal the output's token counts and its generated length the output's
    length: the step recorded every accepted draft and the new token on the device (in FULL_AND_PIECEWISE: inside
    the one-graph step)."""
    mode, seen, stats = stepped
    if mode != "NONE":
        assert any(key.endswith("/greedy_penalties") for key in stats["fallbacks_by_key"])
    assert len(seen) >= 3
    for out, counts, generated in seen:
        assert counts.tolist() == torch.bincount(torch.tensor(out), minlength=counts.shape[0]).tolist()
        assert generated == len(out)
    assert any(len(b[0]) - len(a[0]) > 1 for a, b in zip(seen, seen[1:]))  # a step emitted accepted drafts too


class _Req:
    def __init__(self, slot, prompt, output, params, stop_ids=frozenset()):
        self.slot, self.prompt, self.output, self.params, self.stop_ids = slot, prompt, output, params, stop_ids


def test_verify_rows_count_the_drafts_before_them():
    """Row i of a verify sees drafts 0..i-1 as generated: a frequency penalty of 1 lowers the drafted token by i at
    row i, a presence penalty from row 1 on, and min_tokens stops at the row where output + drafts reach it. A
    processing that counted only earlier steps (every row as row 0) differs."""
    vocab = 10
    pen = PenaltyState(max_num_seqs=2, vocab_size=vocab, device="cpu")
    p = dg.SamplingParams(max_tokens=20, frequency_penalty=1.0, presence_penalty=0.5, min_tokens=3,
                          stop_token_ids=(9,))  # fmt: skip
    pen.admit([_Req(0, [1], [4], p, frozenset({9})), _Req(1, [1], [], dg.SamplingParams())])
    logits = torch.randn(2, 4, vocab)
    drafts = torch.tensor([[6, 6, 6], [6, 6, 6]])
    out = pen.process(logits, torch.tensor([0, 1]), drafts)
    rows = torch.arange(4)
    expected_6 = logits[0, :, 6] - 1.0 * rows - 0.5 * (rows > 0).float()
    torch.testing.assert_close(out[0, :, 6], expected_6)
    torch.testing.assert_close(out[0, :, 4], logits[0, :, 4] - 1.5)  # the output token: counted at every row
    assert torch.isinf(out[0, :2, 9]).all() and torch.isfinite(out[0, 2:, 9]).all()  # 1 output + 2 drafts = 3
    assert torch.equal(out[1].view(torch.int32), logits[1].view(torch.int32))  # no processing: bit for bit
    only_earlier = pen.process(logits, torch.tensor([0, 1]), None)  # the drafts not counted
    assert not torch.equal(only_earlier[0, :, 6], out[0, :, 6])
    # record: row 0 emitted its first two tokens, row 1 (another slot) all four
    pen.record(torch.tensor([0, 1]), torch.tensor([[6, 6, 2, 3], [7, 7, 7, 7]]), torch.tensor([2, 4]))
    assert pen.counts[0].tolist() == [0, 0, 0, 0, 1, 0, 2, 0, 0, 0] and int(pen.generated[0]) == 3
    assert int(pen.counts[1, 7]) == 4


def test_buffers_come_with_the_first_request_that_asks():
    """An engine whose requests never ask for logits processing holds none of its [slots, V] buffers."""
    pen = PenaltyState(max_num_seqs=4, vocab_size=8, device="cpu")
    pen.admit([_Req(0, [1], [], dg.SamplingParams()), _Req(1, [2], [], dg.SamplingParams(top_k=3))])
    assert not pen.allocated and not hasattr(pen, "counts")
    pen.admit([_Req(2, [1, 1], [], dg.SamplingParams(presence_penalty=0.5))])
    assert pen.allocated and pen.counts.shape == (5, 8) and pen.flags[2, 1] == 1 and bool(pen.active[2])
    pen.admit([_Req(2, [3], [], dg.SamplingParams())])  # the slot's next request asks for nothing
    assert not bool(pen.active[2])


def test_draft_columns_match_a_per_row_count_of_every_token():
    """The processing at the K draft columns (repeated drafts included) equals processing each verify row with its
    whole count vector built token by token: slot counts + drafts 0..i-1."""
    vocab, k = 6, 4  # a small vocabulary: drafts repeat
    g = torch.Generator().manual_seed(0)
    pen = PenaltyState(max_num_seqs=3, vocab_size=vocab, device="cpu")
    p = dg.SamplingParams(max_tokens=20, frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.3,
                          min_tokens=3, logit_bias={2: 1.5}, stop_token_ids=(5,))  # fmt: skip
    reqs = [_Req(0, [1, 3], [4, 4], p, frozenset({5})), _Req(1, [0], [], p, frozenset({5}))]
    pen.admit(reqs)
    logits = torch.randn(3, k + 1, vocab, generator=g)
    drafts = torch.randint(0, vocab, (3, k), generator=g)
    drafts[0] = torch.tensor([2, 2, 4, 2])
    slots = torch.tensor([0, 1, 2])  # 2: the scratch slot, no processing
    out = pen.process(logits, slots, drafts)
    for b, req in enumerate(reqs):
        for i in range(k + 1):
            tokens = torch.tensor(req.output + drafts[b, :i].tolist(), dtype=torch.long)
            counts = torch.bincount(tokens, minlength=vocab)
            x = logits[b, i].clone()
            x[2] += 1.5
            if len(req.output) + i < 3:
                x[5] = float("-inf")
            seen = (counts > 0) | torch.isin(torch.arange(vocab), torch.tensor(req.prompt))
            x = torch.where(seen, torch.where(x > 0, x / 1.3, x * 1.3), x)
            x = x - 0.7 * counts - 0.4 * (counts > 0).float()
            torch.testing.assert_close(out[b, i], x)
    assert torch.equal(out[2], logits[2])


def test_sampled_penalties_preserve_the_processed_distribution():
    """Tokens 2 and 3 come from the first verify step (K = 2; token 3 is drawn after draft 1, which it must count);
    their frequencies over 8000 seeded requests match the exact marginals of the processed target, and the same
    counts reject a marginal shifted by 2 %."""
    vocab = 16
    hf = tiny_hf_model("llama", vocab_size=vocab)
    target = CausalLM.from_hf(hf)
    prompt = [3, 1, 4, 1, 5]
    n = 8000
    p = dict(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.7, frequency_penalty=0.8,
             logit_bias={2: 1.5, 9: -2.0})  # fmt: skip
    cfg = dg.CompileConfig(num_speculative_tokens=2, max_num_seqs=256, max_num_batched_tokens=2048)
    with dg.compile_model(target, truncated_draft_model(target, 1), cfg) as eng:
        params = [dg.SamplingParams(max_tokens=3, seed=i, ignore_eos=True, **p) for i in range(n)]
        outs = eng.generate([prompt] * n, params)
        assert 0.1 < eng.stats()["acceptance_rate"] < 0.95  # drafts were accepted and rejected
    samples = torch.tensor([o.token_ids for o in outs])  # [n, 3]

    ref = dg.SamplingParams(**p)
    with torch.no_grad():  # exact marginals of tokens 2 and 3 by enumerating tokens 1 and 2
        ctx = [list(t) for t in itertools.product(range(vocab), repeat=2)]
        logits = hf(torch.tensor([prompt + t for t in ctx])).logits.double()  # [V*V, 7, V]
    first = processed(logits[0, len(prompt) - 1], prompt, [], ref, ()).softmax(-1).double()
    p2 = torch.stack([processed(logits[a * vocab, len(prompt)], prompt, [a], ref, ()) for a in range(vocab)])
    p3 = torch.stack([processed(logits[i, len(prompt) + 1], prompt, t, ref, ()) for i, t in enumerate(ctx)])
    p2, p3 = p2.softmax(-1).double(), p3.softmax(-1).double().view(vocab, vocab, vocab)
    marg2 = first @ p2
    marg3 = torch.einsum("a,ab,abc->c", first, p2, p3)
    for col, marg in ((1, marg2), (2, marg3)):
        counts = torch.bincount(samples[:, col], minlength=vocab).double()
        assert chisquare(counts.numpy(), (marg / marg.sum() * counts.sum()).numpy()).pvalue > 1e-3
        shifted = marg.clone()  # move 2 % of the mass from the likeliest token to the least likely one
        shifted[marg.argmax()] -= 0.02
        shifted[marg.argmin()] += 0.02
        assert chisquare(counts.numpy(), (shifted / shifted.sum() * counts.sum()).numpy()).pvalue < 1e-3


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(repetition_penalty=0), r"repetition_penalty=0 must be a finite number > 0"),
        (dict(repetition_penalty=float("nan")), r"repetition_penalty=nan must be a finite number > 0"),
        (dict(repetition_penalty="1.2"), r"repetition_penalty='1.2' must be a finite number > 0"),
        (dict(presence_penalty=2.5), r"presence_penalty=2.5 must be a number in \[-2, 2\]"),
        (dict(frequency_penalty=-3), r"frequency_penalty=-3 must be a number in \[-2, 2\]"),
        (dict(frequency_penalty=True), r"frequency_penalty=True must be a number in \[-2, 2\]"),
        (dict(min_tokens=-1), r"min_tokens=-1 must be an int in \[0, max_tokens=16\]"),
        (dict(min_tokens=17), r"min_tokens=17 must be an int in \[0, max_tokens=16\].*raise max_tokens"),
        (dict(min_tokens=2.0), r"min_tokens=2.0 must be an int"),
        (dict(logit_bias={5: 101}), r"logit_bias\[5\]=101 must be a number in \[-100, 100\]"),
        (dict(logit_bias={-1: 1.0}), r"logit_bias key -1 must be a token id"),
        (dict(logit_bias={"x": 1.0}), r"logit_bias key 'x' must be a token id"),
        (dict(logit_bias="5"), r"logit_bias='5' must map token ids to biases"),
        (dict(logit_bias=[(1, 2.0), (1, 3.0)]), r"logit_bias gives token 1 twice"),
        (dict(logit_bias={i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}), r"at most 300 are allowed"),
    ],
)
def test_penalty_params_are_checked(kw, match):
    with pytest.raises(ValueError, match=match):
        dg.SamplingParams(**kw)


def test_penalty_params_are_kept_hashable_and_normalised():
    p = dg.SamplingParams(logit_bias={"7": -100, 3: 2}, repetition_penalty=2, min_tokens=16)
    assert p.logit_bias == ((3, 2.0), (7, -100.0)) and p.repetition_penalty == 2.0
    assert hash(p) == hash(dg.SamplingParams(logit_bias=[(7, -100.0), (3, 2.0)], repetition_penalty=2.0, min_tokens=16))
    assert p.uses_logits_processing and not dg.SamplingParams().uses_logits_processing


def test_logit_bias_ids_are_checked_against_the_vocabulary(models):
    _, target, drafter = models
    cfg, match = config("NONE", max_num_seqs=2), r"logit_bias ids \[96\] lie outside the vocabulary \[0, 96\)"
    with dg.compile_model(target, drafter, cfg) as eng, pytest.raises(ValueError, match=match):
        eng.add_request([1, 2], dg.SamplingParams(logit_bias={96: 1.0}))


def test_preempted_requests_keep_their_counts(models):
    """Preempted requests are recomputed with their slot's counts rebuilt from their output: greedy and sampled
    requests with penalties give the same tokens with a cache that forces preemptions as with a big one."""
    _, target, drafter = models
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (14, 6, 20, 9, 17)]
    params = [
        dg.SamplingParams(
            max_tokens=14,
            ignore_eos=True,
            repetition_penalty=1.4,
            frequency_penalty=0.5,
            temperature=1.0 if i % 2 else 0.0,
            seed=i,
            presence_penalty=0.3,
        )  # fmt: skip
        for i in range(len(prompts))
    ]
    outs, stats = {}, {}
    for blocks in (0, 11):  # 0: room for every request at max_model_len; 11 blocks of 4: preemptions
        cfg = dg.CompileConfig(num_speculative_tokens=K, max_num_seqs=8, max_num_batched_tokens=64,
                               num_kv_blocks=blocks, block_size=4, max_model_len=48)  # fmt: skip
        with dg.compile_model(target, drafter, cfg) as eng:
            outs[blocks] = [o.token_ids for o in eng.generate(prompts, params)]
            stats[blocks] = eng.stats()
    assert stats[0]["preemptions"] == 0 and stats[11]["preemptions"] > 0
    assert outs[11] == outs[0]
    hf = models[0]
    for i in (0, 2, 4):  # the greedy ones equal the reference loop
        assert outs[0][i] == reference_greedy(hf, prompts[i], params[i]), f"request {i}"
