"""Data and expert parallelism on the CPU (gloo), tiny float32 models, mode NONE unless compiling is the point.

compile_model with data_parallel_size 2 starts two engine replicas (one worker process each) and spreads the
requests over them. With expert parallelism a tiny DeepSeek-V3 (8 experts, MTP drafter, K = 2) holds 4
experts per rank and the ranks step together: uneven requests leave one rank idle for many steps, which it
spends in dummy steps, counted. Greedy tokens equal the one-process engine's and transformers' generate().
"""

import multiprocessing
from dataclasses import replace

import pytest
import torch

import draftgraph as dg
from draftgraph.models.builtin import BuiltinSpec, builtin_hf_target
from draftgraph.runtime.request import RequestOutput
from draftgraph.workers.router import Router, merge_stats
from tests.helpers import kill_rank_1_between_steps, nothing_starts

HANG_S = 300  # a dead rank is noticed by its process sentinel, at once; this long means it hung

SPEC = BuiltinSpec(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=2, num_kv_heads=2,
                   head_dim=32, draft_layers=1, max_position_embeddings=256)  # fmt: skip
# Three requests over two replicas: replica 0 gets the 1st and 3rd (round-robin), replica 1 only the short 2nd,
# so replica 1 is idle for most of the steps.
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18]]
PARAMS = [dg.SamplingParams(max_tokens=n, ignore_eos=True) for n in (20, 3, 8)]


def config(**over) -> dg.CompileConfig:
    fields = dict(mode="NONE", device="cpu", num_speculative_tokens=2, max_num_seqs=4, max_num_batched_tokens=64,
                  max_model_len=128, gpu_memory_utilization=0.0, compile_backend="eager", progress=False)  # fmt: skip
    return dg.CompileConfig(**{**fields, **over})


def test_bad_data_parallel_settings_fail_before_anything_starts(monkeypatch):
    started = nothing_starts(monkeypatch)
    with pytest.raises(ValueError, match="data_parallel_size=0 must be at least 1"):
        config(data_parallel_size=0)
    with pytest.raises(ValueError, match=r"expert_parallel=True with tensor_parallel_size=1 and data_parallel_size=1"
                       r".*at least two \(e.g. --tp 2 --expert-parallel"):  # fmt: skip
        config(expert_parallel=True)
    config(data_parallel_size=2, tensor_parallel_size=2, expert_parallel=True)  # EP = tp x dp = 4: accepted
    config(tensor_parallel_size=2, expert_parallel=True)
    from draftgraph.cli import main

    assert main(["generate", "--device", "cpu", "--dp", "0"]) == 2
    assert main(["generate", "--device", "cpu", "--expert-parallel"]) == 2
    assert started == [] and not multiprocessing.active_children()  # no model, engine or process started


