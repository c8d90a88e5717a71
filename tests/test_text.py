"""Text in and out, and stop conditions (mode NONE, CPU).

A byte-level BPE tokenizer is trained here with `tokenizers` (no hub), wrapped in transformers'
PreTrainedTokenizerFast and saved with save_pretrained beside the built-in target (saved the same way),
so the checkpoint directory looks like a hub download. Oracles: the tokenizer's own decode, and
transformers' greedy generate on the same checkpoint (its eos read from generation_config.json).
"""

import json
import shutil

import pytest
import torch
import transformers

import draftgraph as dg
from draftgraph.models.builtin import BuiltinSpec, builtin_hf_target, builtin_pair
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.drafters.loader import truncated_draft_model
from draftgraph.runtime.text import IncrementalDetokenizer

NONE = dict(mode="NONE", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128)
PROMPTS = ["hello world", "the quick brown fox", "speculative decoding"]
MAX = 24


def train_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # No CJK or accented text in the corpus: those characters stay split over byte tokens.
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world, hello graphs", "speculative decoding"]
    tok.train_from_iterator(corpus * 10, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(directory, tokenizer): the built-in target with the tokenizer's vocabulary, no eos anywhere."""
    path = str(tmp_path_factory.mktemp("text") / "ckpt")
    tok = train_tokenizer()
    hf = builtin_hf_target(BuiltinSpec(vocab_size=len(tok)))
    hf.generation_config.eos_token_id = None
    hf.save_pretrained(path)
    tok.save_pretrained(path)
    return path, tok


@pytest.fixture(scope="module")
def reference(ckpt):
    """Greedy ids of each prompt, eos ignored, from the target alone."""
    path, _ = ckpt
    eng = dg.compile_model(path, None, dg.CompileConfig(num_speculative_tokens=0, **NONE))
    return [o.token_ids for o in eng.generate(PROMPTS, dg.SamplingParams(max_tokens=MAX, ignore_eos=True))]


def hf_generate(path, prompt_ids, max_new_tokens, **kw):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = hf.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens, **kw
        )
    return out[0, len(prompt_ids) :].tolist()


def with_eos(src, dst, generation_eos, config_eos=None) -> str:
    """A copy of checkpoint `src` whose generation_config.json (and config.json) name these eos ids."""
    shutil.copytree(src, dst)
    with open(f"{dst}/generation_config.json", "w") as f:
        json.dump({"eos_token_id": generation_eos}, f)
    with open(f"{dst}/config.json") as f:
        cfg = json.load(f)
    cfg["eos_token_id"] = config_eos
    with open(f"{dst}/config.json", "w") as f:
        json.dump(cfg, f)
    return str(dst)


def first_at(ids, lo, hi):
    """A token whose first occurrence in `ids` lies in [lo, hi), and that index."""
    for i in range(lo, hi):
        if ids.index(ids[i]) == i:
            return ids[i], i
    raise AssertionError(f"no token first occurs in [{lo}, {hi}) of {ids}")


def test_string_prompt_round_trip(ckpt, reference):
    path, tok = ckpt
    eng = dg.compile_model(path, None, dg.CompileConfig(num_speculative_tokens=0, **NONE))
    assert eng.tokenizer is not None  # found beside the checkpoint
    ids_prompt = tok(PROMPTS[1]).input_ids
    outs = eng.generate([PROMPTS[0], ids_prompt], dg.SamplingParams(max_tokens=MAX, ignore_eos=True))
    assert outs[0].prompt_token_ids == tok(PROMPTS[0]).input_ids and outs[0].prompt_token_ids[0] == 0  # <s> added
    assert [o.token_ids for o in outs] == reference[:2]  # a text prompt = its ids; a mixed list works
    for o in outs:
        assert o.text == tok.decode(o.token_ids, skip_special_tokens=True) and o.finish_reason == "length"
    hf_ids = hf_generate(path, outs[0].prompt_token_ids, MAX, min_new_tokens=MAX)
    assert outs[0].token_ids == hf_ids  # an oracle we did not write


