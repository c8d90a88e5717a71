"""KV blocks allocated as sequences grow, preemption by recompute, and stats per generate() call (mode NONE).

Caches here are sized in blocks of 1 or 4 tokens so that a handful of short requests must be preempted.
Block 0 is taken away from the engine in the guarded runs: a draft step writing past the blocks its
request owns reads a zero table entry (block 0), which the guard on `drafting.advance` catches."""

import pytest
import torch

import draftgraph as dg
import draftgraph.runtime.drafting as drafting
from draftgraph.models.causal_lm import CausalLM
from draftgraph.runtime.request import Request
from draftgraph.runtime.step_writes import StepWrites
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model

G = torch.Generator().manual_seed(11)
PROMPTS = [torch.randint(0, 96, (n,), generator=G).tolist() for n in (14, 6, 20, 9, 17)]
MAX_TOKENS = 14


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", vocab_size=96)


@pytest.fixture(scope="module")
def target(hf):
    return CausalLM.from_hf(hf)


@pytest.fixture(scope="module")
def reference(hf):
    """transformers' greedy generate, one prompt at a time."""
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    out = []
    for p in PROMPTS:
        ids = torch.tensor([p])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
                              min_new_tokens=MAX_TOKENS)  # fmt: skip
        out.append(ref[0, len(p) :].tolist())
    return out


def engine(target, kind=None, k=3, blocks=0, block_size=4, seqs=8):
    drafter = make_drafter(kind, target) if kind else None
    # A short max_model_len keeps the CPU reference attention (which reads whole block tables) fast.
    cfg = dg.CompileConfig(num_speculative_tokens=k if kind else 0, max_num_seqs=seqs, max_num_batched_tokens=64,
                           num_kv_blocks=blocks, block_size=block_size, max_model_len=48)  # fmt: skip
    return dg.compile_model(target, drafter, cfg)