def test_router_spreads_least_loaded_and_sums_stats():
    r = Router(2)
    assert r.spread(3) == [0, 1, 0]  # round-robin when loads are equal
    first, second, third = r.admit(0, 0), r.admit(1, 0), r.admit(0, 1)
    assert (first, second, third) == (0, 1, 2) and r.pick() == 1  # replica 1 holds fewer
    out = r.finished(0, [RequestOutput(1, [5], [6], "length")])
    assert out[0].request_id == 2 and r.load == [1, 1]
    one = {"steps": 4, "verify_steps": 3, "draft_tokens": 6, "accepted_tokens": 3, "generated_tokens": 9,
           "preemptions": 0, "fallbacks": 0, "dummy_steps": 0, "seconds": 1.0, "acceptance_histogram": [1, 1, 1],
           "dispatch": {"target/none": 4}, "fallbacks_by_key": {}}  # fmt: skip
    two = {**one, "steps": 1, "verify_steps": 1, "accepted_tokens": 0, "draft_tokens": 2, "dummy_steps": 3,
           "seconds": 0.5, "acceptance_histogram": [1, 0, 0], "dispatch": {"target/none": 4}}  # fmt: skip
    s = merge_stats([one, two])
    assert s["steps"] == 5 and s["dummy_steps"] == 3 and s["acceptance_histogram"] == [2, 1, 1]
    assert s["seconds"] == 1.0 and s["tokens_per_second"] == 18.0  # side by side: the longest replica's time
    assert s["mean_accepted_length"] == 1 + 3 / 4 and s["dispatch"] == {"target/none": 8}
    assert s["per_replica"] == [one, two]
    pc = {"enabled": True, "query_tokens": 40, "hit_tokens": 32, "query_blocks": 2, "hit_blocks": 2,
          "hit_rate": 0.8, "cached_blocks": 3, "evictions": 0}  # fmt: skip
    s = merge_stats([{**one, "prefix_cache": pc}, {**two, "prefix_cache": {**pc, "hit_tokens": 0, "hit_blocks": 0}}])
    assert s["prefix_cache"]["hit_tokens"] == 32 and s["prefix_cache"]["hit_rate"] == 32 / 80  # each cache counted
    snaps = {"slots": 4, "used": 2, "taken": 2, "restored": 3, "evictions": 1, "bytes_per_snapshot": 1024}
    s = merge_stats([{**one, "prefix_cache": {**pc, "state_snapshots": snaps}},
                     {**two, "prefix_cache": {**pc, "state_snapshots": {**snaps, "restored": 0}}}])  # fmt: skip
    want = {**snaps, "slots": 8, "used": 4, "taken": 4, "restored": 3, "evictions": 2}  # each replica's own pool
    assert s["prefix_cache"]["state_snapshots"] == want
    # adaptive speculation: each replica picks its own K per step; the steps per K add up
    spec = {"mode": "adaptive", "choices": [0, 2, 4], "catch_up_tokens": 5, "probes": 1,
            "histogram": {0: 3, 2: 1, 4: 0}}  # fmt: skip
    s = merge_stats([{**one, "speculation": spec}, {**two, "speculation": {**spec, "histogram": {0: 0, 2: 0, 4: 1}}}])
    assert s["speculation"]["histogram"] == {0: 3, 2: 1, 4: 1} and s["speculation"]["catch_up_tokens"] == 10
    assert s["speculation"]["probes"] == 2


def test_dense_replicas_of_tensor_parallel_ranks_equal_one_process():
    """DP 2 x TP 2 (four ranks; each replica's target and draft model split over its two), no expert
    parallelism: the replicas step independently (no dummy steps); the outputs come back in the prompts' order
    with the driver's ids, and the tokens are one process's."""
    target, drafter = builtin_hf_target(SPEC), builtin_hf_target(replace(SPEC, num_layers=1, seed=1))
    one = dg.compile_model(target, drafter, config())
    want = [o.token_ids for o in one.generate(PROMPTS, PARAMS)]
    with dg.compile_model(target, drafter, config(data_parallel_size=2, tensor_parallel_size=2)) as engine:
        assert engine.world_size == 4 and engine.config.draft_tensor_parallel_size == 2
        outs = engine.generate(PROMPTS, PARAMS)
        assert [o.token_ids for o in outs] == want and [o.request_id for o in outs] == [0, 1, 2]
        s = engine.stats()
        steps = [r["steps"] for r in s["per_replica"]]
        assert steps[0] > steps[1] and s["steps"] == sum(steps) and s["data_parallel_size"] == 2  # TP ranks agreed
        assert s["dummy_steps"] == 0 and s["generated_tokens"] == sum(p.max_tokens for p in PARAMS)
        streamed = {0: [], 1: []}  # add_request / step underneath: a round trip to every rank per step
        for delta in engine.stream(PROMPTS[:2], PARAMS[:2]):
            streamed[delta.index] += delta.token_ids
        assert [streamed[0], streamed[1]] == want[:2]


# ---- expert parallelism: a tiny DeepSeek-V3 with its MTP layer in one checkpoint directory -----------------


