"""PIECEWISE mode on the CPU (graphs off, same code path): structure, numerics and losslessness.

Piece counts: the target forward of an L-layer model has L attention ops and one piece boundary before its
body (compiled_forward.py: the input checks Dynamo adds stay out of the body's pieces), so splitting gives
L+2 compute pieces (input checks | embed..QKV of layer 0 | L-1 times o_proj..QKV of the next layer |
o_proj..final norm) and L+1 split-op pieces. The L-1 middle pieces are identical up to their weights, so
the unique count is 4 for L >= 3 (checks, first, middle, last), 3 for L = 1 (no middle). The checks piece
computes no tensor: it runs as plain FX, no Inductor compile.
"""

import os

import pytest
import torch

import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from draftgraph.runtime.attn_metadata import RequestSlice
from tests.copy_drafters import make_drafter
from tests.helpers import PagedRunner, tiny_hf_model
from tests.test_engine import KINDS, ragged

SIZES = (1, 4, 16, 64, 72)  # 72: a draft model's first step adds a row per request


def cfg(k, backend="inductor", **kw):
    base = dict(
        mode="PIECEWISE",
        num_speculative_tokens=k,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        capture_sizes=SIZES,
        compile_backend=backend,
        progress=False,
    )
    base.update(kw)
    return dg.CompileConfig(**base)


@pytest.fixture(scope="module")
def target():
    return CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96))


@pytest.mark.parametrize("layers,unique", [(1, 3), (3, 4), (4, 4)])
def test_piece_counts(layers, unique):
    model = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96, num_hidden_layers=layers))
    eng = dg.compile_model(model, None, cfg(0, backend="eager"))
    c = eng.compiled.counters
    split = eng.compiled.target.backend.traces[-1][1]  # the SplitGraph of the one trace
    assert c.traces["target"] == 1
    assert c.pieces == layers + 2 and c.unique_pieces == unique  # derivation in the module docstring
    assert len(split.pieces) == 2 * layers + 3 and sum(p.is_attention for p in split.pieces) == layers + 1
    assert [p.is_attention for p in split.pieces] == [i % 2 == 1 for i in range(2 * layers + 3)]
    assert not c.inductor_compiles


def test_drafter_piece_counts(target):
    # EAGLE: one decoder layer -> 2 compute pieces and the input checks; EAGLE-3 traces twice (step 1 reads
    # [T, 3H], later steps [T, H]) -> 2 x 3 pieces; a draft model of 2 layers -> 3 pieces and the checks.
    for kind, traces, pieces in (("eagle", 1, 3), ("eagle3", 2, 6), ("draft_model", 1, 4)):
        eng = dg.compile_model(target, make_drafter(kind, target), cfg(3, backend="eager"))
        c = eng.compiled.counters
        eng.generate([[1, 2, 3], [4] * 20], dg.SamplingParams(max_tokens=6))  # steps 2..K trace too
        assert c.traces["drafter"] == traces, kind
        assert c.pieces == 5 + pieces, kind  # the 3-layer target's 5 plus the drafter's


def test_no_retrace_across_twenty_batch_sizes(target):
    eng = dg.compile_model(target, make_drafter("eagle", target), cfg(3, backend="eager"))
    c = eng.compiled.counters
    for n in range(1, 21):  # 20 different batch sizes of one-token prompts
        eng.generate([[t % 96] for t in range(n)], dg.SamplingParams(max_tokens=2))
    assert c.traces["target"] == 1 and c.traces["drafter"] == 1


