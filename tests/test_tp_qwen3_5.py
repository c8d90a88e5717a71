"""Qwen3.5 hybrids over tensor parallelism on the CPU: two processes over gloo, the tiny float32 dense and MoE
models of test_qwen3_5.py (4 attention heads / 2 KV heads, Gated DeltaNet with 2 k heads and 4 v heads).

Each rank checks its share (models/parallel/hybrid.py): local k / v heads, so its state rings hold half the
heads; greedy tokens in mode NONE (5 prompts through 2 slots, a 77-token prompt in three chunks) = transformers'
generate(); the MTP head (random, `mtp.*` layout) split like the target (draft TP = 2) and replicated (draft
TP = 1, no collective in its step): its logits on a flat two-request batch = one process (1e-5), and the
engine's tokens = transformers' with the one-process engine's accepted drafts.
"""

import torch

from draftgraph.models.builtin import module_from_state_dict
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.drafters.loader import load_drafter
from draftgraph.models.drafters.qwen3_5_mtp import random_mtp_weights
from draftgraph.models.parallel.dense import full_config
from draftgraph.ops.collectives.op import SINGLE, ParallelGroup, get_group, register_group, unregister_group
from tests.test_qwen3_5 import hf_generate, run, tiny_qwen3_5
from tests.test_tensor_parallel import spawn
from tests.test_tp_drafters import drafter_logits

ATOL = 1e-5


def _check_qwen3_5(tp: ParallelGroup):
    for moe in (False, True):
        hf = tiny_qwen3_5(moe)
        want = hf_generate(hf)  # transformers' generate()
        full, shard = CausalLM.from_hf(hf), CausalLM.from_hf(hf, tp=tp)
        la = shard.cfg.hybrid.linear
        assert (la.num_k_heads, la.num_v_heads, shard.cfg.num_kv_heads) == (1, 2, 1)
        assert full_config(shard.cfg) == full.cfg
        assert shard.layers[0].attn.conv_weight.shape[0] == la.conv_dim == full.cfg.hybrid.linear.conv_dim // 2
        got, _ = run(shard, k=0)
        assert got == want, moe

        w = random_mtp_weights(full.cfg, torch.Generator().manual_seed(3))
        one = load_drafter(module_from_state_dict(w), full, kind="mtp")
        _, ref = run(full, one, k=2)
        ref_logits = drafter_logits(one, full.cfg.vocab_size)
        for draft_tp in (tp, SINGLE):
            d = load_drafter(module_from_state_dict(w), shard, kind="mtp", tp=draft_tp)
            assert d.cfg.num_heads == 4 // draft_tp.world_size
            if draft_tp.is_single:  # replicated: no collective in its step (the group is gone while it runs)
                group = get_group("tp")
                unregister_group("tp")
                try:
                    got_logits = drafter_logits(d, full.cfg.vocab_size)
                finally:
                    register_group("tp", group)
            else:
                got_logits = drafter_logits(d, full.cfg.vocab_size)
            torch.testing.assert_close(got_logits, ref_logits, atol=ATOL, rtol=0, msg=f"moe={moe} {draft_tp}")
            got, eng = run(shard, d, k=2)
            assert got == want, (moe, draft_tp)
            assert eng.stats()["accepted_tokens"] == ref.stats()["accepted_tokens"], (moe, draft_tp)


def test_qwen3_5_at_tp2_equals_transformers(tmp_path):
    spawn(_check_qwen3_5, 2, tmp_path)
