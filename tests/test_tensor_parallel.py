"""Tensor parallelism on the CPU: processes on one machine over gloo, tiny float32 models.

Each multi-process test spawns one process per rank (file rendezvous, bounded init and join: a dead or stuck
peer fails the test instead of hanging it). Every rank builds the same seeded transformers model, so each can
compare its sharded model against the single-process one itself. Tolerance: 1e-5 absolute on logits of
magnitude ~1 (the sharded sums only change the summation order).
"""

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.config import ModelConfig
from draftgraph.models.parallel.dense import shard_config
from draftgraph.ops.collectives.op import ParallelGroup, register_group
from tests.helpers import PagedRunner, join_spawned, tiny_hf_model
from tests.test_deepseek_v32 import hf_greedy

ATOL = 1e-5
# Bounds on a hang, not on speed: a busy 2-core machine must never reach them (speed: scripts/bench_*.py).
JOIN_TIMEOUT_S = 900  # whole spawn: imports, init, work; past it the ranks still alive are named and killed
INIT_TIMEOUT = datetime.timedelta(seconds=300)  # rendezvous and every collective
SHAPE = dict(num_attention_heads=8, num_key_value_heads=4)  # divisible by 2 and 4
MODELS = {
    "llama3": dict(
        family="llama",
        attention_bias=True,  # o_proj's bias too: row-parallel biases are added once
        mlp_bias=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen3": dict(family="qwen3", tie_word_embeddings=True),  # q/k norms, tied vocab-parallel head
}


def _entry(rank, fn, world_size, init_file, args):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=INIT_TIMEOUT
    )
    register_group("tp", dist.group.WORLD)
    try:
        fn(ParallelGroup(rank, world_size, "tp"), *args)
        # Every rank's collectives done before any rank tears gloo down: a rank that destroyed its group while
        # a peer still talked to it aborted that peer ("terminate called without an active exception", seen
        # once in a 2-core CI run of tests/test_sharded_load.py).
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(fn, world_size, tmp_path, *args):
    """Run fn(tp, *args) on `world_size` processes; a rank's exception or exit fails the test, and so does a
    hang: ranks still running after JOIN_TIMEOUT_S are named in the failure, then killed. The ranks are forked
    by multiprocessing's fork server, which imported this module's imports (torch, transformers, draftgraph)
    once for the whole pytest process: spawned, each rank imported them again (seconds a rank)."""
    mp.set_forkserver_preload(["draftgraph.workers.worker", "tests.test_tensor_parallel"])  # read at its start
    ctx = mp.start_processes(
        _entry,
        (fn, world_size, str(tmp_path / "rendezvous"), args),
        nprocs=world_size,
        join=False,
        start_method="forkserver",
    )
    join_spawned(ctx, JOIN_TIMEOUT_S, f"{fn.__name__} on {world_size} ranks hung")


# ---- what each rank runs ---------------------------------------------------------------------------------


def _check_collectives(tp: ParallelGroup):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3, 5, generator=g)
    mine = base * (tp.rank + 1)
    want_sum = base * sum(r + 1 for r in range(tp.world_size))
    torch.testing.assert_close(torch.ops.draftgraph.all_reduce(mine, "tp"), want_sum)
    want_cat = torch.cat([base * (r + 1) for r in range(tp.world_size)], dim=-1)  # [3, 5 * W]
    torch.testing.assert_close(torch.ops.draftgraph.all_gather_last(mine, "tp"), want_cat)
    assert torch.equal(mine, base * (tp.rank + 1))  # functional: the input is untouched

    # Inside torch.compile: one opaque node each (no graph break), the fakes' shapes through AOT tracing.
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

    def f(x):
        return tp.all_gather_last(tp.all_reduce(x * 2.0) + 1.0)

    got = torch.compile(f, backend=backend, fullgraph=True)(mine)
    torch.testing.assert_close(got, (want_sum * 2.0 + 1.0).repeat(1, tp.world_size))
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert sum("draftgraph.all_reduce" in t for t in targets) == 1, targets
    assert sum("draftgraph.all_gather_last" in t for t in targets) == 1, targets


