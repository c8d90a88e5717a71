"""DeepSeek-V3 / V3.2 over tensor parallelism on the CPU: processes over gloo, the tiny float32 models of
tests/helpers.py and test_deepseek_v32.py (4 MLA heads, 8 routed experts of intermediate 32 + a shared one, a
dense first layer; V3.2: its indexer, 16 heads, top-8, replicated on every rank).

Each rank checks its share (models/parallel/mla.py): local heads and expert slices, the router and the
latent cache (and V3.2's index-key cache) whole; logits of a flat two-request batch in both MLA forms = one
process (1e-5: the sharded sums only change the summation order); greedy tokens in mode NONE =
transformers' generate() and the one-process engine, alone and with the MTP drafter split like the target
(draft TP = TP) and replicated (draft TP = 1, no collective in its step), the same drafts accepted; V3 once
compiled (PIECEWISE, eager backend).
"""

import pytest
import torch

import draftgraph as dg
from draftgraph.models.builtin import deepseek_layer_weights, module_from_state_dict
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.deepseek import set_mla_form
from draftgraph.models.drafters.loader import load_drafter
from draftgraph.models.parallel.dense import full_config, shard_config
from draftgraph.ops.collectives.op import SINGLE, ParallelGroup, get_group, register_group, unregister_group
from tests.helpers import PagedRunner, tiny_deepseek_config, tiny_deepseek_model
from tests.test_deepseek_v32 import hf_greedy, tiny_v32_model
from tests.test_tensor_parallel import spawn
from tests.test_tp_drafters import drafter_logits

ATOL = 1e-5


