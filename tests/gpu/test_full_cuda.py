"""GPU tier: FULL graphs (whole forward, attention inside) for uniform batches, and the fused draft loop.

The lossless suite gives identical tokens in NONE, PIECEWISE, FULL and FULL_AND_PIECEWISE (and
acceptance within a few drafts: see the test's comment); the counters prove full graphs and the fused
loop replayed for uniform batches; every request count 1..65 replays across the padding boundaries
(65 falls back); the profiler shows which kernels ran from graphs.
"""

import pytest
import torch

import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model
from tests.test_engine import KINDS, ragged

pytestmark = pytest.mark.gpu
SIZES = (1, 2, 4, 8, 16, 32, 64, 72)


@pytest.fixture(scope="module")
def target():
    torch.backends.cuda.matmul.allow_tf32 = False
    return CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96), device="cuda", attn_impl="triton")


def run(target, kind, mode, k=3, capture="eager", **over):
    prompts, params, arrivals = ragged(16)
    cfg = dg.CompileConfig(
        **{"gpu_memory_utilization": 0.0, **over},  # 0.0: a KV cache of max_num_seqs requests, not sized from memory
        capture=capture,
        mode=mode,
        num_speculative_tokens=k,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        device="cuda",
        capture_sizes=SIZES,
        full_capture_sizes=(1, 2, 4, 8),
        progress=False,
        check_addresses=True,
    )
    eng = dg.compile_model(target, make_drafter(kind, target), cfg)
    out = [o.token_ids for o in eng.generate(prompts, params, arrivals)]
    return out, eng.stats(), eng


