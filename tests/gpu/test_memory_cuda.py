"""GPU tier: the KV cache sized after measuring weights, activations and CUDA graphs
(gpu_memory_utilization): the probe's caches grow in place under its graphs (every graph captured once), or,
with CompileConfig(kv_grow_in_place=False), the probe's graphs are released and captured again; either way the
final engine re-uses the compiled code (no trace, no Inductor compile), gives NONE's tokens with blocks past the probe's
in use, and stays inside its share of device memory."""

import gc

import pytest
import torch

import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from draftgraph.runtime.memory import budget_step
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model
from tests.test_engine import ragged

pytestmark = [pytest.mark.gpu, pytest.mark.whole_device]


# No compile workers of its own: their CUDA contexts (about 0.5 GiB each) would count as outside the engine's
# budget from the moment the pool starts, after the test has read what the device holds (the session's shared
# workers are up before it reads: settled_device).
# Pieces run eagerly inside the graphs (compile_backend "eager"): sizing is the subject here, not Inductor's code.
BASE = dict(num_speculative_tokens=3, max_num_seqs=8, max_num_batched_tokens=64, device="cuda", progress=False,
            compile_workers=0, compile_backend="eager")  # fmt: skip


@pytest.fixture(scope="module")
def pair_and_reference():
    target = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96), device="cuda", attn_impl="triton")
    drafter = make_drafter("eagle", target)
    ref_engine = dg.compile_model(target, drafter, dg.CompileConfig(mode="NONE", gpu_memory_utilization=0.0, **BASE))
    ref = [o.token_ids for o in ref_engine.generate(*ragged(16))]
    return target, drafter, ref


@pytest.mark.parametrize("grow", [True, False], ids=["grown_in_place", "captured_twice"])
def test_kv_cache_sized_after_graph_memory(grow, pair_and_reference, settled_device):
    target, drafter, ref = pair_and_reference
    prompts, params, arrivals = ragged(16)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    # What the device holds now plus 2% of it: room for the engine's weights, activations and graphs, and a
    # KV cache of a few GB beside them.
    util = (total - free) / total + 0.02
    config = dg.CompileConfig(mode="FULL_AND_PIECEWISE", gpu_memory_utilization=util, kv_grow_in_place=grow, **BASE)
    eng = dg.compile_model(target, drafter, config)
    plan = eng.memory_plan
    print(eng.warm_up_report)
    assert plan is not None and plan.graph_memory > 0 and plan.num_blocks == eng.config.num_kv_blocks
    assert plan.kept_graphs == grow and eng.runner.kv_grows_in_place == grow
    assert eng.runner.target_cache.spec.num_blocks == plan.num_blocks
    budget = int(util * total) - plan.outside - plan.peak_without_kv - plan.graph_memory - plan.mapping_slack
    assert 0 <= budget - plan.num_blocks * plan.bytes_per_block < budget_step(total) + plan.bytes_per_block
    assert (plan.mapping_slack > 0) == grow
    c = eng.compiled.counters
    # compiled once; the draft loop runs around the drafter step inside the one-graph step (fuse_draft_loop auto)
    assert c.traces["target"] == 1 and c.traces["drafter"] == 1 and "draft_loop" not in c.traces
    assert c.graphs_captured > 0 and c.graph_memory_bytes > 0 and len(eng.compiled.ctx.graphs) == c.graphs_captured
    assert c.graphs_released == (0 if grow else c.graphs_captured)  # captured once, or twice
    probe_blocks = eng.config.max_blocks_per_req + 1
    out = eng.generate(prompts, params, arrivals)
    assert [o.token_ids for o in out] == ref
    torch.cuda.synchronize()
    # Read before the checks below: their temporaries (a whole cache layer's worth) are the test's, not the engine's.
    used = total - torch.cuda.mem_get_info()[0]
    print(f"device memory in use {used / 2**20:.0f} MiB, budget {util * total / 2**20:.0f} MiB")
    assert used <= util * total + 256 * 2**20  # allocator rounding and fragmentation
    stats = eng.stats()
    assert stats["fallbacks"] == 0 and sum(stats["dispatch"].get(k, 0) for k in stats["dispatch"] if k != "none") > 0
    # the step wrote blocks the probe's cache did not have (blocks are handed out from 0 up)
    assert eng.runner.target_cache.layers[0][0][probe_blocks:].abs().sum().item() > 0