@pytest.fixture(scope="module")
def deepseek_dir(tmp_path_factory):
    """A checkpoint directory holding the tiny DeepSeek-V3 and an MTP layer that repeats its prediction (so
    drafts are accepted); the transformers model too."""
    from safetensors.torch import save_file

    from draftgraph.models.builtin import deepseek_layer_weights
    from draftgraph.models.causal_lm import CausalLM
    from tests.helpers import tiny_deepseek_model

    path = tmp_path_factory.mktemp("deepseek")
    hf = tiny_deepseek_model()
    hf.save_pretrained(path)
    cfg = CausalLM.from_hf(hf).cfg
    h, p = cfg.hidden_size, f"model.layers.{cfg.num_layers}."
    w = deepseek_layer_weights(p, cfg, torch.Generator().manual_seed(7), quiet=True)
    w.update({p + n: torch.ones(h) for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")})
    w[p + "eh_proj.weight"] = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1)  # reads the hidden state only
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "mtp.safetensors"))
    return str(path), hf


@pytest.fixture(scope="module")
def deepseek_want(deepseek_dir):
    path, hf = deepseek_dir
    want = [o.token_ids for o in dg.compile_model(path, path, config()).generate(PROMPTS, PARAMS)]
    with torch.no_grad():
        hf_tokens = [hf.generate(torch.tensor([p]), max_new_tokens=s.max_tokens, do_sample=False)[0, len(p) :].tolist()
                     for p, s in zip(PROMPTS, PARAMS)]  # fmt: skip
    assert want == hf_tokens
    return want


def test_expert_parallel_with_an_idle_rank_then_a_killed_rank(deepseek_dir, deepseek_want):
    path, _ = deepseek_dir
    engine = dg.compile_model(path, path, config(data_parallel_size=2, expert_parallel=True))
    try:
        assert "expert parallel: experts 0-3 of 8 in each of 2 MoE layers on rank 0 of 2" in engine.warm_up_report
        assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == deepseek_want
        s = engine.stats()
        busy, idle = s["per_replica"]
        # Lock-step: every step of one rank is a step (real or dummy) of the other; the idle rank's are counted.
        assert busy["dummy_steps"] == 0 and idle["dummy_steps"] > idle["steps"] > 0
        assert idle["steps"] + idle["dummy_steps"] == busy["steps"] and s["dummy_steps"] == idle["dummy_steps"]
        assert s["accepted_tokens"] > 0  # the MTP layer's drafts are accepted: the acceptance paths ran
        # add_request / step: the same requests, least loaded first, every rank stepping each time
        ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.token_ids for o in engine.step()})
        assert [done[i] for i in ids] == deepseek_want
        # a rank killed between steps: the next step names it, and the other rank (waiting in the lock-step's
        # all-reduce or the experts' all-gather) is ended too
        kill_rank_1_between_steps(engine, PROMPTS[0], PARAMS[0], HANG_S)
    finally:
        engine.close()


def test_expert_parallel_compiled_ranks_run_the_same_graph_keys(deepseek_dir, deepseek_want):
    """FULL_AND_PIECEWISE (eager pieces; no CUDA graphs on the CPU, so every forward counts as a fallback under
    the key it dispatched to): the idle rank's dummy steps run the busy rank's one-graph steps and padded
    target forwards, key for key."""
    path, _ = deepseek_dir
    with dg.compile_model(path, path, config(mode="FULL_AND_PIECEWISE", data_parallel_size=2,
                                             expert_parallel=True)) as engine:  # fmt: skip
        assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == deepseek_want
        busy, idle = engine.stats()["per_replica"]
        assert idle["dummy_steps"] > 0

        def keys(r):
            return {k: n for k, n in r["fallbacks_by_key"].items() if k.startswith(("target/", "step/"))}

        assert keys(busy) == keys(idle) and any(k.startswith("step/") for k in keys(busy))


# ---- the expert-parallel layer and its collectives, model-level -------------------------------------------


