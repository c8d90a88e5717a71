"""Stop strings under speculation (CPU, a draft model at K = 3, NONE and FULL_AND_PIECEWISE).

Oracle: transformers' greedy generate on the same checkpoint, decoded by the same tokenizer (trained offline
as tests/test_text.py does). A request with a stop string ends at the token that completes the first stop
its text comes to contain: ids up to that token, text cut before the stop (or after it with
include_stop_str_in_output), finish_reason "stop"; the stream's pieces add up to exactly that, and nothing
emitted after the stop in the same speculative step reaches the output or the stream."""

import pytest
import torch
import transformers

import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.drafters.loader import truncated_draft_model
from tests.helpers import tiny_hf_model
from tests.test_text import train_tokenizer

PROMPTS = ["hello world", "the quick brown fox", "speculative decoding"]
MAX = 24


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("stops") / "ckpt")
    tok = train_tokenizer()
    hf = tiny_hf_model("llama", vocab_size=len(tok))
    with torch.no_grad():  # only plain ASCII tokens can win: varied, readable greedy text to pick stops from
        for t in range(len(tok)):
            piece = tok.decode([t])
            if not (piece.isascii() and piece and all(c.isalnum() or c in " ," for c in piece)):
                hf.lm_head.weight[t] = 0
    hf.generation_config.eos_token_id = None
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    return path, tok


@pytest.fixture(scope="module")
def reference(ckpt):
    """transformers' greedy ids and text per prompt (no eos)."""
    path, tok = ckpt
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    out = []
    for p in PROMPTS:
        ids = torch.tensor([tok(p).input_ids])
        with torch.no_grad():
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX,
                              min_new_tokens=MAX)[0, ids.shape[1] :].tolist()  # fmt: skip
        out.append((gen, tok.decode(gen, skip_special_tokens=True)))
    return out


@pytest.fixture(scope="module", params=["NONE", "FULL_AND_PIECEWISE"])
def engine(request, ckpt):
    path, _ = ckpt
    target = CausalLM.from_pretrained(path)
    cfg = dg.CompileConfig(
        mode=request.param, num_speculative_tokens=3, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128,
        compile_backend="eager", capture_sizes=(1, 4, 16), full_capture_sizes=(1, 2, 4), progress=False,
    )  # fmt: skip
    eng = dg.compile_model(target, truncated_draft_model(target, 2), cfg, tokenizer=path)
    yield eng
    eng.close()


def pick_stop(text: str, at: int) -> str:
    """A 3-character stop string from `text` at `at` or the nearest place after (else before) it where its
    first occurrence lies (clean characters)."""
    for i in [*range(at, len(text) - 3), *range(at - 1, 0, -1)]:
        s = text[i : i + 3]
        if text.find(s) == i and "\ufffd" not in s and s.strip():
            return s
    raise AssertionError(f"no usable stop string in {text!r} after {at}")


def expected(tok, ids, text, stop, include):
    at = text.find(stop)
    n = next(m for m in range(1, len(ids) + 1) if stop in tok.decode(ids[:m], skip_special_tokens=True))
    return ids[:n], text[: at + len(stop)] if include else text[:at]


def test_stop_strings_cut_where_transformers_text_first_holds_them(engine, ckpt, reference):
    _, tok = ckpt
    cases = []  # (prompt index, params)
    for i, (_, text) in enumerate(reference):
        early, late = pick_stop(text, len(text) // 4), pick_stop(text, len(text) // 2)
        cases.append((i, dg.SamplingParams(max_tokens=MAX, ignore_eos=True, stop=[late, early])))  # the first wins
        cases.append((i, dg.SamplingParams(max_tokens=MAX, ignore_eos=True, stop=late,
                                           include_stop_str_in_output=True)))  # fmt: skip
    cases.append((0, dg.SamplingParams(max_tokens=MAX, ignore_eos=True, stop=["\u2603 never"])))
    engine.step_log = []
    outs = engine.generate([PROMPTS[i] for i, _ in cases], [p for _, p in cases])
    cut_mid_step = 0
    for (i, params), out in zip(cases, outs):
        ids, text = reference[i]
        hits = [s for s in params.stop if s in text]
        if not hits:
            assert out.token_ids == ids and out.text == text and out.finish_reason == "length"
            continue
        stop = min(hits, key=lambda s: text.find(s) + len(s))
        want_ids, want_text = expected(tok, ids, text, stop, params.include_stop_str_in_output)
        assert out.token_ids == want_ids and out.text == want_text and out.finish_reason == "stop", (i, params)
        emitted = sum(len(e["emitted"]) for e in engine.step_log if e["request"] == out.request_id)
        cut_mid_step += emitted > len(out.token_ids)
    assert cut_mid_step > 0  # some step emitted past its stop: those tokens were dropped
    assert engine.stats()["accepted_tokens"] > 0


def test_stream_sends_nothing_past_the_stop(engine, reference):
    prompts, params = [], []
    for i, (_, text) in enumerate(reference):
        prompts.append(PROMPTS[i])
        params.append(dg.SamplingParams(max_tokens=MAX, ignore_eos=True, stop=[pick_stop(text, len(text) // 3)]))
    final = engine.generate(prompts, params)
    ids, texts, outs = {}, {}, {}
    for d in engine.stream(prompts, params):
        ids[d.index] = ids.get(d.index, []) + d.token_ids
        texts[d.index] = texts.get(d.index, "") + d.text
        assert final[d.index].text.startswith(texts[d.index])  # never a character past the cut, at any step
        if d.output is not None:
            outs[d.index] = d.output
    for i, out in enumerate(final):
        assert out.finish_reason == "stop" and outs[i].finish_reason == "stop"
        assert ids[i] == out.token_ids and texts[i] == out.text == outs[i].text


def test_stop_strings_are_checked(engine):
    with pytest.raises(ValueError, match=r"stop=\[''\] must be a list of non-empty strings"):
        dg.SamplingParams(stop=[""])
    with pytest.raises(ValueError, match=r"stop=3 must be a list of non-empty strings"):
        dg.SamplingParams(stop=3)
    assert dg.SamplingParams(stop="ab").stop == ("ab",)
    target = engine.target
    bare = dg.compile_model(target, None, dg.CompileConfig(num_speculative_tokens=0, progress=False))
    with bare, pytest.raises(ValueError, match=r"stop=\['ab'\] needs the engine's tokenizer"):
        bare.add_request([1, 2], dg.SamplingParams(stop=["ab"]))