def mtp_weights(full: CausalLM) -> dict:
    """A DeepSeek MTP layer (hub layout) that mostly repeats the target's prediction: eh_proj keeps the
    target's hidden state, its MLA and experts add small random outputs (partial acceptance; the split counts)."""
    h, p = full.cfg.hidden_size, f"model.layers.{full.cfg.num_layers}."
    w = deepseek_layer_weights(p, full.cfg, torch.Generator().manual_seed(7), std=0.02)
    w.update({p + n: torch.ones(h) for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")})
    w[p + "eh_proj.weight"] = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1)
    return w


def logits(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    runner = PagedRunner(model.cfg)
    meta, pos = runner.batch([(0, 11), (1, 7)])
    with torch.no_grad():
        hidden, _ = model(ids, pos, meta, runner.cache.layers)
        return model.compute_logits(hidden)


def _check_deepseek(tp: ParallelGroup, drafters: bool, name: str = "v3"):
    hf = tiny_deepseek_model() if name == "v3" else tiny_v32_model()
    full, shard = CausalLM.from_hf(hf), CausalLM.from_hf(hf, tp=tp)
    w = tp.world_size
    assert shard.cfg.num_heads == 4 // w and shard.cfg.moe.moe_intermediate_size == 32 // w
    assert shard.cfg.kv_entry_shapes == full.cfg.kv_entry_shapes  # the whole latent on every rank
    moe = shard.layers[1].mlp
    assert moe.gate_up.shape == (8, 2 * 32 // w, 64) and moe.gate.shape == (8, 64)  # expert slices, whole router
    assert shard.layers[0].attn.kv_b.weight.shape[0] == (4 // w) * (16 + 16)  # kv_b: this rank's heads
    assert full_config(shard.cfg) == full.cfg
    if name == "v32":  # the indexer whole on every rank
        assert shard.layers[0].attn.indexer.wq_b.weight.shape == full.layers[0].attn.indexer.wq_b.weight.shape

    ids = torch.randint(0, full.cfg.vocab_size, (18,), generator=torch.Generator().manual_seed(1))
    for form in ("absorbed", "decompressed"):
        set_mla_form(full, form), set_mla_form(shard, form)
        torch.testing.assert_close(logits(shard, ids), logits(full, ids), atol=ATOL, rtol=0, msg=form)
    set_mla_form(full, "auto"), set_mla_form(shard, "auto")

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, full.cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 13, 2)]
    params = dg.SamplingParams(max_tokens=8, ignore_eos=True)
    want = hf_greedy(hf, prompts, [params] * len(prompts))  # transformers' generate()
    config = dg.CompileConfig(device="cpu", max_num_seqs=4, max_num_batched_tokens=32)
    assert [o.token_ids for o in dg.compile_model(shard, config=config).generate(prompts, params)] == want
    if not drafters:
        return

    spec = dg.CompileConfig(device="cpu", max_num_seqs=4, max_num_batched_tokens=32, num_speculative_tokens=2)
    mtp = mtp_weights(full)
    one = load_drafter(module_from_state_dict(mtp), full, kind="mtp")
    ref = dg.compile_model(full, one, spec)
    assert [o.token_ids for o in ref.generate(prompts, params)] == want
    accepted = ref.stats()["accepted_tokens"]
    assert 0 < accepted < ref.stats()["draft_tokens"]  # partial acceptance: the drafts matter
    ref_logits = drafter_logits(one, full.cfg.vocab_size)
    for draft_tp in (tp, SINGLE):
        d = load_drafter(module_from_state_dict(mtp), shard, kind="mtp", tp=draft_tp)
        assert d.cfg.num_heads == 4 // draft_tp.world_size and type(d.block.mlp).__name__ == "MoE"
        if draft_tp.is_single:  # replicated: no collective in its step (the group is gone while it runs)
            group = get_group("tp")
            unregister_group("tp")
            try:
                got = drafter_logits(d, full.cfg.vocab_size)
            finally:
                register_group("tp", group)
        else:
            got = drafter_logits(d, full.cfg.vocab_size)
        torch.testing.assert_close(got, ref_logits, atol=ATOL, rtol=0, msg=f"draft tp {draft_tp}")
        eng = dg.compile_model(shard, d, spec)
        assert [o.token_ids for o in eng.generate(prompts, params)] == want, draft_tp
        assert eng.stats()["accepted_tokens"] == accepted, draft_tp  # the same drafts

    if name != "v3":
        return
    # Compiled: MLA (a splitting op) between pieces, the all-reduces of o_proj and the MoE inside them.
    pw = dg.CompileConfig(
        device="cpu", mode="PIECEWISE", compile_backend="eager", max_num_seqs=4, max_num_batched_tokens=32,
        num_speculative_tokens=2, capture_sizes=(4, 8, 32), progress=False,
    )  # fmt: skip
    d = load_drafter(module_from_state_dict(mtp), shard, kind="mtp", tp=tp)
    eng = dg.compile_model(shard, d, pw)
    assert [o.token_ids for o in eng.generate(prompts, params)] == want
    assert eng.compiled.counters.traces["target"] == 1 and eng.compiled.counters.traces["drafter"] == 1


def _v3_and_v32(tp: ParallelGroup):
    _check_deepseek(tp, True, "v3")
    _check_deepseek(tp, True, "v32")


def test_deepseek_v3_and_v32_at_tp2_equal_one_process_and_transformers(tmp_path):
    spawn(_v3_and_v32, 2, tmp_path)


def test_deepseek_v3_at_tp4(tmp_path):
    """One head and an 8-wide slice of each expert per rank; alone and with the MTP drafter at draft TP 4 and 1."""
    spawn(_check_deepseek, 4, tmp_path, True)


def test_sizes_tp_cannot_split_are_refused():
    cfg = full_config(CausalLM.from_hf(tiny_deepseek_model()).cfg)
    with pytest.raises(ValueError, match=r"tensor-parallel size 3 does not divide num_attention_heads=4.*\[1, 2, 4\]"):
        shard_config(cfg, ParallelGroup(0, 3, "unused"))
    odd = CausalLM.from_hf(tiny_deepseek_model(moe_intermediate_size=30)).cfg
    with pytest.raises(ValueError, match=r"does not divide moe_intermediate_size=30.*\[1, 2\]"):
        shard_config(odd, ParallelGroup(0, 4, "unused"))
    assert tiny_deepseek_config().num_attention_heads == 4
