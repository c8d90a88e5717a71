"""The fused draft loop on the CPU (graphs off, same code path): one Dynamo trace per variant holding all K
drafter forwards, the same tokens and acceptance as the step-by-step loop and as mode NONE, greedy and
sampled, and dispatch hits that show which artifact ran."""

import pytest
import torch

import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from draftgraph.runtime.drafting import advance
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model
from tests.test_engine import ragged

KINDS = ["eagle", "eagle3", "mtp", "draft_model"]
K = 3


@pytest.fixture(scope="module")
def target():
    return CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96))


def cfg(mode, backend="eager", **kw):
    base = dict(
        mode=mode,
        num_speculative_tokens=K,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        compile_backend=backend,
        progress=False,
    )
    base.update(kw)
    return dg.CompileConfig(**base)


def run(target, drafter, config, sampled=False):
    prompts, params, arrivals = ragged(16)
    if sampled:
        params = [
            dg.SamplingParams(
                max_tokens=p.max_tokens, ignore_eos=True, temperature=0.8, top_k=(0, 20)[i % 2], seed=i, top_p=0.95
            )
            for i, p in enumerate(params)
        ]
    eng = dg.compile_model(target, drafter, config)
    outs = eng.generate(prompts, params, arrivals)
    return eng, [o.token_ids for o in outs]


@pytest.mark.parametrize("one_graph", [True, False], ids=["one_graph_step", "verify_then_loop"])
@pytest.mark.parametrize("kind", KINDS)
def test_fused_loop_equals_step_by_step_and_none(target, kind, one_graph):
    drafter = make_drafter(kind, target)
    none, ref = run(target, drafter, cfg("NONE"))
    fused, toks = run(target, drafter, cfg("FULL_AND_PIECEWISE", one_graph_step=one_graph, fuse_draft_loop=True))
    assert toks == ref
    assert fused.stats()["accepted_tokens"] == none.stats()["accepted_tokens"] > 0

    c = fused.compiled.counters
    # One trace per loop variant (greedy, sampled), whatever the batch size; the loop graph holds all K
    # forwards: K x (drafter attention layers) attention ops. Split points around each drafter call make
    # its pieces the drafter's own (layers + 1 per call, compiled once for the drafter and shared); between
    # calls one piece chooses the token and advances the metadata (K of them, the last stacks the drafts);
    # one piece before the first call holds the input checks: 1 + K x (layers + 2) compute pieces.
    assert c.traces["draft_loop"] == 2 and c.traces["target"] == 1
    layers = drafter.num_kv_layers
    drafter_keys = {p.key for _, split in fused.compiled.drafter.backend.traces for p in split.compute_pieces}
    for gm, split in fused.compiled.loop_backend.traces:
        attn = [n for n in gm.graph.nodes if "paged_attention" in str(n.target)]
        assert len(attn) == K * layers
        assert len(split.compute_pieces) == 1 + K * (layers + 2)
        shared = [p for p in split.compute_pieces if p.key in drafter_keys]
        assert len(shared) == K * (layers + 1)  # every drafter piece in the loop reuses the drafter's compile
    # No CUDA graphs on the CPU: every forward ran without one, so it is a fallback counted by the key it was
    # dispatched to, and the graph keys never show up as having run.
    stats = fused.stats()
    assert stats["fallbacks"] == sum(stats["dispatch"].values()) > 0
    hits = stats["fallbacks_by_key"]
    q = K + 1 if kind != "draft_model" else K + 2
    loop_hits = sum(v for key, v in hits.items() if key.startswith(f"drafter/loop/q{q}/") and key.endswith("/greedy"))
    full_verify = sum(v for key, v in hits.items() if key.startswith("target/full/"))
    steps = sum(v for key, v in hits.items() if key.startswith(f"step/q{K + 1}/") and key.endswith("/greedy"))
    assert not any(key.startswith(f"drafter/full/q{q}/") for key in hits)  # no per-step first-step graphs
    if one_graph:  # every uniform batch ran its whole step as one function: no verify or loop of its own
        assert set(stats["dispatch"]) == {"target/none", "drafter/none", "step/none"}
        assert steps > 0 and loop_hits == full_verify == 0
        assert stats["dispatch"]["target/none"] == sum(v for key, v in hits.items() if key.startswith("target/"))
    else:
        assert set(stats["dispatch"]) == {"target/none", "drafter/none"}
        assert loop_hits == full_verify > 0 and steps == 0  # every FULL verify was followed by one fused proposal


