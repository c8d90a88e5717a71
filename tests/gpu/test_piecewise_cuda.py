"""GPU tier: PIECEWISE mode with CUDA graphs (Inductor pieces, Triton attention between them).

- graph replay equals eager for the target forward at every size 1..40 (float32, 1e-4 absolute);
- the lossless suite gives the same tokens as mode NONE, and the counters prove the graphs ran with no
  silent fallback: every piece call at a captured size replayed a graph.
"""

import pytest
import torch

import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from draftgraph.runtime.attn_metadata import RequestSlice
from tests.copy_drafters import make_drafter
from tests.helpers import PagedRunner, tiny_hf_model
from tests.test_engine import KINDS, ragged

pytestmark = pytest.mark.gpu
SIZES = (1, 2, 4, 8, 16, 32, 64, 72)  # 72: a draft model's first step adds a row per request


@pytest.fixture(scope="module")
def target():
    torch.backends.cuda.matmul.allow_tf32 = False
    return CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96), device="cuda", attn_impl="triton")


def config(k, mode="PIECEWISE", **kw):
    return dg.CompileConfig(
        mode=mode,
        num_speculative_tokens=k,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        device="cuda",
        gpu_memory_utilization=0.0,  # a KV cache of max_num_seqs requests, not sized from memory
        capture_sizes=SIZES,
        check_addresses=True,
        **kw,
    )


@pytest.fixture(scope="module")
def reference(target):
    prompts, params, arrivals = ragged(16)
    return [o.token_ids for o in dg.compile_model(target, None, config(0, "NONE")).generate(prompts, params, arrivals)]


def test_graph_replay_equals_eager(target):
    eng = dg.compile_model(target, None, config(0))
    counters = eng.compiled.counters
    # one trace; a 3-layer model gives 4 compute pieces with kernels (layers 1 and 2 between attentions are
    # the same: 3 unique) and the input-checks piece (host only, no graph): 3 Inductor compiles, 4 graphs at
    # each of the sizes, all captured from the one symbolic compile (compiles an earlier engine of the session
    # made for the same pieces are not made again: pool_lifetime.shared_pieces)
    assert counters.traces["target"] == 1 and counters.pieces == 5 and counters.unique_pieces == 4
    assert counters.inductor_compiles + counters.compiles_reused == 3
    assert counters.graphs_captured == 4 * len(SIZES)
    for t in range(1, 41):
        ids = torch.randint(0, 96, (t,), device="cuda")
        outs = []
        for fn in (eng.runner.target_fn, target):
            spec = eng.runner.target_cache.spec  # the engine's cache and table shapes: no re-trace
            runner = PagedRunner(
                target.cfg,
                num_blocks=spec.num_blocks,
                block_size=spec.block_size,
                device="cuda",
                max_blocks_per_req=eng.config.max_blocks_per_req,
            )
            meta, pos = runner.batch([(0, t)])
            padded = eng.runner.dispatcher.padded_tokens(t) if fn is not target else t
            if padded != t:  # pad like the engine: zero ids, padding metadata rows
                meta, pos = runner.builder.build(
                    [RequestSlice(runner.tables[0].blocks, 0, t)], num_tokens_padded=padded
                )
                ids_in = torch.cat([ids, ids.new_zeros(padded - t)])
            else:
                ids_in = ids
            # the compiled pieces read the engine's own caches in place (the piece before each attention writes k
            # and v into them: their graphs hold the addresses); the eager model a fresh cache of the same shape
            caches = runner.cache.layers if fn is target else eng.runner.target_cache.layers
            with torch.no_grad():
                outs.append(fn(ids_in, pos, meta, caches)[0][:t].clone())
        torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=0)
    assert counters.traces["target"] == 1  # 40 batch sizes, no re-trace
    assert not counters.compiled_runs and not counters.dynamic_runs


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 3])
def test_lossless_piecewise_on_cuda(target, reference, kind, k):
    prompts, params, arrivals = ragged(16)
    eng = dg.compile_model(target, make_drafter(kind, target), config(k))
    out = [o.token_ids for o in eng.generate(prompts, params, arrivals)]
    assert out == reference
    c = eng.compiled.counters
    assert c.graphs_captured > 0 and sum(c.graph_replays.values()) > 0
    assert not c.compiled_runs, f"piece runs at captured sizes without a graph: {dict(c.compiled_runs)}"
    assert not c.dynamic_runs, f"piece runs past the captured sizes: {dict(c.dynamic_runs)}"
    assert c.traces["target"] == 1 and c.traces["drafter"] == (2 if kind == "eagle3" else 1)
    # Graphs read weights in place (capture refuses to copy a parameter); only activations get buffers:
    # at most a few [size, 2 * hidden]-wide float32 inputs per piece, per captured size.
    bound = sum(8 * s * 2 * 64 * 4 for s in SIZES) * c.pieces
    assert 0 < c.static_buffer_bytes < bound
    print(f"{kind} K={k}: {eng.warm_up_report}; replays {sum(c.graph_replays.values())}")