def test_generation_config_eos_stops_like_transformers(ckpt, reference, tmp_path):
    path, tok = ckpt
    late, i_late = first_at(reference[0], 8, MAX - 2)
    early, i_early = first_at(reference[0], 2, i_late)
    never = next(t for t in range(3, len(tok)) if t not in reference[0])
    # A list of eos ids in generation_config.json: the earliest emitted one ends the request.
    d = with_eos(path, tmp_path / "list", [late, never, early])
    eng = dg.compile_model(d, None, dg.CompileConfig(num_speculative_tokens=0, **NONE))
    assert set(eng.eos_token_ids) == {late, never, early}
    out = eng.generate([PROMPTS[0]], dg.SamplingParams(max_tokens=MAX))[0]
    assert out.token_ids == reference[0][: i_early + 1] and out.finish_reason == "stop"
    assert out.token_ids == hf_generate(d, out.prompt_token_ids, MAX)  # transformers reads the same file
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, local_files_only=True)
    assert set(CausalLM.from_hf(hf).cfg.eos_token_ids) == {late, never, early}  # a model object: its generation_config
    assert dg.compile_model(hf, None, dg.CompileConfig(num_speculative_tokens=0, **NONE)).tokenizer is not None
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    # An int in generation_config.json, another in config.json: both stop (the union).
    d = with_eos(path, tmp_path / "both", late, config_eos=early)
    eng = dg.compile_model(d, None, dg.CompileConfig(num_speculative_tokens=0, **NONE))
    assert eng.eos_token_ids == (early, late)
    out = eng.generate([PROMPTS[0]], dg.SamplingParams(max_tokens=MAX))[0]
    assert out.token_ids == reference[0][: i_early + 1] and out.finish_reason == "stop"


def test_stop_token_ids_and_ignore_eos(ckpt, reference, tmp_path):
    path, _ = ckpt
    eos, i_eos = first_at(reference[2], 4, MAX - 2)
    stop, i_stop = first_at(reference[2], 1, i_eos)
    eng = dg.compile_model(
        with_eos(path, tmp_path / "c", eos), None, dg.CompileConfig(num_speculative_tokens=0, **NONE)
    )
    outs = eng.generate(
        [PROMPTS[2]] * 3,
        [
            dg.SamplingParams(max_tokens=MAX),
            dg.SamplingParams(max_tokens=MAX, ignore_eos=True),
            dg.SamplingParams(max_tokens=MAX, ignore_eos=True, stop_token_ids=[stop]),  # a list is accepted
        ],
    )
    assert outs[0].token_ids == reference[2][: i_eos + 1] and outs[0].finish_reason == "stop"
    assert outs[1].token_ids == reference[2] and outs[1].finish_reason == "length"
    assert outs[2].token_ids == reference[2][: i_stop + 1] and outs[2].finish_reason == "stop"
    with pytest.raises(ValueError, match=r"stop_token_ids \[300\] lie outside the vocabulary \[0, 300\)"):
        eng.add_request("hello", dg.SamplingParams(stop_token_ids=(300,)))
    with pytest.raises(ValueError, match=r"stop_token_ids=2 must be a list of token ids"):
        dg.SamplingParams(stop_token_ids=2)


def test_eos_mid_speculative_step_with_a_drafter(ckpt, tmp_path):
    """A speculative step emits several tokens; an eos among them (not last) ends the request there."""
    path, _ = ckpt

    def run(d, params):
        target = CausalLM.from_pretrained(d)
        eng = dg.compile_model(
            target, truncated_draft_model(target, 2), dg.CompileConfig(num_speculative_tokens=3, **NONE)
        )
        eng.step_log = []
        return eng.generate([[0, 5, 9, 17]], params)[0], eng.step_log

    out, log = run(path, dg.SamplingParams(max_tokens=40, ignore_eos=True))
    ref = out.token_ids
    # The first token that is first emitted before the last place of a multi-token step.
    done, pick = 0, None
    for entry in log:
        n = len(entry["emitted"])
        for j in range(min(n - 1, len(ref) - done)):
            if pick is None and ref.index(ref[done + j]) == done + j:
                pick = done + j
        done += n
    assert pick is not None, "no step emitted two tokens: the drafter was never accepted"
    out, log2 = run(with_eos(path, tmp_path / "mid", ref[pick]), dg.SamplingParams(max_tokens=40))
    assert out.token_ids == ref[: pick + 1] and out.finish_reason == "stop"
    emitted = sum(len(e["emitted"]) for e in log2)
    assert emitted > len(out.token_ids)  # the last step emitted past the eos: those tokens were dropped