@pytest.mark.parametrize("kind", ["eagle3", "draft_model"])
def test_sampled_fused_loop_equals_step_by_step(target, kind):
    """Sampling inside the loop: the same per-(seed, position) noise gives the same drafts, so the same
    acceptance, as the step-by-step loop (FULL with fusing off) and mode NONE."""
    drafter = make_drafter(kind, target)
    none, ref = run(target, drafter, cfg("NONE"), sampled=True)
    steps, toks_steps = run(
        target, drafter, cfg("FULL_AND_PIECEWISE", fuse_draft_loop=False, one_graph_step=False), sampled=True
    )
    fused, toks = run(target, drafter, cfg("FULL_AND_PIECEWISE", one_graph_step=False), sampled=True)  # auto: fused
    one, toks_one = run(target, drafter, cfg("FULL_AND_PIECEWISE"), sampled=True)  # the whole step: one function
    assert toks == toks_steps == toks_one == ref
    # fuse_draft_loop="auto": the loop is fused without the one-graph step, and runs around the compiled drafter
    # step inside it (no trace of its own)
    assert dict(fused.compiled.counters.traces)["draft_loop"] == 2
    assert one.compiled.loop_backend is None and set(one.compiled.counters.traces) == {"target", "drafter"}
    acc = [e.stats()["accepted_tokens"] for e in (none, steps, fused, one)]
    assert acc[0] == acc[1] == acc[2] == acc[3] > 0
    assert any(key.startswith("step/") and key.endswith("/sample") for key in one.stats()["fallbacks_by_key"])
    assert any(key.endswith("/sample") for key in fused.stats()["fallbacks_by_key"])  # dispatched, no graph
    assert not any("/loop/" in key for key in steps.stats()["fallbacks_by_key"])
    assert steps.compiled.loop_backend is None


def test_inductor_fused_loop_matches_eager(target):
    """The Inductor-compiled loop against the loop run eagerly on the same inputs, then end to end."""
    drafter = make_drafter("eagle", target)
    # Few sizes: every compiled size costs an Inductor compile on the CPU (FULL sizes 4, 16, 20 here).
    fused, toks = run(
        target,
        drafter,
        cfg("FULL", backend="inductor", capture_sizes=(4,), full_capture_sizes=(4,), fuse_draft_loop=True),
    )
    none, ref = run(target, drafter, cfg("NONE"))
    assert toks == ref and fused.stats()["accepted_tokens"] == none.stats()["accepted_tokens"]

    p = fused.runner.proposer
    b, q = 4, K + 1
    g = torch.Generator().manual_seed(0)
    meta, pos = fused.runner.target_meta.build(
        [dg.runtime.attn_metadata.RequestSlice(list(range(i * 4, i * 4 + 4)), 9 + i, q) for i in range(b)],
        num_tokens_padded=b * q,
        num_reqs_padded=b,
    )
    x = dict(
        input_ids=torch.randint(0, 96, (b * q,), generator=g),
        positions=pos,
        hidden=torch.randn(b * q, 64, generator=g),
        **{f: getattr(meta, f) for f in ("slot_mapping", "token_req", "token_kv_len", "block_tables")},
        seq_lens=meta.seq_lens,
        query_start_loc=meta.query_start_loc,
        sample_rows=torch.arange(b) * q + torch.tensor([0, 3, 1, 2]),
        valid=torch.tensor([True, True, True, False]),
        slots=torch.tensor([0, 1, 2, 8]),
        draft_probs=p.draft_probs,
    )
    from draftgraph.runtime.drafting import fused_loop_fn

    eager_loop = fused_loop_fn(drafter, p.choose, K, 16)[0]
    cache = fused.runner.draft_cache.layers
    x["kv_caches"] = cache
    saved = [(kk.clone(), v.clone()) for kk, v in cache]
    compiled = p.loops[0](**x)
    after_compiled = [(kk.clone(), v.clone()) for kk, v in cache]
    for (kk, v), (k0, v0) in zip(cache, saved):
        kk.copy_(k0), v.copy_(v0)
    eager = eager_loop(**x)
    assert compiled.shape == (b, K)
    assert torch.equal(compiled[:3], eager[:3])  # the padding row's drafts are never read
    for (kc, vc), (ke, ve) in zip(after_compiled, cache):  # the same KV written, padding wrote nothing
        torch.testing.assert_close(kc, ke, atol=2e-5, rtol=0)
        torch.testing.assert_close(vc, ve, atol=2e-5, rtol=0)
    assert fused.compiled.counters.traces["draft_loop"] == 2  # the direct call re-used the trace


