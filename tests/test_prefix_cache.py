"""Automatic prefix caching (runtime/prefix_cache.py): requests sharing a 160-token prefix give transformers'
greedy tokens when a later call (or a later arrival in the same call) finds it cached, for Llama-3 with a draft
model, DeepSeek-V3 with MTP and Qwen3.5 with MTP (Gated DeltaNet state snapshots: runtime/state_snapshots.py), in
NONE and FULL_AND_PIECEWISE; a hit's tokens are not computed again; the drafts equal an engine without the cache
(a cached block's drafter entries are final: a head drafter's last entry of a block reads the token after it);
eviction under a small cache (and a small snapshot pool) loses nothing; every block is free with no reference once
requests finish.

Blocks of 16: the prefix is 10 blocks. Every request's token after the prefix differs, so a head drafter (MTP,
whose chain hashes the token after each block) shares 9 blocks and a draft model 10. Qwen3.5 hits only up to a
state snapshot: chunk ends on a boundary (64, 128), each prompt's last full block (160), and where a lookup found
blocks past the last snapshot (144, left by the first request that diverged there)."""

import logging

import pytest
import torch

import draftgraph as dg
from draftgraph.models.builtin import builtin_drafter
from draftgraph.models.causal_lm import CausalLM
from tests.helpers import hf_greedy, tiny_deepseek_model, tiny_hf_model
from tests.test_qwen3_5 import tiny_qwen3_5

