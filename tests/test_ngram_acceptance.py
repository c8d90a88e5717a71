"""Prompt lookup on a target that repeats itself (models/builtin.py: successor_target, TINY_SUCCESSOR, the structure
of the 1B target scripts/bench_e2e.py --ngram runs): its greedy next token is the last token's fixed successor, so
text it produced once, placed in its prompt, is what it produces again, and the n-gram drafter's drafts are
accepted; on a prompt without that text nothing is. Mode NONE on the CPU, float32: acceptance is a property of the
weights and the matcher, not of compiling (tests/gpu/test_ngram_cuda.py runs the graphs)."""

import pytest
import torch

import draftgraph as dg
from draftgraph.models.builtin import TINY_SUCCESSOR, BuiltinSpec, successor_target

K = 4
NEW = 48


@pytest.fixture(scope="module")
def run():
    """Plain and n-gram greedy outputs and the n-gram engine's stats, on 8 random prompts X (16 tokens) and on
    X + G + X (G: the target's own continuation of X)."""
    _, target, successor = successor_target(TINY_SUCCESSOR, dtype=torch.float32)
    cfg = dict(mode="NONE", max_num_seqs=8, progress=False)
    plain = dg.compile_model(target, None, dg.CompileConfig(**cfg))
    xs = torch.randint(0, TINY_SUCCESSOR.vocab_size, (8, 16), generator=torch.Generator().manual_seed(0)).tolist()
    params = dg.SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
    conts = [o.token_ids for o in plain.generate(xs, params)]
    repeated = [x + c + x for x, c in zip(xs, conts)]
    out = {"X": conts, "X+G+X": [o.token_ids for o in plain.generate(repeated, params)]}
    stats = {}
    for name, prompts in (("X", xs), ("X+G+X", repeated)):
        eng = dg.compile_model(target, "ngram", dg.CompileConfig(**cfg, num_speculative_tokens=K))
        out["ngram " + name] = [o.token_ids for o in eng.generate(prompts, params)]
        stats[name] = eng.stats()
    return xs, successor, out, stats


def test_the_greedy_next_token_is_the_last_tokens_successor(run):
    xs, successor, out, _ = run
    for x, c in zip(xs, out["X"]):
        assert successor[[x[-1], *c[:-1]]].tolist() == c
    assert out["X+G+X"] == out["X"]  # so after X + G + X it produces G again


def test_ngram_output_is_plain_decodings(run):
    _, _, out, _ = run
    assert out["ngram X"] == out["X"] and out["ngram X+G+X"] == out["X+G+X"]


def test_drafts_are_accepted_where_the_prompt_holds_the_text_and_not_elsewhere(run):
    *_, stats = run
    s = stats["X+G+X"]
    # measured 3.80 of 4: every step accepts all K but the last of each request (fewer tokens left than K + 1)
    assert s["accepted_tokens"] / s["verify_steps"] > 3.5, s["acceptance_histogram"]
    s = stats["X"]  # a random prompt: the successor chain does not come back within 48 tokens of 512
    assert s["verify_steps"] == 8 * (NEW - 1) and s["accepted_tokens"] == 0, s["acceptance_histogram"]


def test_successor_head_needs_untied_embeddings():
    with pytest.raises(ValueError, match="successor_head=True needs tie_word_embeddings=False"):
        BuiltinSpec(successor_head=True, tie_word_embeddings=True)
    with pytest.raises(ValueError, match="needs a spec with successor_head=True"):
        successor_target(BuiltinSpec())
    assert BuiltinSpec(late_from=0).first_late_layer == 0  # every layer scaled, the drafter's too