def test_advance_masks_padding_rows():
    tables = torch.tensor([[3, 5], [7, 2], [0, 0]], dtype=torch.int32)
    pos = torch.tensor([17, 4, 30])
    positions, meta = advance(tables, pos, torch.tensor([True, True, False]), block_size=16)
    assert meta.slot_mapping.tolist() == [5 * 16 + 1, 7 * 16 + 4, -1]
    assert meta.token_kv_len.tolist() == [18, 5, 0] and meta.seq_lens.tolist() == [18, 5, 0]
    assert meta.token_req.tolist() == [0, 1, 2] and meta.query_start_loc.tolist() == [0, 1, 2, 3]
    assert positions.tolist() == [17, 4, 30]


def test_kernel_summary_counts_launches_by_their_launcher():
    from draftgraph.runtime.profiling import summarize_trace

    events = [
        {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "args": {"correlation": 1}},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "args": {"correlation": 2}},
        {"cat": "kernel", "name": "triton_poi_fused_0", "ts": 100, "dur": 4, "args": {"correlation": 1}},
        {"cat": "kernel", "name": "paged_attention_kernel", "ts": 106, "dur": 10, "args": {"correlation": 1}},
        {"cat": "kernel", "name": "argmax_kernel", "ts": 120, "dur": 2, "args": {"correlation": 2}},
        {"cat": "cpu_op", "name": "aten::mm", "args": {}},
    ]
    s = summarize_trace(events, steps=1)
    assert (s.graph_launches, s.in_graphs, s.outside) == (1, 2, 1)
    assert s.outside_by_name == {"argmax_kernel": 1}
    assert "2 (66.7%) from 1 CUDA graph replays, 1 launched outside" in s.format()
    assert s.kernel_us["paged_attention_kernel"] == 10 and s.span_us == 22  # 100 .. 122
    assert "16.0 us/step over a span of 22.0 us/step (73% busy), 3 kernels/step" in s.format_time()


def test_profile_steps_on_cpu_runs_the_steps(target):
    from draftgraph.runtime.profiling import profile_steps

    eng = dg.compile_model(target, make_drafter("eagle", target), cfg("NONE"))
    eng.add_request([1, 2, 3], dg.SamplingParams(max_tokens=20, ignore_eos=True))
    s = profile_steps(eng, 3)
    assert s.steps == 3 and not s.cuda and "no GPU kernels" in s.format()
    assert eng.stats()["steps"] == 3


def test_loop_pieces_do_not_grow_with_k(target):
    """The step index and positions advance as tensors: the code between two drafter steps is one piece at
    every step, so the loop compiles the same number of unique pieces at K = 3 and K = 6 (greedy and sampled
    variants, one-graph step off so the loop is its own function), with mode NONE's tokens."""
    drafter = make_drafter("eagle", target)
    unique = {}
    for k in (3, 6):
        config = cfg("FULL_AND_PIECEWISE", num_speculative_tokens=k, one_graph_step=False)
        eng, toks = run(target, drafter, config, sampled=True)
        assert toks == run(target, drafter, cfg("NONE", num_speculative_tokens=k), sampled=True)[1]
        keys = {key for key in eng.stats()["compile"]["piece_compile_seconds"] if key.startswith("draft_loop/")}
        pieces = eng.compiled.counters.pieces
        unique[k] = (len(keys), pieces)
    # the same unique pieces (4 per variant: before the first drafter step, after it, between two steps,
    # after the last), while the pieces themselves grow with K
    assert unique[3][0] == unique[6][0] == 8 and unique[6][1] > unique[3][1]