def test_compiled_equals_eager_target_and_drafter(target):
    """Inductor pieces against the eager modules: float32, 2e-5 absolute (fusion reorders sums)."""
    drafter = make_drafter("eagle", target)
    eng = dg.compile_model(target, drafter, cfg(3))
    c = eng.compiled.counters
    # target: 5 pieces (4 unique: checks, first, middle, last), drafter 3 pieces (3 unique, EAGLE's fc makes
    # its first piece its own); one Inductor compile each with the token count symbolic, whatever the number
    # of capture sizes, except the two checks pieces, which compute no tensor (plain FX)
    assert c.unique_pieces == 7 and c.inductor_compiles == 5
    spec, maxb = eng.runner.target_cache.spec, eng.config.max_blocks_per_req
    for t in (1, 3, 16, 50, 90):  # 90 > the largest size: the dynamic-shape pieces
        padded = eng.runner.dispatcher.padded_tokens(t)
        ids = torch.randint(0, 96, (t,))
        hidden = torch.randn(t, 64)
        outs = {}
        for name, fn_t, fn_d, n in (
            ("compiled", eng.runner.target_fn, eng.runner.drafter_fn, padded),
            ("eager", target, drafter, t),
        ):
            runner = PagedRunner(
                target.cfg, num_blocks=spec.num_blocks, block_size=spec.block_size, max_blocks_per_req=maxb
            )
            runner.batch([(0, t)])
            meta, pos = runner.builder.build([RequestSlice(runner.tables[0].blocks, 0, t)], num_tokens_padded=n)
            pad = torch.zeros(n - t, dtype=torch.long)
            with torch.no_grad():
                h, _ = fn_t(torch.cat([ids, pad]), pos, meta, runner.cache.layers)
                d, _ = fn_d(
                    torch.cat([ids, pad]),
                    pos,
                    torch.cat([hidden, torch.zeros(n - t, 64)]),
                    meta,
                    PagedRunner(
                        drafter.cfg, num_blocks=spec.num_blocks, block_size=spec.block_size, num_layers=1
                    ).cache.layers,
                )
            outs[name] = (h[:t], d[:t])
        torch.testing.assert_close(outs["compiled"][0], outs["eager"][0], atol=2e-5, rtol=0)
        torch.testing.assert_close(outs["compiled"][1], outs["eager"][1], atol=2e-5, rtol=0)
    assert c.traces["target"] == 1 and c.traces["drafter"] == 1
    assert c.dynamic_runs["target"] == 4  # t = 90: 4 compute pieces on their symbolic code (checks: host only)


@pytest.fixture(scope="module")
def reference(target):
    prompts, params, arrivals = ragged(16)
    eng = dg.compile_model(
        target, None, dg.CompileConfig(num_speculative_tokens=0, max_num_seqs=8, max_num_batched_tokens=64)
    )
    return [o.token_ids for o in eng.generate(prompts, params, arrivals)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 3])
def test_lossless_suite_in_piecewise(target, reference, kind, k):
    prompts, params, arrivals = ragged(16)
    eng = dg.compile_model(target, make_drafter(kind, target), cfg(k))
    assert [o.token_ids for o in eng.generate(prompts, params, arrivals)] == reference
    c = eng.compiled.counters
    assert c.traces["target"] == 1 and c.traces["drafter"] == (2 if kind == "eagle3" else 1)
    assert sum(c.compiled_runs.values()) > 0 and not c.dynamic_runs  # every batch fit a compiled size
    assert not c.graphs_captured  # the CPU runs the pieces without graphs


def test_pass_manager_dumps_and_uuid(tmp_path, target):
    from draftgraph.passes.manager import PassManager

    eng = dg.compile_model(target, None, cfg(0, backend="eager", dump_graphs_dir=str(tmp_path)))
    names = sorted(os.listdir(tmp_path))
    assert names == [
        "target.00_before_drop_size_asserts.py",
        "target.01_before_dce.py",
        "target.02_after_split_attention.py",
        "target.02_before_split_attention.py",
    ]
    before = (tmp_path / "target.00_before_drop_size_asserts.py").read_text()
    after = (tmp_path / "target.01_before_dce.py").read_text()
    assert before.count("_assert_scalar") > after.count("_assert_scalar") > 0  # only u >= 0 asserts went
    assert (tmp_path / "target.02_after_split_attention.py").read_text().count("submod_") >= 7
    full, bare = PassManager().uuid(), PassManager([]).uuid()
    assert len(full) == 16 and full == PassManager().uuid() and full != bare  # the pass list is in the key
    assert eng.compiled.counters.traces["target"] == 1


