"""The eager engine (mode NONE): lossless greedy speculative decoding for every drafter kind and K,
continuous batching with staggered arrivals and chunked prefill, stop conditions, transformers'
generate as an outside oracle, and acceptance counted independently."""

import pytest
import torch

import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model

KINDS = ["eagle", "eagle3", "mtp", "draft_model"]


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model("llama", vocab_size=96)


@pytest.fixture(scope="module")
def target(hf):
    return CausalLM.from_hf(hf)


def ragged(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (n,), generator=g).tolist()
    prompts = [torch.randint(0, 96, (m,), generator=g).tolist() for m in lengths]
    params = [dg.SamplingParams(max_tokens=4 + (7 * i) % 19, ignore_eos=True) for i in range(n)]
    arrivals = [(3 * i) // 2 for i in range(n)]  # staggered: one or two new requests every other step
    return prompts, params, arrivals


def engine(target, drafter=None, k=3, **kw):
    cfg = dict(num_speculative_tokens=k, max_num_seqs=8, max_num_batched_tokens=64)
    cfg.update(kw)
    return dg.compile_model(target, drafter, dg.CompileConfig(**cfg))


@pytest.fixture(scope="module")
def reference(target):
    """Greedy target-only outputs for the 16 ragged prompts (checked against transformers below)."""
    prompts, params, arrivals = ragged(16)
    outs = engine(target, None, k=0).generate(prompts, params, arrivals)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("kind", [*KINDS, "ngram"])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_lossless_greedy_every_drafter_and_k(target, reference, kind, k):
    prompts, params, arrivals = ragged(16)
    eng = engine(target, make_drafter(kind, target), k=k)
    outs = eng.generate(prompts, params, arrivals)
    assert [o.token_ids for o in outs] == reference
    s = eng.stats()
    assert s["draft_tokens"] == k * s["verify_steps"] and s["verify_steps"] > 0
    # The copy drafters, the truncated draft model and prompt lookup (a random model's outputs repeat) reach
    # real, partial acceptance, so the accepted and the rejected paths both ran.
    assert 0 < s["accepted_tokens"] < s["draft_tokens"]
    assert sum(s["acceptance_histogram"]) == s["verify_steps"]


def test_ngram_accepts_on_a_prompt_it_repeats(target):
    """Prompt lookup on a repetitive workload: each prompt holds the target's own continuation of it, then the
    prompt again; the output stays the target's alone and most drafts are accepted."""
    prompts, _, _ = ragged(4)
    params = dg.SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in engine(target, None, k=0).generate(prompts, [params] * 4)]
    repeated = [p + c + p for p, c in zip(prompts, plain)]
    ref = [o.token_ids for o in engine(target, None, k=0).generate(repeated, [params] * 4)]
    eng = engine(target, "ngram", k=3, ngram_min=1, ngram_max=3)
    assert [o.token_ids for o in eng.generate(repeated, [params] * 4)] == ref
    s = eng.stats()
    assert s["accepted_tokens"] > 0.3 * s["draft_tokens"] and eng.drafter is None  # no drafter model


@pytest.mark.parametrize("batch", [1, 5, 16])
def test_lossless_batch_sizes_all_at_once(target, reference, batch):
    prompts, params, _ = ragged(16)
    eng = engine(
        target, make_drafter("eagle", target), k=3, max_num_seqs=batch, max_num_batched_tokens=max(64, 4 * batch)
    )
    outs = eng.generate(prompts[:batch], params[:batch])
    assert [o.token_ids for o in outs] == reference[:batch]


def test_greedy_rows_stay_lossless_beside_sampling_rows(target, reference):
    prompts, params, arrivals = ragged(16)
    mixed = [
        p
        if i % 2 == 0
        else dg.SamplingParams(max_tokens=p.max_tokens, temperature=1.0, top_p=0.9, seed=i, ignore_eos=True)
        for i, p in enumerate(params)
    ]
    outs = engine(target, make_drafter("mtp", target), k=3).generate(prompts, mixed, arrivals)
    for i, out in enumerate(outs):
        if i % 2 == 0:
            assert out.token_ids == reference[i]
        else:
            assert len(out.token_ids) == params[i].max_tokens


