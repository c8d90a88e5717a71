"""KV cache sizing from measured memory (runtime/memory.py): the arithmetic, and the errors for bad input.
The measurement itself needs CUDA: tests/gpu/test_memory_cuda.py."""

import pytest

import draftgraph as dg
from draftgraph.compiler.config import resolve
from draftgraph.runtime.memory import plan_blocks

MIB = 2**20


def test_blocks_are_what_the_budget_leaves():
    plan = plan_blocks(
        device_total=1000 * MIB,
        utilization=0.9,
        outside=100 * MIB,
        peak_without_kv=300 * MIB,
        graph_memory=50 * MIB,
        bytes_per_block=2 * MIB,
        min_blocks=10,
    )
    assert plan.num_blocks == (900 - 100 - 300 - 50) // 2 == 225
    text = plan.describe()
    assert "225 blocks (450 MiB)" in text and "50 CUDA graphs" in text and "300 weights" in text


def test_caches_that_grow_in_place_leave_room_for_the_mapping_granularity():
    plan = plan_blocks(1000 * MIB, 0.9, 100 * MIB, 300 * MIB, 50 * MIB, 2 * MIB, 10, mapping_slack=8 * MIB)
    assert plan.num_blocks == (900 - 100 - 300 - 50 - 8) // 2 == 221
    assert "8 mapping granularity" in plan.describe() and "captured again" in plan.describe()
    from dataclasses import replace

    assert "grown in place, graphs captured once" in replace(plan, kept_graphs=True).describe()


def test_a_fraction_of_a_mib_held_by_the_driver_does_not_change_the_size():
    # Engines built one after another in a process: the driver's share moves as kernels load (0.1 MiB seen on
    # an H200); the budget is rounded down to 1/1024 of the device, so both get the same cache.
    gib, kib = 2**30, 2**10
    sizes = {
        plan_blocks(80 * gib, 0.9, 812 * MIB + drift, 224 * MIB, 110 * MIB, 64 * kib, 10).num_blocks
        for drift in (0, 100 * kib, 300 * kib)
    }
    assert len(sizes) == 1
    step = 80 * MIB
    assert sizes.pop() == (int(0.9 * 80 * gib) - 812 * MIB - 224 * MIB - 110 * MIB) // step * step // (64 * kib)


def test_too_little_memory_names_the_numbers_and_the_fixes():
    with pytest.raises(ValueError, match=r"leaves room for 4 KV blocks, but one request of max_model_len needs 10"):
        plan_blocks(1000 * MIB, 0.5, 100 * MIB, 300 * MIB, 92 * MIB, 2 * MIB, 10)


def test_config_errors():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=1.5 must lie in \(0, 1\)"):
        dg.CompileConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="both size the KV cache; set one of them"):
        dg.CompileConfig(gpu_memory_utilization=0.5, num_kv_blocks=100)
    with pytest.raises(ValueError, match="but the device is cpu; set num_kv_blocks"):
        resolve(dg.CompileConfig(gpu_memory_utilization=0.5, device="cpu"), 256, True)


def test_a_resized_cache_reuses_every_trace():
    """What the sizing relies on: one engine whose KV cache is reallocated in place (the probe's block count,
    then the final one) traces nothing again and gives the same tokens."""
    from dataclasses import replace

    from draftgraph.compiler.build import CompileSettings, build_compiled
    from draftgraph.models.causal_lm import CausalLM
    from draftgraph.runtime.drafting import Chooser, fused_loop_fn
    from draftgraph.runtime.engine import Engine
    from tests.copy_drafters import make_drafter
    from tests.helpers import tiny_hf_model
    from tests.test_engine import ragged

    target = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96))
    drafter = make_drafter("eagle", target)
    config = dg.CompileConfig(
        mode="FULL_AND_PIECEWISE",
        num_speculative_tokens=3,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        compile_backend="eager",
        progress=False,
        fuse_draft_loop=True,  # the fused loops' traces are reused too
    )
    rc = resolve(config, 256, True)
    loops = fused_loop_fn(drafter, Chooser(drafter, target.cfg.vocab_size, rc.ops.race_sampler), 3, rc.block_size)
    compiled = build_compiled(target, drafter, rc, loops, CompileSettings(compile_backend="eager", progress=False))
    prompts, params, arrivals = ragged(16)
    eng = Engine(target, drafter, replace(rc, num_kv_blocks=rc.max_blocks_per_req + 1), compiled)
    outs = []
    for blocks in (rc.max_blocks_per_req + 1, rc.num_kv_blocks):
        if blocks != eng.config.num_kv_blocks:
            compiled.ctx.release()
            eng.resize_kv_cache(blocks)
        eng.warm_up()
        assert eng.runner.target_cache.spec.num_blocks == blocks == eng.allocator.num_blocks
        assert all(kv[0].shape[0] == blocks for kv in eng.runner.forwards.target_caches)  # the lists the step reads
        outs.append([o.token_ids for o in eng.generate(prompts, params, arrivals)])
    assert outs[0] == outs[1]
    assert dict(compiled.counters.traces) == {"target": 1, "drafter": 1, "draft_loop": 2}