def _check_expert_parallel_layer(ep):
    """Each rank: the row collectives, then its ExpertParallelMoE share over its own tokens (same count on every
    rank) = the whole MoE layer over the same tokens, eager and inside torch.compile (one node per collective)."""
    from draftgraph.models.causal_lm import CausalLM
    from draftgraph.models.parallel.experts import ExpertParallelMoE
    from draftgraph.ops.collectives.op import ExpertGroups
    from tests.helpers import tiny_deepseek_model

    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 4, generator=g)
    mine = base + ep.rank
    gathered = torch.ops.draftgraph.all_gather_rows(mine, ep.group_name)
    torch.testing.assert_close(gathered, torch.cat([base + r for r in range(ep.world_size)]))
    summed = torch.ops.draftgraph.reduce_scatter_rows(gathered, ep.group_name)  # every rank passed the same rows
    torch.testing.assert_close(summed, (base + ep.rank) * ep.world_size)

    model = CausalLM.from_hf(tiny_deepseek_model())
    moe = model.layers[1].mlp  # layer 0 is dense
    split = ExpertParallelMoE(moe, ExpertGroups(replicas=ep))
    assert split.gate_up.shape[0] == 8 // ep.world_size and split.first == ep.rank * 8 // ep.world_size
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1 + ep.rank))  # each rank its own tokens
    with torch.no_grad():
        torch.testing.assert_close(split(x), moe(x), atol=1e-5, rtol=1e-5)
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            from torch._dynamo.backends.common import aot_autograd

            return aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

        torch.testing.assert_close(torch.compile(split, backend=backend, fullgraph=True)(x), moe(x), atol=1e-5,
                                   rtol=1e-5)  # fmt: skip
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    for op in ("all_gather_rows", "reduce_scatter_rows", "moe_experts"):
        assert sum(f"draftgraph.{op}" in t for t in targets) == 1, targets


def test_expert_parallel_layer_equals_the_whole_layer(tmp_path):
    from tests.test_tensor_parallel import spawn

    spawn(_check_expert_parallel_layer, 2, tmp_path)


# ---- expert parallelism for Qwen3.5-MoE (Gated DeltaNet + gated attention, softmax router, gated shared expert)


def _check_qwen_expert_parallel_layer(ep):
    """Each rank: its share of a Qwen3.5-MoE layer over its own tokens = the whole layer over them."""
    from draftgraph.models.causal_lm import CausalLM
    from draftgraph.models.parallel.experts import ExpertParallelMoE
    from draftgraph.ops.collectives.op import ExpertGroups
    from tests.test_qwen3_5 import tiny_qwen3_5

    model = CausalLM.from_hf(tiny_qwen3_5(moe=True))
    moe = model.layers[0].mlp
    split = ExpertParallelMoE(moe, ExpertGroups(replicas=ep))
    assert split.gate_up.shape[0] == 4 // ep.world_size and split.first == ep.rank * 4 // ep.world_size
    x = torch.randn(5, model.cfg.hidden_size, generator=torch.Generator().manual_seed(1 + ep.rank))
    with torch.no_grad():
        torch.testing.assert_close(split(x), moe(x), atol=1e-5, rtol=1e-5)


def test_qwen3_5_moe_expert_parallel_layer_equals_the_whole_layer(tmp_path):
    from tests.test_tensor_parallel import spawn

    spawn(_check_qwen_expert_parallel_layer, 2, tmp_path)


def test_qwen3_5_moe_expert_parallel_with_an_idle_rank(tmp_path):
    """DP 2 with expert parallelism on the tiny Qwen3.5-MoE (4 experts: 2 per rank; layer types mixed, state
    rings per rank): uneven requests, tokens = one process = transformers' generate(), dummy steps counted."""
    from tests.test_qwen3_5 import tiny_qwen3_5

    hf = tiny_qwen3_5(moe=True)
    hf.save_pretrained(tmp_path)
    want = [o.token_ids for o in dg.compile_model(str(tmp_path), None, config()).generate(PROMPTS, PARAMS)]
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0
    with torch.no_grad():
        hf_tokens = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=s.max_tokens, min_new_tokens=s.max_tokens,
                                 do_sample=False)[0, len(p) :].tolist() for p, s in zip(PROMPTS, PARAMS)]  # fmt: skip
    assert want == hf_tokens
    with dg.compile_model(str(tmp_path), None, config(data_parallel_size=2, expert_parallel=True)) as engine:
        assert "experts 0-1 of 4" in engine.warm_up_report
        assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == want
        busy, idle = engine.stats()["per_replica"]
        assert idle["dummy_steps"] > 0 and idle["steps"] + idle["dummy_steps"] == busy["steps"]