def test_streaming_adds_up_to_the_outputs(ckpt):
    path, tok = ckpt
    target = CausalLM.from_pretrained(path)
    eng = dg.compile_model(
        target, truncated_draft_model(target, 2), dg.CompileConfig(num_speculative_tokens=3, **NONE), tokenizer=path
    )
    params = dg.SamplingParams(max_tokens=MAX, ignore_eos=True)
    expected = eng.generate(PROMPTS, params)
    ids, text, finals = {i: [] for i in range(3)}, {i: "" for i in range(3)}, {}
    for d in eng.stream(PROMPTS, params):
        assert d.token_ids and d.index not in finals  # nothing after a request's last delta
        ids[d.index] += d.token_ids
        text[d.index] += d.text
        if d.output is not None:
            finals[d.index] = d.output
    for i, out in enumerate(expected):
        assert ids[i] == out.token_ids == finals[i].token_ids  # nothing lost or duplicated
        assert text[i] == out.text == finals[i].text


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_incremental_detokenizer_waits_for_whole_characters(ckpt, chunk):
    _, tok = ckpt
    s = "日本語 é ok ü"
    ids = tok(s, add_special_tokens=False).input_ids + [1]  # and a special token (</s>), skipped
    assert len(ids) > 2 * len(s.replace(" ", ""))  # the characters really are split over byte tokens
    det, pieces = IncrementalDetokenizer(tok), []
    for k in range(0, len(ids), chunk):  # as speculative steps would deliver them
        pieces.append(det.push(ids[k : k + chunk]))
    pieces.append(det.finish())
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == s == tok.decode(ids, skip_special_tokens=True)


def test_text_needs_a_tokenizer(ckpt, tmp_path):
    path, _ = ckpt
    target, drafter = builtin_pair()
    eng = dg.compile_model(target, drafter, dg.CompileConfig(num_speculative_tokens=3, **NONE))
    assert eng.tokenizer is None and len(eng.generate([[1, 2]], dg.SamplingParams(max_tokens=3))[0].token_ids) == 3
    with pytest.raises(ValueError, match=r"prompt 'hello' is text, but this engine has no tokenizer; pass compile"):
        eng.generate(["hello"])
    assert dg.compile_model(path, None, dg.CompileConfig(**NONE), tokenizer=False).tokenizer is None
    with pytest.raises(FileNotFoundError, match="holds no tokenizer"):
        dg.compile_model(target, None, dg.CompileConfig(**NONE), tokenizer=str(tmp_path))


def test_cli_text_prompts(ckpt, tmp_path, capsys):
    from draftgraph.cli import main

    path, tok = ckpt
    eng = dg.compile_model(path, None, dg.CompileConfig(num_speculative_tokens=0, **NONE))
    want = [o.text for o in eng.generate(PROMPTS[:2], dg.SamplingParams(max_tokens=8))]
    file = tmp_path / "prompts.txt"
    file.write_text(PROMPTS[1] + "\n\n")
    args = ["generate", "--target", path, "--mode", "NONE", "--max-tokens", "8", "--max-num-seqs", "4"]
    assert main([*args, "--prompt", PROMPTS[0], "--prompts-file", str(file)]) == 0
    printed = capsys.readouterr().out
    for i, text in enumerate(want):
        assert f"--- [{i}] prompt: {PROMPTS[i]!r} (" in printed and f"\n{text}\n--- [{i}] 8 tokens" in printed
    assert main([*args, "--prompt", PROMPTS[0], "--stream"]) == 0
    assert f"prompt: {PROMPTS[0]!r}\n\n{want[0]}\n(8 tokens, finish: length)" in capsys.readouterr().out
    assert main(["generate", "--mode", "NONE", "--prompt", "hi"]) == 2  # the built-in pair: no tokenizer
    assert "text prompts need a tokenizer and the built-in pair has none; pass --tokenizer" in capsys.readouterr().err