def none_runs() -> dict:
    """Mode NONE with each drafter kind (in a side process beside the tier: tests/gpu/side_process.py)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    target = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96), device="cuda", attn_impl="triton")
    runs = {}
    for kind in KINDS:
        tokens, stats, _ = run(target, kind, "NONE")
        runs[kind] = {"tokens": tokens, **{f: stats[f] for f in ("accepted_tokens", "acceptance_histogram")}}
    return runs


@pytest.mark.side_reference.with_args(none_runs)
@pytest.mark.parametrize("kind", KINDS)
def test_every_mode_gives_the_same_tokens_and_acceptance(target, side_reference, kind):
    ref_stats = side_reference(none_runs)[kind]
    ref = ref_stats["tokens"]
    for mode in ("PIECEWISE", "FULL", "FULL_AND_PIECEWISE"):
        out, stats, eng = run(target, kind, mode)
        assert out == ref, mode
        # Acceptance depends on the drafter's argmax; the compiled drafter rounds differently from eager in
        # the last bits, and random heads have near-tied logits, so a few drafts may flip (tokens cannot:
        # the target decides them). Bound the gap; the printed histograms go to docs/performance.md.
        gap = abs(stats["accepted_tokens"] - ref_stats["accepted_tokens"])
        assert gap <= max(3, 0.1 * ref_stats["accepted_tokens"]), (mode, stats["acceptance_histogram"])
        replays = eng.compiled.counters.graph_replays
        full = {k: v for k, v in replays.items() if "/full/" in k}
        if mode != "PIECEWISE":
            assert full, f"{mode}: no full graph replayed"
            # A uniform batch's whole step (verify: 1 + K = 4 tokens per request, acceptance, the first draft
            # step and the K - 1 later ones) is one graph: no verify, loop or first-step graph of its own.
            assert any(k.startswith("step/q4/") and k.endswith("/greedy") for k in replays), dict(replays)
            assert any(k.startswith("drafter/full/q1/") for k in full)  # mixed batches' later draft steps
            first = "q4" if kind != "draft_model" else "q5"  # the first draft step's shape
            own = ("target/full/q4/", f"drafter/full/{first}/", "drafter/loop/")
            assert not any(k.startswith(own) for k in replays)
        print(
            f"{kind} {mode}: acceptance {stats['acceptance_histogram']} (NONE {ref_stats['acceptance_histogram']}); "
            f"full graph replays {sum(full.values())}"
        )


def test_lazy_capture_captures_what_steps_use(target):
    """capture="lazy": nothing captured at start; each graph at the first step that needs it; the same
    tokens as eager capture, no fallbacks, fewer graphs."""
    ref, _, eager = run(target, "eagle", "FULL_AND_PIECEWISE")
    out, stats, lazy = run(target, "eagle", "FULL_AND_PIECEWISE", capture="lazy")
    assert out == ref and stats["fallbacks"] == 0
    assert "lazily" in lazy.warm_up_report
    n_eager, n_lazy = eager.compiled.counters.graphs_captured, lazy.compiled.counters.graphs_captured
    replayed = {k for k, v in lazy.compiled.counters.graph_replays.items() if v}
    assert 0 < n_lazy < n_eager and len(replayed) <= n_lazy
    assert stats["compile"]["graph_memory_bytes"] > 0
    again = lazy.generate(*ragged(16))  # the same steps again: nothing new to capture
    assert lazy.compiled.counters.graphs_captured == n_lazy and [o.token_ids for o in again] == ref
    print(f"lazy capture: {n_lazy} graphs captured by the steps, against {n_eager} captured eagerly")


@pytest.mark.whole_device
def test_lazy_capture_with_kv_sizing_captures_only_the_largest_sizes_at_start(target):
    """capture="lazy" with the KV cache sized from free memory: the sizing probe captures the largest FULL request
    count and piece size only (every graph goes into one pool, largest first: those bound it), the steps capture
    the rest; the same tokens as eager capture, no fallbacks."""
    ref, _, eager = run(target, "eagle", "FULL_AND_PIECEWISE")
    n_eager = eager.compiled.counters.graphs_captured
    del eager
    prompts, params, arrivals = ragged(16)
    cfg = dg.CompileConfig(
        capture="lazy", mode="FULL_AND_PIECEWISE", num_speculative_tokens=3, max_num_seqs=8, max_num_batched_tokens=64,
        device="cuda", gpu_memory_utilization=0.3, capture_sizes=SIZES, full_capture_sizes=(1, 2, 4, 8),
        progress=False, check_addresses=True,
    )  # fmt: skip
    eng = dg.compile_model(target, make_drafter("eagle", target), cfg)
    at_start = eng.compiled.counters.graphs_captured
    assert 0 < at_start < n_eager / 4, (at_start, n_eager)  # 1 of 4 FULL counts and 1 of 8 piece sizes
    assert eng.memory_plan is not None and eng.memory_plan.num_blocks > 0
    out = [o.token_ids for o in eng.generate(prompts, params, arrivals)]
    assert out == ref and eng.stats()["fallbacks"] == 0
    assert eng.compiled.counters.graphs_captured > at_start  # the steps captured the sizes they needed
    print(f"lazy capture, KV sized: {at_start} graphs at start, {eng.compiled.counters.graphs_captured} after")


def test_penalties_and_logprobs_run_inside_the_step_graph(target):
    """Requests with penalties, logit bias, min_tokens and logprobs on CUDA: FULL_AND_PIECEWISE gives NONE's tokens
    and logprobs, the uniform batches replay the "_penalties" step graphs (captured at the first step that needs
    one), and nothing falls back."""
    import dataclasses

    prompts, params, arrivals = ragged(16)
    extra = [dict(repetition_penalty=1.3), dict(presence_penalty=0.5, frequency_penalty=0.4, logprobs=2),
             dict(min_tokens=4, logit_bias={3: 2.0}), {}]  # fmt: skip
    params = [dataclasses.replace(p, **extra[i % len(extra)]) for i, p in enumerate(params)]
    outs = {}
    for mode in ("NONE", "FULL_AND_PIECEWISE"):
        cfg = dg.CompileConfig(mode=mode, num_speculative_tokens=3, max_num_seqs=8, max_num_batched_tokens=64,
                               device="cuda", gpu_memory_utilization=0.0, capture_sizes=SIZES,
                               full_capture_sizes=(1, 2, 4, 8), progress=False, check_addresses=True)  # fmt: skip
        with dg.compile_model(target, make_drafter("draft_model", target), cfg) as eng:
            outs[mode] = eng.generate(prompts, params, arrivals)
            replays = dict(eng.compiled.counters.graph_replays) if eng.compiled is not None else {}
            stats = eng.stats()
    assert [o.token_ids for o in outs["FULL_AND_PIECEWISE"]] == [o.token_ids for o in outs["NONE"]]
    for a, b in zip(outs["FULL_AND_PIECEWISE"], outs["NONE"]):
        assert (a.logprobs is None) == (b.logprobs is None)
        for x, y in zip(a.logprobs or [], b.logprobs or []):
            assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-3 for t in x)
    assert stats["fallbacks"] == 0
    assert any(k.startswith("step/q4/") and "_penalties" in k and v for k, v in replays.items()), replays
    print({k: v for k, v in replays.items() if k.startswith("step/")})


def test_drafts_get_the_penalties_on_cuda(target):
    """A draft model of all the target's layers under repetition penalty 1.5, FULL_AND_PIECEWISE on CUDA: each draft
    step's logits go through the Triton processing as the next verify's row, so (nearly) every draft is accepted,
    and the tokens are NONE's (tests/test_penalties.py: 0.245 accepted when drafts were not processed)."""
    from draftgraph.models.drafters import truncated_draft_model

    prompts, params, arrivals = ragged(8)
    params = [dg.SamplingParams(max_tokens=p.max_tokens, ignore_eos=True, repetition_penalty=1.5) for p in params]
    outs, stats = {}, {}
    for mode in ("NONE", "FULL_AND_PIECEWISE"):
        cfg = dg.CompileConfig(mode=mode, num_speculative_tokens=3, max_num_seqs=8, max_num_batched_tokens=64,
                               device="cuda", gpu_memory_utilization=0.0, capture_sizes=SIZES,
                               full_capture_sizes=(1, 2, 4, 8), progress=False)  # fmt: skip
        with dg.compile_model(target, truncated_draft_model(target, target.cfg.num_layers), cfg) as eng:
            outs[mode] = [o.token_ids for o in eng.generate(prompts, params, arrivals)]
            stats[mode] = eng.stats()
    assert outs["FULL_AND_PIECEWISE"] == outs["NONE"]
    rates = {m: s["acceptance_rate"] for m, s in stats.items()}
    assert min(rates.values()) >= 0.9 and stats["FULL_AND_PIECEWISE"]["fallbacks"] == 0, rates
    print(f"acceptance with repetition penalty 1.5 and processed drafts: {rates}")