@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE"])
@pytest.mark.parametrize("kind", ["eagle3", "draft_model", "ngram"])
def test_lossless_suite_in_full_modes_on_cpu(target, reference, mode, kind):
    """The FULL dispatch path (uniform batches padded by request count) without graphs on the CPU."""
    prompts, params, arrivals = ragged(16)
    eng = dg.compile_model(target, make_drafter(kind, target), cfg(3, backend="eager", mode=mode))
    assert [o.token_ids for o in eng.generate(prompts, params, arrivals)] == reference
    c = eng.compiled.counters
    assert c.traces["target"] == 1 and not c.graphs_captured
    if kind == "ngram":  # no drafter model: no drafter trace or forward; uniform batches run the one-graph step
        keys = eng.stats()["dispatch"]
        assert "drafter" not in c.traces and not any(key.startswith("drafter") for key in keys)
        assert any(key.startswith("step/") for key in keys) and eng.stats()["accepted_tokens"] > 0
    # FULL graphs are keyed by request count; piece sizes exist only where PIECEWISE dispatches
    assert eng.config.full_capture_sizes == (1, 2, 4, 8)
    assert eng.config.capture_sizes == (SIZES if mode == "FULL_AND_PIECEWISE" else ())


def test_full_mode_refuses_an_attention_without_graph_support(monkeypatch):
    from draftgraph.compiler.config import resolve

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # resolve only: nothing touches a device
    with pytest.raises(ValueError, match="'reference' supports CUDA graphs up to NEVER.*needs UNIFORM_BATCH"):
        resolve(dg.CompileConfig(mode="FULL", device="cuda", attention="reference"), 256, True)


def test_builtin_pair_compiles_each_unique_piece_once():
    """The built-in pair (6-layer target, the draft model truncated to its first 2 layers) in PIECEWISE with
    eight capture sizes. Target: 8 compute pieces, 4 unique (input checks, first, middle, last). The draft
    model's 4 pieces (checks, first, one middle, last) are the target's pieces on other weights: no compile
    of their own. The checks piece computes no tensor (plain FX). So 3 Inductor compiles, one per unique
    piece whatever the number of sizes (per-size compiling made 3 x (8 + 1) = 27), at most unique pieces +
    traced functions (4 + 2)."""
    from draftgraph.models.builtin import builtin_pair

    target, drafter = builtin_pair()
    sizes = (1, 2, 4, 8, 16, 32, 48, 64)
    eng = dg.compile_model(target, drafter, cfg(3, capture_sizes=sizes))
    c = eng.compiled.counters
    assert dict(c.traces) == {"target": 1, "drafter": 1}
    assert c.pieces == 8 + 4 and c.unique_pieces == 4 and c.inductor_compiles == 3
    assert c.inductor_compiles <= c.unique_pieces + sum(c.traces.values())
    assert set(eng.compiled.pieces.owner.values()) == {"target"}  # the drafter compiled nothing itself
    prompts = [[1, 2, 3, 4, 5], [7] * 30]
    ref = dg.compile_model(target, drafter, dg.CompileConfig(num_speculative_tokens=3, max_num_seqs=8,
                                                            max_num_batched_tokens=64))  # fmt: skip
    params = dg.SamplingParams(max_tokens=12)
    assert [o.token_ids for o in eng.generate(prompts, params)] == [o.token_ids for o in ref.generate(prompts, params)]
    assert c.traces["target"] == 1 and c.inductor_compiles == 3  # serving compiled nothing more


def test_compile_sizes_add_a_specialised_compile_per_listed_size():
    """compile_sizes=(4,): the 1-layer model's 2 unique compute pieces get one symbolic compile each plus one
    specialised to 4 tokens: 4 compiles (its input-checks piece computes no tensor: none). Both agree with
    eager (2e-5, float32)."""
    model = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96, num_hidden_layers=1))
    eng = dg.compile_model(model, None, cfg(0, capture_sizes=(4, 8), compile_sizes=(4,)))
    c = eng.compiled.counters
    assert c.unique_pieces == 3 and c.inductor_compiles == 2 * (1 + 1)
    assert sorted(len(p.per_size) for p in eng.compiled.pieces.compiled.values()) == [0, 1, 1]
    spec, maxb = eng.runner.target_cache.spec, eng.config.max_blocks_per_req
    for t in (3, 7):  # padded to 4 (the specialised code) and 8 (the symbolic code)
        n = eng.runner.dispatcher.padded_tokens(t)
        ids = torch.randint(0, 96, (t,))
        outs = []
        for fn, pad_to in ((eng.runner.target_fn, n), (model, t)):
            runner = PagedRunner(
                model.cfg, num_blocks=spec.num_blocks, block_size=spec.block_size, max_blocks_per_req=maxb
            )
            runner.batch([(0, t)])
            meta, pos = runner.builder.build([RequestSlice(runner.tables[0].blocks, 0, t)], num_tokens_padded=pad_to)
            with torch.no_grad():
                h, _ = fn(torch.cat([ids, torch.zeros(pad_to - t, dtype=torch.long)]), pos, meta, runner.cache.layers)
            outs.append(h[:t])
        torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=0)
    assert dict(c.compiled_runs) == {"target/piecewise/t4": 2, "target/piecewise/t8": 2}