@pytest.fixture
def guard(monkeypatch):
    """Fail any later draft step that writes a position outside its request's blocks; count the steps that
    wrote the last position a request owned (the worst case allocated for is reached, not exceeded)."""
    seen = {"tight": 0}
    original = drafting.advance

    def checked(tables, pos, valid, block_size):
        owned = (tables != 0).sum(1)  # [B] blocks owned: block 0 belongs to nobody
        block = tables.gather(1, (pos // block_size)[:, None])[:, 0]
        assert bool(((block != 0) | ~valid).all()), "a draft step wrote past its request's blocks"
        seen["tight"] += int(((pos == owned * block_size - 1) & valid).sum())
        return original(tables, pos, valid, block_size)

    monkeypatch.setattr(drafting, "advance", checked)
    return seen


@pytest.mark.parametrize("kind", [None, "eagle", "draft_model", "ngram"])
def test_preempted_requests_still_equal_transformers(target, reference, guard, kind):
    # K=3: a request needs at most 20 + 14 - 2 + 2K (+1 for a draft model) = 39 positions, so 44 blocks of
    # one token (43 usable) hold one request at its longest but not five: they must be preempted.
    eng = engine(target, kind, blocks=44, block_size=1)
    assert eng.allocator.allocate(1) == [0]
    params = dg.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = eng.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == reference
    s = eng.stats()
    assert s["preemptions"] > 0 and s["generated_tokens"] == len(PROMPTS) * MAX_TOKENS
    assert eng.allocator.num_free == 43  # every block came back
    assert s["prefix_cache"]["hit_tokens"] > 0  # recomputations found blocks they had registered before preemption
    if kind and kind != "ngram":  # (the n-gram drafter writes no KV: runtime/ngram_state.py)
        assert guard["tight"] > 0  # some draft step wrote the last position its request owned


def test_sampled_run_with_preemption_equals_a_big_cache(target):
    params = [dg.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_p=0.9, seed=i, ignore_eos=True)
              for i in range(len(PROMPTS))]  # fmt: skip
    outs, stats = {}, {}
    for blocks in (0, 11):  # 0: room for every request at max_model_len; 11 blocks of 4: preemptions
        eng = engine(target, "eagle", blocks=blocks)
        outs[blocks] = [o.token_ids for o in eng.generate(PROMPTS, params)]
        stats[blocks] = eng.stats()
    assert stats[0]["preemptions"] == 0 and stats[11]["preemptions"] > 0
    assert 0 < stats[11]["accepted_tokens"] < stats[11]["draft_tokens"]  # sampled drafts accepted and rejected
    assert outs[11] == outs[0]


def test_more_requests_run_than_worst_case_reservation_admits(target):
    prompts = [p[:8] for p in PROMPTS] + [PROMPTS[0][8:]]  # 6 requests of 6 to 8 prompt tokens
    params = dg.SamplingParams(max_tokens=16, ignore_eos=True)
    # Reserving prompt + max_tokens + 2K + 2 = 32 positions (8 blocks of 4) at admission fits 2 requests in 16
    # blocks. Growing, a new request takes ceil((8 + K - 1) / 4) = 3 blocks: 5 of them start at once.
    eng = engine(target, "eagle", blocks=16)
    running = []
    run = eng.runner.run
    eng.runner.run = lambda batch, **kw: running.append(len(batch.decodes) + len(batch.prefills)) or run(batch, **kw)
    outs = [o.token_ids for o in eng.generate(prompts, params)]
    assert max(running) >= 5 > 16 // 8
    assert eng.stats()["preemptions"] > 0
    assert outs == [o.token_ids for o in engine(target, "eagle").generate(prompts, params)]


def test_stats_belong_to_one_generate_call(target):
    params = dg.SamplingParams(max_tokens=8, ignore_eos=True)
    eng = engine(target, "eagle")
    eng.generate(PROMPTS, params)
    first = eng.stats()
    eng.generate(PROMPTS[:2], params)
    second = eng.stats()
    fresh = engine(target, "eagle")
    fresh.generate(PROMPTS[:2], params)
    alone = fresh.stats()
    keys = ("steps", "verify_steps", "draft_tokens", "accepted_tokens", "generated_tokens", "acceptance_histogram",
            "preemptions", "dispatch")  # fmt: skip
    assert {k: second[k] for k in keys} == {k: alone[k] for k in keys}
    assert second["generated_tokens"] == 16 and first["generated_tokens"] == 8 * len(PROMPTS)
    eng.reset_stats()
    s = eng.stats()
    assert s["steps"] == s["generated_tokens"] == 0 and s["dispatch"] == {}


def test_a_request_too_big_for_the_cache_is_refused_before_anything_runs(target):
    eng = engine(target, "eagle", blocks=8)
    # 20 prompt tokens + 14 - 2 + 2K = 38 positions: 10 blocks of 4.
    with pytest.raises(ValueError, match=r"needs 10 KV blocks of 4 tokens .* the cache has 8; raise CompileConfig"):
        eng.generate(PROMPTS, dg.SamplingParams(max_tokens=MAX_TOKENS))
    assert not eng.has_unfinished()  # no request of the call was queued


def test_step_writes_and_linear_output():
    # K = 3, a decode at 10 cached positions feeds rows 10..13; its first draft is read at row 10 + a <= 13
    # and the two later draft steps write up to 15 (a draft model: one row further, 16).
    assert StepWrites(3, 0).slots(10, 4, samples=True) == 16
    assert StepWrites(3, 1).slots(10, 4, samples=True) == 17
    assert StepWrites(3, 1).slots(10, 5, samples=False) == 15  # a chunk that samples nothing: its rows only
    assert StepWrites(0, 0).slots(10, 1, samples=True) == 11  # no drafter
    req = Request(0, [1, 2, 3], dg.SamplingParams(max_tokens=4), seed=0)
    out, tokens = req.output, req.tokens
    req.append([5, 6], frozenset())
    req.append([7], frozenset())
    assert req.output is out and req.tokens is tokens  # appended in place, never rebuilt
    assert out == [5, 6, 7] and tokens == [1, 2, 3, 5, 6, 7] and req.to_output().token_ids == [5, 6, 7]