def test_reduced_vocabulary_drafts_get_the_penalties_on_cuda(target):
    """EAGLE-3 over 5/8 of the vocabulary (d2t) under repetition penalty 1.5: its draft logits are processed inside
    the target's vocabulary at their target ids (runtime/drafting.py Chooser.processed) within the one-graph step's
    penalties variant; FULL_AND_PIECEWISE gives NONE's tokens with no fallback."""
    prompts, params, arrivals = ragged(8)
    params = [dg.SamplingParams(max_tokens=p.max_tokens, ignore_eos=True, repetition_penalty=1.5) for p in params]
    outs = {}
    for mode in ("NONE", "FULL_AND_PIECEWISE"):
        cfg = dg.CompileConfig(mode=mode, num_speculative_tokens=3, max_num_seqs=8, max_num_batched_tokens=64,
                               device="cuda", gpu_memory_utilization=0.0, capture_sizes=SIZES,
                               full_capture_sizes=(1, 2, 4, 8), progress=False)  # fmt: skip
        with dg.compile_model(target, make_drafter("eagle3_reduced", target), cfg) as eng:
            outs[mode] = [o.token_ids for o in eng.generate(prompts, params, arrivals)]
            s, replays = eng.stats(), eng.compiled.counters.graph_replays if eng.compiled else {}
    assert outs["FULL_AND_PIECEWISE"] == outs["NONE"]
    assert s["fallbacks"] == 0 and any(k.endswith("/greedy_penalties") for k in replays), dict(replays)


