"""Head drafters (EAGLE, EAGLE-3, MTP) over a tensor-parallel target on the CPU: two processes over gloo.

Each rank builds the same seeded transformers target and the same drafter weights (upstream names), loads the
drafter over its share of the target with draft TP = 2 (split like the target) and draft TP = 1 (replicated,
the target's embedding / LM head gathered once), and checks: the drafter's logits on a flat two-request batch
equal the one-process drafter's (1e-5: the sharded sums only change the summation order); the replicated one
runs no collective (its forward runs with the process group unregistered); greedy tokens in mode NONE equal
transformers' generate() and the one-process engine's, with the same drafts accepted (so the drafts are the
same). One case runs compiled (PIECEWISE, eager backend).

The drafters are "copy" heads (drafters that pass the target's hidden state to its own head, tests/copy_drafters)
with their layers' outputs turned down but not off, so acceptance is partial and the split layers count.
"""

import pytest
import torch

import draftgraph as dg
from draftgraph.models.builtin import module_from_state_dict
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.drafters.loader import load_drafter
from draftgraph.models.parallel.dense import RowParallelLinear, VocabParallelEmbedding
from draftgraph.ops.collectives.op import SINGLE, ParallelGroup, get_group, register_group, unregister_group
from tests import dense_ref
from tests.helpers import PagedRunner, tiny_hf_model
from tests.test_deepseek_v32 import hf_greedy
from tests.test_tensor_parallel import SHAPE, spawn

ATOL = 1e-5
LAYER_SCALE = 0.1  # the drafter layers' output projections, scaled down: partial acceptance, layers still count


def _layer(prefix, cfg, in_features=None, input_norm=True):
    w = dense_ref.random_layer(
        prefix, cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
        in_features=in_features, input_norm=input_norm, gen=torch.Generator().manual_seed(7),
    )  # fmt: skip
    w[prefix + "self_attn.o_proj.weight"] *= LAYER_SCALE
    w[prefix + "mlp.down_proj.weight"] *= LAYER_SCALE
    return w


