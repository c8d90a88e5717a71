"""Expert parallelism over tensor-parallel ranks (EP = tp x dp, models/parallel/experts.py) on the CPU: gloo
processes, the tiny float32 DeepSeek-V3 (8 experts + a shared one) and Qwen3.5-MoE (4 experts + a gated shared
one), mode NONE.

tp = 2, dp = 1: each TP rank holds half the experts whole (not every expert's intermediate slice) and runs them
on all its tokens, one all-reduce; logits = one process (1e-5) and greedy tokens = the one-process engine.
tp = 2, dp = 2 (four ranks): each rank holds a quarter; uneven requests leave one replica idle for most steps
(dummy steps), and greedy tokens still equal one process's. Whole local experts are read from a transformers
object, a save_pretrained directory (one tensor per expert) and a fused safetensors file alike.
"""

import os

import pytest
import torch

import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from draftgraph.ops.collectives.op import ExpertGroups, ParallelGroup
from tests.helpers import tiny_deepseek_model
from tests.test_data_parallel import PARAMS, PROMPTS, config, deepseek_dir  # noqa: F401  (a fixture)
from tests.test_qwen3_5 import tiny_qwen3_5
from tests.test_tensor_parallel import spawn
from tests.test_tp_deepseek import logits

ATOL = 1e-5


def compiled(module, x):
    """module(x) through torch.compile (AOT tracing, no Inductor), and the call targets of its one graph."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        from torch._dynamo.backends.common import aot_autograd

        return aot_autograd(fw_compiler=lambda g, _: g)(gm, example_inputs)

    out = torch.compile(module, backend=backend, fullgraph=True)(x)
    return out, [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]


def _check_logits(tp: ParallelGroup):
    """Each TP rank: its TP share with its whole experts swapped in (read from the transformers object): the MoE
    layer = the whole layer on the same tokens, for both families, and DeepSeek-V3's logits = one process's."""
    from draftgraph.models.parallel.experts import ExpertParallelMoE, shard_experts

    ep = ExpertGroups(tp=tp)
    for hf, moe_layer, experts in ((tiny_deepseek_model(), 1, 8), (tiny_qwen3_5(moe=True), 0, 4)):
        full, shard = CausalLM.from_hf(hf), CausalLM.from_hf(hf, tp=tp)
        note = shard_experts(shard, ep, hf)
        n = experts // 2
        assert f"experts {tp.rank * n}-{tp.rank * n + n - 1} of {experts}" in note and "(tp 2 x dp 1)" in note
        moe, whole = shard.layers[moe_layer].mlp, full.layers[moe_layer].mlp
        assert isinstance(moe, ExpertParallelMoE) and moe.replicas.is_single
        torch.testing.assert_close(moe.gate_up, whole.gate_up[tp.rank * n : (tp.rank + 1) * n])  # whole experts
        assert moe.shared.down.weight.shape[1] * 2 == whole.shared.down.weight.shape[1]  # shared: the TP slice
        x = torch.randn(7, full.cfg.hidden_size, generator=torch.Generator().manual_seed(1))  # the same on both
        with torch.no_grad():
            torch.testing.assert_close(moe(x), whole(x), atol=ATOL, rtol=0)
        if full.cfg.mla is None:
            continue
        # DeepSeek-V3: the whole model's logits (Qwen3.5's state rings: its engine test below), and the layer
        # inside torch.compile: no gather / scatter with one replica, one node for the all-reduce
        ids = torch.randint(0, full.cfg.vocab_size, (18,), generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(logits(shard, ids), logits(full, ids), atol=ATOL, rtol=0)
        with torch.no_grad():
            got, targets = compiled(moe, x)
        torch.testing.assert_close(got, whole(x), atol=ATOL, rtol=0)
        counts = {op: sum(f"draftgraph.{op}" in t for t in targets) for op in
                  ("all_reduce", "moe_experts", "all_gather_rows", "reduce_scatter_rows")}  # fmt: skip
        assert counts == {"all_reduce": 1, "moe_experts": 1, "all_gather_rows": 0, "reduce_scatter_rows": 0}, targets


def test_tensor_parallel_experts_equal_one_process(tmp_path):
    spawn(_check_logits, 2, tmp_path)


def test_local_experts_from_every_layout(tmp_path):
    """Experts [2, 4) of the tiny DeepSeek-V3 from the transformers object, its save_pretrained directory (one
    tensor per expert) and a fused-layout safetensors file (rows read through get_slice) = the loaded ones."""
    from safetensors.torch import save_file

    from draftgraph.models.parallel.expert_weights import local_experts

    hf = tiny_deepseek_model()
    full = CausalLM.from_hf(hf)
    hf.save_pretrained(tmp_path / "per_expert")
    os.makedirs(tmp_path / "fused")
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(tmp_path / "fused" / "model.safetensors"))
    for source in (hf, str(tmp_path / "per_expert"), str(tmp_path / "fused")):
        got = local_experts(source, {1, 2}, 2, 2)
        for layer in (1, 2):
            gate_up, down = got[layer]
            assert torch.equal(gate_up, full.layers[layer].mlp.gate_up[2:4]), (source, layer)
            assert torch.equal(down, full.layers[layer].mlp.down[2:4]), (source, layer)


@pytest.fixture(scope="module")
def deepseek_one(deepseek_dir):  # noqa: F811
    """The one-process engine's greedy tokens for PROMPTS (the tiny DeepSeek-V3 with its MTP drafter)."""
    path, _ = deepseek_dir
    return [o.token_ids for o in dg.compile_model(path, path, config()).generate(PROMPTS, PARAMS)]