def test_matches_transformers_generate(hf, target, reference):
    """An oracle we did not write: transformers' greedy generate, one prompt at a time."""
    prompts, params, _ = ragged(16)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    for i in range(16):
        with torch.no_grad():
            ids = torch.tensor([prompts[i]])  # explicit mask: generate would mask token 0 as padding
            ref = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=params[i].max_tokens,
                min_new_tokens=params[i].max_tokens,
            )
        assert reference[i] == ref[0, len(prompts[i]) :].tolist(), f"request {i}"


def test_acceptance_matches_an_independent_count(target, reference):
    """Recount acceptance from the drafts the engine verified and the target-only continuation."""
    prompts, params, arrivals = ragged(16)
    long_params = [dg.SamplingParams(max_tokens=p.max_tokens + 8, ignore_eos=True) for p in params]
    continuation = [o.token_ids for o in engine(target, None, k=0).generate(prompts, long_params)]
    eng = engine(target, make_drafter("draft_model", target), k=3)
    eng.step_log = []
    eng.generate(prompts, params, arrivals)
    emitted_so_far = {i: 0 for i in range(16)}
    histogram, total = [0] * 4, 0
    for entry in eng.step_log:
        rid, drafts = entry["request"], entry["verified"]
        done = emitted_so_far[rid]
        if drafts:
            truth = continuation[rid][done : done + len(drafts)]
            a = next((i for i, (d, t) in enumerate(zip(drafts, truth)) if d != t), len(drafts))
            histogram[a] += 1
            total += a
        emitted_so_far[rid] += len(entry["emitted"])
    s = eng.stats()
    assert s["accepted_tokens"] == total and s["acceptance_histogram"] == histogram
    assert s["mean_accepted_length"] == pytest.approx(1 + total / sum(histogram))


def test_stop_tokens_eos_and_max_tokens(target, reference):
    prompts, params, _ = ragged(16)
    stop_at = reference[2][3]  # a token request 2 emits at index 3 (its first occurrence ends it)
    first = reference[2].index(stop_at)
    eng = engine(target, make_drafter("eagle", target), k=3)
    outs = eng.generate(
        prompts[:3],
        [params[0], params[1], dg.SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=(stop_at,))],
    )
    assert outs[2].token_ids == reference[2][: first + 1] and outs[2].finish_reason == "stop"
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == params[0].max_tokens
    eos_model = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96, eos_token_id=stop_at))
    out = engine(eos_model, make_drafter("mtp", eos_model)).generate([prompts[2]], dg.SamplingParams(max_tokens=30))
    assert out[0].token_ids == reference[2][: first + 1] and out[0].finish_reason == "stop"


def test_long_prompts_prefill_in_chunks_beside_decodes(target):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (150, 3, 90, 7)]
    params = dg.SamplingParams(max_tokens=12, ignore_eos=True)
    ref = [o.token_ids for o in engine(target, None, k=0, max_num_batched_tokens=512).generate(prompts, params)]
    eng = engine(target, make_drafter("eagle3", target), k=2, max_num_seqs=4, max_num_batched_tokens=32)
    steps = []
    orig = eng.runner.run

    def spy(batch, **kw):
        steps.append((len(batch.decodes), [c.num_tokens for c in batch.prefills]))
        return orig(batch, **kw)

    eng.runner.run = spy
    outs = eng.generate(prompts, params, arrival_steps=[0, 0, 2, 5])
    assert [o.token_ids for o in outs] == ref
    assert any(d > 0 and chunks for d, chunks in steps)  # chunks ran beside decodes
    assert max(d * 3 + sum(c) for d, c in steps) <= 32  # the token budget held


def test_bad_input_is_refused_with_the_value(target):
    eng = engine(target, make_drafter("eagle", target))
    with pytest.raises(ValueError, match=r"prompt token ids \[96\] lie outside the vocabulary \[0, 96\)"):
        eng.add_request([1, 96])
    with pytest.raises(ValueError, match="max_num_batched_tokens=10 cannot hold a full decode batch"):
        dg.compile_model(
            target,
            make_drafter("eagle", target),
            dg.CompileConfig(num_speculative_tokens=3, max_num_seqs=8, max_num_batched_tokens=10),
        )
    with pytest.raises(ValueError, match="mode='FULLEST' is unknown; choose one of"):
        dg.CompileConfig(mode="FULLEST")
    with pytest.raises(ValueError, match="capture='later' is unknown; choose 'eager'"):
        dg.CompileConfig(capture="later")
    with pytest.raises(ValueError, match="temperature=-1"):
        dg.SamplingParams(temperature=-1)