def _check_model(tp: ParallelGroup, name: str):
    kw = {**SHAPE, **MODELS[name]}
    hf = tiny_hf_model(kw.pop("family"), **kw)  # the same seeded weights on every rank
    full, shard = CausalLM.from_hf(hf), CausalLM.from_hf(hf, tp=tp)
    w = tp.world_size
    assert shard.cfg.num_kv_heads == 4 // w and shard.cfg.kv_entry_shapes == ((4 // w, shard.cfg.head_dim),) * 2
    assert shard.embed_tokens.weight.shape[0] == full.cfg.vocab_size // w

    ids = torch.randint(0, full.cfg.vocab_size, (18,), generator=torch.Generator().manual_seed(1))
    logits = []
    for model in (full, shard):
        runner = PagedRunner(model.cfg)
        assert runner.cache.layers[0][0].shape[-2] == model.cfg.num_kv_heads  # the cache holds local KV heads
        meta, pos = runner.batch([(0, 11), (1, 7)])
        with torch.no_grad():
            hidden, _ = model(ids, pos, meta, runner.cache.layers)
            logits.append(model.compute_logits(hidden))
    assert logits[1].shape == (18, full.cfg.vocab_size)
    torch.testing.assert_close(logits[1], logits[0], atol=ATOL, rtol=0)

    # Greedy generation in NONE mode: every rank runs the same requests and picks the same tokens as one
    # process and transformers; with a tensor-parallel draft model (draft TP = TP) too.
    draft_kw = {**SHAPE, "num_hidden_layers": 1, **{k: v for k, v in MODELS[name].items() if k != "family"}}
    draft_hf = tiny_hf_model(MODELS[name]["family"], seed=1, **draft_kw)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, full.cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 13, 2)]
    params = dg.SamplingParams(max_tokens=6, ignore_eos=True)
    config = dg.CompileConfig(device="cpu", max_num_seqs=4, max_num_batched_tokens=32)
    want = [o.token_ids for o in dg.compile_model(full, config=config).generate(prompts, params)]
    assert want == hf_greedy(hf, prompts, [params] * len(prompts))  # transformers' generate()
    got = [o.token_ids for o in dg.compile_model(shard, config=config).generate(prompts, params)]
    assert got == want
    spec = dg.CompileConfig(device="cpu", max_num_seqs=4, max_num_batched_tokens=32, num_speculative_tokens=2)
    for draft in (CausalLM.from_hf(draft_hf, tp=tp), CausalLM.from_hf(draft_hf)):  # draft TP = TP, then 1
        eng = dg.compile_model(shard, draft, spec)
        assert [o.token_ids for o in eng.generate(prompts, params)] == want
        assert eng.stats()["draft_tokens"] > 0


def _run_all(tp: ParallelGroup):
    _check_collectives(tp)
    for name in MODELS:
        _check_model(tp, name)
    if tp.world_size == 4:  # heads over a target split 4 ways (test_tp_drafters.py runs all kinds at 2)
        from tests.test_tp_drafters import _check_heads

        _check_heads(tp, kinds=("eagle3",), compiled=False)


def _peer_dies(tp: ParallelGroup):
    if tp.rank == 1:
        os._exit(3)  # a worker killed before the collective
    torch.ops.draftgraph.all_reduce(torch.ones(4), "tp")


# ---- the tests ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4])
def test_tensor_parallel_equals_one_process(world_size, tmp_path):
    spawn(_run_all, world_size, tmp_path)


def test_dead_peer_fails_instead_of_hanging(tmp_path):
    # A hang would end in spawn's failure naming the ranks (an AssertionError, not this exception): raising this proves
    # the dead rank was noticed, and the live one (blocked in its all-reduce) ended with it.
    with pytest.raises(mp.ProcessExitedException, match="exit code 3"):
        spawn(_peer_dies, 2, tmp_path)


def test_one_process_ops_are_copies():
    x = torch.randn(2, 3)
    for op in (torch.ops.draftgraph.all_reduce, torch.ops.draftgraph.all_gather_last):
        y = op(x, "")
        assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()


def test_refuses_sizes_it_cannot_split():
    tp3 = ParallelGroup(0, 3, "unregistered")  # shapes are checked before any process group is used
    cfg = ModelConfig.from_hf(tiny_hf_model("llama", **SHAPE).config)
    with pytest.raises(ValueError, match=r"tensor-parallel size 3 does not divide num_attention_heads=8.*\[1, 2, 4\]"):
        shard_config(cfg, tp3)
    from tests.test_qwen3_5 import tiny_qwen3_5

    qwen = ModelConfig.from_hf(tiny_qwen3_5().config)  # 2 KV heads, 2 linear-attention k heads
    with pytest.raises(ValueError, match=r"size 4 does not divide.*linear_num_key_heads=2.*\[1, 2\]"):
        shard_config(qwen, ParallelGroup(0, 4, "tp"))
    with pytest.raises(ValueError, match="needs the group_name"):
        ParallelGroup(0, 2)


def test_what_cannot_be_split_is_refused_by_name():
    """No process group is needed: the checks run while loading, before any collective."""
    from draftgraph.build.engine import load_target
    from draftgraph.models.builtin import BuiltinSpec, builtin_drafter, builtin_hf_target, module_from_state_dict
    from draftgraph.models.drafters.loader import load_drafter
    from draftgraph.ops.collectives.op import ParallelGroup

    spec = BuiltinSpec(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2,
                       num_kv_heads=2, head_dim=32, draft_layers=1, max_position_embeddings=256)  # fmt: skip
    hf = builtin_hf_target(spec)
    whole = CausalLM.from_hf(hf)
    tp2 = ParallelGroup(0, 2, "unused")
    with pytest.raises(ValueError, match="CausalLM object cannot be split over tensor_parallel_size=2"):
        load_target(whole, "cpu", None, "reference", tp2)
    share = load_target(hf, "cpu", None, "reference", tp2)
    assert share.tp.world_size == 2 and share.cfg.num_heads == 1  # this rank's heads
    eagle = builtin_drafter("eagle", whole)  # its weights, under the upstream names
    state = {k: v for k, v in eagle.state_dict().items() if not k.startswith("_target")}
    with pytest.raises(ValueError, match=r"eagle drafter with draft_tensor_parallel_size=4 .*allowed: \[1, 2\]"):
        load_drafter(module_from_state_dict(state), share, kind="eagle", tp=ParallelGroup(0, 4, "unused"))