def _padding_engine(target, mode):
    cfg = dg.CompileConfig(
        mode=mode,
        num_speculative_tokens=3,
        max_num_seqs=65,
        max_num_batched_tokens=512,  # every prompt prefills in one step: then all decode together
        max_model_len=128,
        device="cuda",
        gpu_memory_utilization=0.0,  # a KV cache of max_num_seqs requests, not sized from memory
        progress=False,
        max_capture_reqs=64,
        capture_sizes=(1,),
        compile_backend="eager",  # padding and replay are under test here, not Inductor's code
        check_addresses=True,
        fuse_draft_loop=True,  # the fused loop inside the one-graph step: traced once for every size
    )
    return dg.compile_model(target, make_drafter("eagle", target), cfg)


def _padding_batch(n: int):
    prompts_all, _, _ = ragged(65)
    prompts = [p[:6] for p in prompts_all[:n]]  # short prompts: one prefill step, then uniform decodes
    return prompts, [dg.SamplingParams(max_tokens=6, ignore_eos=True)] * n


def padding_reference() -> list:
    """Mode NONE at every request count 1..65 (in a side process beside the tier: tests/gpu/side_process.py)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    eng = _padding_engine(CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96), device="cuda", attn_impl="triton"),
                          "NONE")  # fmt: skip
    return [[o.token_ids for o in eng.generate(*_padding_batch(n))] for n in range(1, 66)]


@pytest.mark.side_reference.with_args(padding_reference)
def test_every_request_count_across_padding(target, side_reference):
    """Uniform decode batches of 1..65 requests (64 captured): FULL for 1..64, padded to the next of 1, 2,
    4, 8, 16, 24, .., 64, and 65 falls back; tokens equal mode NONE at every count (run beside the tier)."""
    eng = _padding_engine(target, "FULL")
    full_sizes = eng.config.full_capture_sizes
    assert full_sizes[:5] == (1, 2, 4, 8, 16) and full_sizes[-1] == 64
    reference = side_reference(padding_reference)
    for n in range(1, 66):
        eng.runner.forwards.reset()
        assert [o.token_ids for o in eng.generate(*_padding_batch(n))] == reference[n - 1], n
        hits = eng.runner.forwards.hits
        padded = min([s for s in full_sizes if s >= n], default=None)
        if padded:
            assert hits[f"step/q4/b{padded}/greedy"] > 0, (n, dict(hits))  # the whole step: one graph
            assert all(int(key.split("/b")[1].split("/")[0]) <= padded for key in hits if "/b" in key)
        else:
            # 65 verifying requests exceed the bound: those steps fall back; once some requests finish, the
            # rest fit a captured size again
            assert n == 65 and hits["target/none"] > 0, dict(hits)
            assert eng.runner.forwards.fallbacks["target/none"] == hits["target/none"]
    c = eng.compiled.counters
    assert c.traces["draft_loop"] == 2  # greedy and sampled loops, each traced once for every size


def test_profiler_shows_the_step_runs_from_graphs(target):
    from draftgraph.runtime.profiling import profile_steps

    cfg = dg.CompileConfig(
        mode="FULL_AND_PIECEWISE",
        num_speculative_tokens=3,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        device="cuda",
        gpu_memory_utilization=0.0,  # a KV cache of max_num_seqs requests, not sized from memory
        progress=False,
    )
    eng = dg.compile_model(target, make_drafter("eagle", target), cfg)
    for i in range(8):
        eng.add_request([1 + i, 2, 3, 4], dg.SamplingParams(max_tokens=40, ignore_eos=True))
    eng.step()  # the prefill
    s = profile_steps(eng, 5)  # uniform decode steps: the whole step is one graph
    print(s.format())
    assert s.steps == 5
    assert s.graph_launches == 5  # one graph per step: verify, acceptance, the K drafts
    assert s.outside == 0 and s.in_graphs > 0, s.format()  # inputs go by copies, never by kernels