def test_piece_graph_keys_are_unique_across_traces(target):
    """EAGLE-3's drafter traces twice (hidden 3H at step 1, H later) with the same piece indices: every piece
    runner's graph key part must still be its own, or one trace would replay the other's graphs."""
    from draftgraph.compiler.cuda_graphs import GraphKey
    from draftgraph.compiler.piece_runner import PieceRunner

    eng = dg.compile_model(target, make_drafter("eagle3", target), cfg(3, backend="eager"))
    eng.generate([[1, 2, 3], [4] * 20], dg.SamplingParams(max_tokens=6))  # steps 2..K trace too
    c = eng.compiled
    runners = [m for b in (c.target.backend, c.drafter.backend) for _, s in b.traces for m in s.module.modules()]
    runners = [m for m in runners if isinstance(m, PieceRunner)]
    assert c.counters.traces["drafter"] == 2 and len(runners) == c.counters.pieces
    keys = {GraphKey.piecewise(r.fn_name, 16, r.graph_id) for r in runners}
    assert len(keys) == len(runners)  # one graph per runner and size


def test_a_piece_that_reads_the_kv_cache_is_keyed_by_its_token_count():
    """A piece may take the KV caches (the RoPE kernel writing k and v into them, on CUDA): their block count is a
    backed symbol (marked dynamic so a resized cache re-uses the trace), which does not stop a graph per token
    count; an unbacked size other than the token count (the request count) does. Per-size example inputs take
    the backed size at its traced value."""
    from torch._dynamo.decorators import mark_unbacked, maybe_mark_dynamic

    from draftgraph.compiler.piece_runner import size_locator
    from draftgraph.compiler.piecewise import concrete_inputs
    from draftgraph.passes.split_attention import token_symbol

    seen = []

    def backend(gm, example_inputs):
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        token = token_symbol(gm)
        fakes = [n.meta["example_value"] for n in phs]
        symbolic = [isinstance(d, torch.SymInt) for v in fakes if isinstance(v, torch.Tensor) for d in v.shape]
        where = size_locator(phs, token)
        seen.append((where, concrete_inputs(fakes, token, 8) if where[0] != "none" else None, symbolic))
        return gm.forward

    def with_cache(input_ids, cache):
        return input_ids * 2, cache.sum()

    def with_requests(input_ids, block_tables):
        return input_ids * 2, block_tables.sum()

    torch._dynamo.reset()
    ids, cache, tables = torch.zeros(5, dtype=torch.long), torch.zeros(11, 4), torch.zeros(3, 2, dtype=torch.int32)
    mark_unbacked(ids, 0, shape_id="tokens")
    maybe_mark_dynamic(cache, 0)
    torch.compile(with_cache, backend=backend, fullgraph=True, dynamic=False)(ids, cache)
    (where, inputs, symbolic) = seen.pop()
    assert symbolic == [True, True, False]  # the token count and the block count
    assert where[0] != "none"
    assert [tuple(t.shape) for t in inputs if isinstance(t, torch.Tensor)] == [(8,), (11, 4)]
    mark_unbacked(ids, 0, shape_id="tokens")
    mark_unbacked(tables, 0, shape_id="reqs")
    torch.compile(with_requests, backend=backend, fullgraph=True, dynamic=False)(ids, tables)
    assert seen.pop()[0] == ("none", -1)
    torch._dynamo.reset()
