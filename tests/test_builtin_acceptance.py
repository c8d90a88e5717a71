"""The acceptance pair (models/builtin.py: acceptance_pair, TINY_ACCEPTANCE, the structure of the 1B pair
scripts/bench_e2e.py runs): the drafter is the target's first layers sharing its tensors, and the scaled upper
layers are what makes it accept: at K = 4, greedy, about 2.5 drafts per step, against under 1 unscaled.
Mode NONE on the CPU, float32: acceptance is a property of the weights, not of compiling."""

from dataclasses import replace

import pytest
import torch

import draftgraph as dg
from draftgraph.models.builtin import LLAMA_1B_ACCEPTANCE, TINY_ACCEPTANCE, BuiltinSpec, acceptance_pair

K = 4


def mean_accepted(spec: BuiltinSpec) -> tuple[float, list[int]]:
    """Mean accepted drafts per verify step over 8 seeded prompts of 16 tokens, 48 new tokens each."""
    _, target, drafter = acceptance_pair(spec, dtype=torch.float32)
    cfg = dg.CompileConfig(mode="NONE", num_speculative_tokens=K, max_num_seqs=8, progress=False)
    engine = dg.compile_model(target, drafter, cfg)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, spec.vocab_size, (8, 16), generator=g).tolist()
    engine.generate(prompts, dg.SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True))
    s = engine.stats()
    return s["accepted_tokens"] / s["verify_steps"], s["acceptance_histogram"]


def test_drafter_is_the_targets_first_layers_sharing_its_tensors():
    hf, target, drafter = acceptance_pair(TINY_ACCEPTANCE, dtype=torch.float32)
    n = TINY_ACCEPTANCE.draft_layers
    draft = drafter.model
    assert len(draft.layers) == n < len(target.layers) == TINY_ACCEPTANCE.num_layers
    assert all(draft.layers[i] is target.layers[i] for i in range(n))
    assert draft.embed_tokens is target.embed_tokens and draft.norm is target.norm
    assert draft.head_weight is target.head_weight is target.embed_tokens.weight  # tied, as Llama-3.2-1B
    # Same weights as the transformers model handed back for comparisons.
    torch.testing.assert_close(target.embed_tokens.weight, hf.model.embed_tokens.weight, rtol=0, atol=0)
    # The residual branches of the layers the drafter skips are scaled by late_scale, the others are not.
    std = TINY_ACCEPTANCE.init_std
    for i, layer in enumerate(hf.model.layers):
        want = std * (TINY_ACCEPTANCE.late_scale if i >= n else 1.0)
        for w in (layer.self_attn.o_proj.weight, layer.mlp.down_proj.weight):
            assert abs(w.std().item() / want - 1) < 0.1, (i, w.std().item(), want)


def test_acceptance_lies_between_2_and_3_of_4_and_comes_from_the_scaling():
    acc, hist = mean_accepted(TINY_ACCEPTANCE)
    assert 2.0 <= acc <= 3.0, (acc, hist)  # measured 2.31 (seed 0); unscaled 0.19
    assert hist[0] > 0 and hist[K] > 0, hist  # drafts rejected at once in some steps, all accepted in others
    unscaled, hist = mean_accepted(replace(TINY_ACCEPTANCE, late_scale=1.0))
    assert unscaled < 1.0, (unscaled, hist)  # the same weights without the scaling


def test_the_1b_spec_has_llama_3_2_1b_shape_and_a_2_layer_drafter():
    s = LLAMA_1B_ACCEPTANCE
    shape = (s.vocab_size, s.hidden_size, s.intermediate_size, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim)
    assert shape == (128256, 2048, 8192, 16, 32, 8, 64)
    assert s.tie_word_embeddings and s.draft_layers == 2 and s.first_late_layer == 2


def test_late_from_outside_the_undrafted_layers_is_refused_with_the_range():
    with pytest.raises(ValueError, match=r"late_from=1 must lie in \[draft_layers=2, num_layers=6\]"):
        BuiltinSpec(late_from=1)
    assert BuiltinSpec(late_from=4).first_late_layer == 4