G = torch.Generator().manual_seed(5)
PREFIXES = [torch.randint(0, 96, (160,), generator=G).tolist() for _ in range(2)]
# requests 0-3 share prefix 0 (two calls of two), 4-5 share prefix 1 (one call, staggered arrivals)
PROMPTS = [
    PREFIXES[i // 4] + [10 + i] + torch.randint(0, 96, (n,), generator=G).tolist()
    for i, n in enumerate((3, 9, 6, 12, 5, 7))
]
CALLS = [((0, 1), (0, 0)), ((2, 3), (0, 1)), ((4, 5), (0, 3))]  # (requests, arrival steps)
MAX_TOKENS = 6
LLAMA3 = dict(
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
)
FAMILIES = {  # hf model, drafter kind, blocks shared by a request with another's prefix
    "llama3-draft_model": (lambda: tiny_hf_model("llama", **LLAMA3), "draft_model", 10),
    "deepseek-mtp": (tiny_deepseek_model, "mtp", 9),
    "qwen3_5-mtp": (tiny_qwen3_5, "mtp", 9),
}


def hit_tokens(name: str) -> list[int]:
    """Tokens found cached per call of CALLS: call 1's second request joins at the third step and finds the 8 blocks
    (and the snapshot at 128) the first one's two chunks completed; call 2: both find call 1's prefix; call 3: the
    second arrival (step 3) finds the first's blocks, registered as its prefill completed them. Qwen3.5 with MTP:
    call 1's prompts left snapshots at 64, 128 and 160 (past what MTP's chains share): call 2's first request hits
    128 and ends its first chunk at 144, where the second then hits; call 3's second finds 128."""
    shared = FAMILIES[name][2] * 16
    return [128, 128 + 144, 128] if name.startswith("qwen3_5") else [128, 2 * shared, shared]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    make_hf, kind, shared = FAMILIES[request.param]
    hf = make_hf()
    target = CausalLM.from_hf(hf)
    return {"target": target, "drafter": builtin_drafter(kind, target), "shared": shared, "name": request.param,
            "reference": hf_greedy(hf, PROMPTS, MAX_TOKENS)}  # fmt: skip


def engine(fam, mode="NONE", **config):
    fields = dict(
        mode=mode,
        num_speculative_tokens=3,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        block_size=16,
        capture_sizes=(1, 2, 4, 8, 16, 32, 64, 68) if mode != "NONE" else (),
        compile_backend="eager",
        progress=False,
        gpu_memory_utilization=0.0,  # on CUDA too: a cache of max_num_seqs requests, or num_kv_blocks
    )
    cfg = dg.CompileConfig(**{**fields, **config})
    return dg.compile_model(fam["target"], fam["drafter"], cfg)


def run_calls(eng, calls=CALLS):
    """Each call's outputs (by request) and prefix-cache stats; every block free and unreferenced after each."""
    eng.step_log = []
    outs, stats = {}, []
    for reqs, arrivals in calls:
        got = eng.generate([PROMPTS[i] for i in reqs], dg.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
                           list(arrivals))  # fmt: skip
        outs.update({i: o.token_ids for i, o in zip(reqs, got)})
        stats.append(eng.stats()["prefix_cache"])
        alloc = eng.allocator
        assert alloc.num_free == alloc.num_blocks and not any(alloc.ref_count(b) for b in range(alloc.num_blocks))
    return outs, stats


def drafts_by_request(eng) -> dict:
    """The drafts each request verified, step by step (the drafter's KV decides them)."""
    out = {}
    for e in eng.step_log:
        out.setdefault(e["request"], []).append(list(e["verified"]))
    return out


@pytest.mark.parametrize("mode", ["NONE", "FULL_AND_PIECEWISE"])
def test_a_shared_prefix_is_computed_once_and_tokens_equal_transformers(family, mode):
    eng = engine(family, mode)
    outs, stats = run_calls(eng)
    assert [outs[i] for i in range(len(PROMPTS))] == family["reference"]
    lens = [len(p) for p in PROMPTS]
    hits = hit_tokens(family["name"])
    assert [(s["query_tokens"], s["hit_tokens"]) for s in stats] == [
        (lens[0] + lens[1], hits[0]),
        (lens[2] + lens[3], hits[1]),
        (lens[4] + lens[5], hits[2]),
    ]
    # a hit is not computed again: the models ran every prompt token but those found cached, once
    assert [s["prefill_tokens"] for s in stats] == [s["query_tokens"] - s["hit_tokens"] for s in stats]
    assert stats[1]["hit_blocks"] == hits[1] // 16 and stats[1]["enabled"]
    if family["name"].startswith("qwen3_5"):  # every hit restored a snapshot; the pool: max_num_seqs slots
        snaps = stats[-1]["state_snapshots"]
        assert snaps["restored"] == 4 and snaps["slots"] == 4 and snaps["taken"] >= 4
    if mode != "NONE":
        c = eng.compiled.counters
        assert c.traces["target"] == 1 and c.traces["drafter"] == 1  # one trace each, whatever the offsets
        # dispatched (no graphs on the CPU: each forward counts as a fallback by its key): decode steps to the
        # one-graph step, prefill chunks after a cached prefix to pieces
        keys = eng.stats()["fallbacks_by_key"]
        assert any(k.startswith("step/") for k in keys) and any("/piecewise/" in k for k in keys)


def test_cached_blocks_hold_what_a_recomputation_writes(family):
    """Request 2 runs after requests 0 and 1 (sharing their prefix), and alone on an engine without the cache: its
    cached chain's blocks hold the same target and drafter entries, and it verifies the same drafts. With MTP the
    last prefix block's drafter entries read the token after it (request 2's own), so that block is its own."""
    eng = engine(family)
    outs, _ = run_calls(eng, [((0, 1), (0, 0)), ((2,), (0,))])
    plain = engine(family, prefix_caching=False)
    plain_outs, plain_stats = run_calls(plain, [((2,), (0,))])  # alone: its blocks are 0, 1, 2, ...
    assert plain_outs[2] == outs[2] == family["reference"][2]
    assert plain_stats[0]["hit_tokens"] == 0 and not plain_stats[0]["enabled"] and plain.allocator.num_cached == 0
    assert drafts_by_request(eng)[2] == drafts_by_request(plain)[0]
    tokens = PROMPTS[2] + outs[2]
    blocks = eng.allocator.lookup(eng.scheduler.prefix.extend([], tokens, len(tokens) // 16))
    assert len(blocks) == 10 and len(set(blocks)) == 10
    for ours, theirs in ((eng.runner.target_cache, plain.runner.target_cache),
                         (eng.runner.draft_cache, plain.runner.draft_cache)):  # fmt: skip
        for i, (layer_ours, layer_theirs) in enumerate(zip(ours.layers, theirs.layers, strict=True)):
            if i in ours.spec.linear_layers:  # Gated DeltaNet: no blocks (its state is per request)
                continue
            for a, b in zip(layer_ours, layer_theirs, strict=True):
                torch.testing.assert_close(a[blocks], b[: len(blocks)], atol=1e-5, rtol=1e-5)


def test_a_cached_prefix_gives_the_logprobs_of_a_recomputation(family):
    """Request 2 after requests 0 and 1 (a hit) and alone without the cache: the same logprobs, closer than tokens
    can tell (Qwen3.5: a wrong restored Gated DeltaNet state moves this tiny model's logprobs by ~2e-4)."""
    params = dg.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    eng = engine(family)
    eng.generate([PROMPTS[0], PROMPTS[1]], params)
    cached = eng.generate([PROMPTS[2]], params)[0]
    assert eng.stats()["prefix_cache"]["hit_tokens"] > 0
    plain = engine(family, prefix_caching=False).generate([PROMPTS[2]], params)[0]
    assert cached.token_ids == plain.token_ids == family["reference"][2]
    for ours, theirs in zip(cached.logprobs, plain.logprobs, strict=True):
        assert ours.keys() == theirs.keys()
        torch.testing.assert_close(list(ours.values()), list(theirs.values()), atol=2e-5, rtol=0)


def test_eviction_under_a_small_cache_loses_nothing(family):
    # 14 blocks of 16: a request needs up to 12, so the cached prefixes are evicted as requests come and go; Qwen3.5
    # keeps 2 state snapshots, so they are evicted too (hits shorten to the snapshots left).
    eng = engine(family, num_kv_blocks=14, max_num_seqs=2, prefix_state_snapshots=2)
    calls = [((0, 1), (0, 0)), ((4,), (0,)), ((2, 3, 5), (0, 0, 0))]
    outs, stats = run_calls(eng, calls)
    assert [outs[i] for i in range(len(PROMPTS))] == family["reference"]
    s = eng.stats()
    assert s["prefix_cache"]["evictions"] > 0 and sum(x["hit_tokens"] for x in stats) > 0
    if family["name"].startswith("qwen3_5"):
        snaps = s["prefix_cache"]["state_snapshots"]
        assert snaps["slots"] == 2 and snaps["evictions"] > 0 and snaps["restored"] > 0


def test_a_hybrid_draft_model_turns_prefix_caching_off_and_says_why(caplog):
    """Only the target's Gated DeltaNet state is snapshotted: a draft model with linear layers of its own turns the
    cache off (runtime/state_snapshots.py hybrid_support), and the engine still runs."""
    from draftgraph.models.builtin_qwen3_5 import builtin_qwen3_5_hf
    from draftgraph.models.drafters.loader import truncated_draft_model

    target = CausalLM.from_hf(builtin_qwen3_5_hf())
    with caplog.at_level(logging.INFO, logger="draftgraph"):
        eng = dg.compile_model(target, truncated_draft_model(target, 2), dg.CompileConfig(
            num_speculative_tokens=2, max_num_seqs=2, max_num_batched_tokens=32, max_model_len=64))  # fmt: skip
    assert eng.config.prefix_caching and eng.scheduler.prefix is None and eng.scheduler.snapshots is None
    assert "prefix caching off: the draft model has Gated DeltaNet layers too" in caplog.text
    out = eng.generate([PREFIXES[0][:40], PREFIXES[0][:40]], dg.SamplingParams(max_tokens=2, ignore_eos=True), [0, 3])
    assert out[0].token_ids == out[1].token_ids
    s = eng.stats()["prefix_cache"]
    assert not s["enabled"] and s["hit_tokens"] == 0 and eng.allocator.num_cached == 0