def test_deepseek_tp2_expert_parallel_engine_and_cli(deepseek_dir, deepseek_one, capsys):  # noqa: F811
    """TP 2 with expert parallelism, the MTP drafter split like the target: tokens = one process; the CLI's
    --tp 2 --expert-parallel runs too."""
    path, want = deepseek_dir[0], deepseek_one
    with dg.compile_model(path, path, config(tensor_parallel_size=2, expert_parallel=True)) as engine:
        assert "experts 0-3 of 8 in each of 2 MoE layers on rank 0 of 2 (tp 2 x dp 1)" in engine.warm_up_report
        assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == want
        assert engine.stats()["accepted_tokens"] > 0
    from draftgraph.cli import main

    args = ["generate", "--device", "cpu", "--target", path, "--no-drafter", "--tp", "2", "--expert-parallel",
            "--num-prompts", "2", "--prompt-len", "4", "--max-tokens", "3", "--max-model-len", "64"]  # fmt: skip
    assert main(args) == 0
    assert "experts 0-3 of 8 in each of 2 MoE layers on rank 0 of 2 (tp 2 x dp 1)" in capsys.readouterr().out


def test_qwen3_5_moe_tp2_expert_parallel_engine(tmp_path):
    hf = tiny_qwen3_5(moe=True)
    hf.save_pretrained(tmp_path)
    want = [o.token_ids for o in dg.compile_model(str(tmp_path), None, config()).generate(PROMPTS, PARAMS)]
    with dg.compile_model(str(tmp_path), None, config(tensor_parallel_size=2, expert_parallel=True)) as engine:
        assert "experts 0-1 of 4 in each of 4 MoE layers on rank 0 of 2 (tp 2 x dp 1)" in engine.warm_up_report
        assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == want


def test_deepseek_tp2_dp2_expert_parallel_with_an_idle_replica(deepseek_dir, deepseek_one):  # noqa: F811
    """Four ranks, EP 4 (two experts each): replica 1 is idle for most steps (dummy steps, its two TP ranks
    alike), tokens = one process, outputs in order."""
    path, want = deepseek_dir[0], deepseek_one
    cfg = config(tensor_parallel_size=2, data_parallel_size=2, expert_parallel=True)
    with dg.compile_model(path, path, cfg) as engine:
        assert "experts 0-1 of 8 in each of 2 MoE layers on rank 0 of 4 (tp 2 x dp 2)" in engine.warm_up_report
        outs = engine.generate(PROMPTS, PARAMS)
        assert [o.token_ids for o in outs] == want and [o.request_id for o in outs] == [0, 1, 2]
        busy, idle = engine.stats()["per_replica"]
        assert busy["dummy_steps"] == 0 and idle["dummy_steps"] > idle["steps"] > 0
        assert idle["steps"] + idle["dummy_steps"] == busy["steps"]


def test_expert_parallel_refusals():
    """EP sizes that do not divide the experts, named with tp x dp and the sizes that work; a dense target."""
    from draftgraph.models.builtin import builtin_hf_target
    from draftgraph.models.parallel.experts import ExpertParallelMoE, check_expert_config, shard_experts
    from tests.test_data_parallel import SPEC

    def groups(tp: int, dp: int) -> ExpertGroups:  # checked before any collective: names never looked up
        return ExpertGroups(ParallelGroup(0, dp, "dp") if dp > 1 else ParallelGroup(), ParallelGroup(0, tp, "tp"))

    hf = tiny_deepseek_model()
    ds = CausalLM.from_hf(hf)
    six = r"over 6 ranks \(tensor_parallel_size=2 x data_parallel_size=3\) .* deepseek_v3 has 8 routed experts; "
    with pytest.raises(ValueError, match=six + r"use tp x dp dividing 8 \(one of \[1, 2, 4, 8\]\)"):
        check_expert_config(ds.cfg, groups(2, 3))
    with pytest.raises(ValueError, match=r"over 3 ranks .* 8 routed experts"):
        ExpertParallelMoE(ds.layers[1].mlp, groups(1, 3))
    qwen = CausalLM.from_hf(tiny_qwen3_5(moe=True)).cfg
    with pytest.raises(ValueError, match=r"over 8 ranks \(tensor_parallel_size=4 x data_parallel_size=2\).* 4 routed"):
        check_expert_config(qwen, groups(4, 2))
    check_expert_config(qwen, groups(2, 2))  # 4 experts over 4 ranks: fine
    dense = CausalLM.from_hf(builtin_hf_target(SPEC))
    with pytest.raises(ValueError, match=r"target \(llama\) has no MoE layer to split"):
        check_expert_config(dense.cfg, groups(2, 1))
    with pytest.raises(ValueError, match=r"target \(llama\) has no MoE layer to split"):
        shard_experts(dense, groups(1, 2))