def head_weights(kind: str, full: CausalLM) -> dict:
    """Upstream-named weights of a `kind` copy head for the one-process target `full`."""
    h, vocab = full.cfg.hidden_size, full.cfg.vocab_size
    keep_hidden = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1)
    if kind == "eagle":  # borrows the target's embedding and LM head
        w = _layer("layers.0.", full.cfg, input_norm=False)
        w["fc.weight"] = keep_hidden
        return w
    if kind == "eagle3":  # borrows the embedding; its own LM head over a draft vocabulary (here all of it)
        w = _layer("midlayer.", full.cfg, in_features=2 * h)
        w["midlayer.hidden_norm.weight"] = torch.ones(h)
        w["fc.weight"] = torch.cat([torch.zeros(h, 2 * h), torch.eye(h)], dim=1)  # the third aux: the last layer
        w["norm.weight"] = full.norm.weight.detach().clone()
        w["lm_head.weight"] = full.head_weight.detach().clone()
        w["d2t"] = torch.zeros(vocab, dtype=torch.long)
        w["t2d"] = torch.ones(vocab, dtype=torch.bool)
        return w
    p = f"model.layers.{full.cfg.num_layers}."  # mtp: its own embedding, the target's LM head
    w = _layer(p, full.cfg)
    w.update({p + n: torch.ones(h) for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")})
    w[p + "eh_proj.weight"] = keep_hidden
    w[p + "embed_tokens.weight"] = full.embed_tokens.weight.detach().clone()
    return w


def load(kind, w, target, tp=SINGLE):
    aux = (0, 1, target.cfg.num_layers - 1) if kind == "eagle3" else None
    return load_drafter(module_from_state_dict(w), target, kind=kind, aux_layers=aux, tp=tp)


def drafter_logits(drafter, vocab: int) -> torch.Tensor:
    """The drafter's logits for a flat batch of two requests (11 and 7 tokens) with random target hiddens."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (18,), generator=g)
    width = 3 * drafter.cfg.hidden_size if drafter.kind == "eagle3" else drafter.cfg.hidden_size
    hidden = torch.randn(18, width, generator=g)
    runner = PagedRunner(drafter.cfg, num_layers=drafter.num_kv_layers)
    meta, pos = runner.batch([(0, 11), (1, 7)])
    with torch.no_grad():
        _, logits_hidden = drafter(ids, pos, hidden, meta, runner.cache.layers)
        return drafter.compute_logits(logits_hidden)


def _check_heads(tp: ParallelGroup, kinds=("eagle", "eagle3", "mtp"), compiled=True):
    hf = tiny_hf_model("llama", **SHAPE)  # 8 query heads, 4 KV heads, vocabulary 96
    full, shard = CausalLM.from_hf(hf), CausalLM.from_hf(hf, tp=tp)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, full.cfg.vocab_size, (n,), generator=g).tolist() for n in (5, 13, 2)]
    params = dg.SamplingParams(max_tokens=8, ignore_eos=True)
    want = hf_greedy(hf, prompts, [params] * len(prompts))  # transformers' generate()
    config = dg.CompileConfig(device="cpu", max_num_seqs=4, max_num_batched_tokens=32, num_speculative_tokens=2)
    for kind in kinds:
        w = head_weights(kind, full)
        one = load(kind, w, full)
        ref = dg.compile_model(full, one, config)
        assert [o.token_ids for o in ref.generate(prompts, params)] == want, kind
        accepted = ref.stats()["accepted_tokens"]
        assert 0 < accepted < ref.stats()["draft_tokens"], kind  # partial acceptance: drafts matter
        ref_logits = drafter_logits(one, full.cfg.vocab_size)
        for draft_tp in (tp, SINGLE):
            d = load(kind, w, shard, draft_tp)
            split = not draft_tp.is_single
            assert d.cfg.num_heads == 8 // draft_tp.world_size and d.cfg.num_kv_heads == 4 // draft_tp.world_size
            assert any(isinstance(m, RowParallelLinear) for m in d.modules()) == split
            if split:
                got = drafter_logits(d, full.cfg.vocab_size)
            else:  # replicated: no collective anywhere in its step (the group is gone while it runs)
                assert not any(isinstance(m, VocabParallelEmbedding) for m in d.modules())
                group = get_group("tp")
                unregister_group("tp")
                try:
                    got = drafter_logits(d, full.cfg.vocab_size)
                finally:
                    register_group("tp", group)
            torch.testing.assert_close(got, ref_logits, atol=ATOL, rtol=0, msg=f"{kind} draft tp {draft_tp}")
            eng = dg.compile_model(shard, d, config)
            assert [o.token_ids for o in eng.generate(prompts, params)] == want, (kind, draft_tp)
            assert eng.stats()["accepted_tokens"] == accepted, (kind, draft_tp)  # the same drafts

    if not compiled:
        return
    # One compiled case: EAGLE split like the target, PIECEWISE (the collectives inside the pieces).
    pw = dg.CompileConfig(
        device="cpu", mode="PIECEWISE", compile_backend="eager", max_num_seqs=4, max_num_batched_tokens=32,
        num_speculative_tokens=2, capture_sizes=(4, 8, 32), progress=False,
    )  # fmt: skip
    eng = dg.compile_model(shard, load("eagle", head_weights("eagle", full), shard, tp), pw)
    assert [o.token_ids for o in eng.generate(prompts, params)] == want
    assert eng.compiled.counters.traces["drafter"] == 1


def test_heads_over_a_split_target_equal_one_process(tmp_path):
    spawn(_check_heads, 2, tmp_path)


def test_other_draft_groups_are_refused_before_loading():
    """A head's group must be the target's or one process; checked before any weight is cut or gathered."""
    hf = tiny_hf_model("llama", **SHAPE)
    full = CausalLM.from_hf(hf)
    share = CausalLM.from_hf(hf, tp=ParallelGroup(0, 2, "unused"))  # slicing needs no process group
    w = head_weights("eagle", full)
    with pytest.raises(
        ValueError, match=r"draft_tensor_parallel_size=4 over a target with tensor_parallel_size=2.*\[1, 2\]"
    ):
        load("eagle", w, share, ParallelGroup(0, 4, "other"))
    with pytest.raises(ValueError, match=r"size=2 over a target with tensor_parallel_size=1.*allowed: \[1\]"):
        load("eagle", w, full, ParallelGroup(0, 2, "unused"))


def test_compile_model_runs_a_replicated_eagle_on_two_ranks():
    """The user's path: compile_model(..., tensor_parallel_size=2, draft_tensor_parallel_size=1) starts two
    ranks, each splitting the target and holding the whole EAGLE head (`--tp 2 --draft-tp 1`)."""
    from draftgraph.models.builtin import builtin_hf_target
    from tests.test_workers import PARAMS, PROMPTS, SPEC, config

    hf = builtin_hf_target(SPEC)
    full = CausalLM.from_hf(hf)
    eagle = module_from_state_dict(head_weights("eagle", full))
    one = dg.compile_model(full, eagle, config())
    want = [o.token_ids for o in one.generate(PROMPTS, PARAMS)]
    engine = dg.compile_model(hf, eagle, config(tensor_parallel_size=2, draft_tensor_parallel_size=1))
    try:
        assert engine.config.draft_tensor_parallel_size == 1
        assert [o.token_ids for o in engine.generate(PROMPTS, PARAMS)] == want
        assert engine.stats()["accepted_tokens"] == one.stats()["accepted_tokens"]
    finally:
        engine.close()
