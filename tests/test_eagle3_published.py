"""EAGLE-3 heads in the published checkpoint layout (as for Llama-3.1-8B: config.json with architectures
LlamaForCausalLMEagle3, draft_vocab_size and a training length shorter than the target's; weights midlayer.*,
fc.weight, norm.weight, lm_head.weight over the draft vocabulary, d2t, t2d): the checkpoint is written with
random (copy-style) weights over a reduced draft vocabulary, loads by kind detection, and speculation with it is
lossless: greedy tokens equal the target's own in NONE and FULL_AND_PIECEWISE (CPU: compiled with the eager
backend, no graphs), with drafts accepted through d2t. A config or mask that disagrees with the weights is
refused by name."""

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.drafters import load_drafter
from tests.copy_drafters import copy_eagle3_state
from tests.helpers import tiny_hf_model
from tests.test_engine import ragged

DRAFT_VOCAB = 60  # of the target's 96
CONFIG = dg.CompileConfig(mode="NONE", num_speculative_tokens=3, max_num_seqs=8, max_num_batched_tokens=64,
                          compile_backend="eager", progress=False)  # fmt: skip


@pytest.fixture(scope="module")
def target():
    return CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96))


def published_config(target, draft_vocab: int) -> dict:
    c = target.cfg
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_heads,
        "num_key_value_heads": c.num_kv_heads,
        "num_hidden_layers": 1,
        "max_position_embeddings": 32,  # shorter than the target's 256, as 2048 is beside Llama-3.1's 131072
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope.theta,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "vocab_size": c.vocab_size,
        "draft_vocab_size": draft_vocab,
    }


def write_checkpoint(path, config: dict, state: dict) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors")
    return str(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, target):
    state = copy_eagle3_state(target, DRAFT_VOCAB)
    return write_checkpoint(tmp_path_factory.mktemp("eagle3"), published_config(target, DRAFT_VOCAB), state), state


def run(target, drafter, config):
    prompts, params, arrivals = ragged(8)
    eng = dg.compile_model(target, drafter, config)
    return eng, [o.token_ids for o in eng.generate(prompts, params, arrivals)]


def test_published_layout_loads_and_is_lossless(target, checkpoint):
    path, state = checkpoint
    default = load_drafter(path, target)  # kind detected from the keys; EAGLE-3's default target layers
    assert default.kind == "eagle3" and default.aux_layers == (1, 0, 0)  # (1, L/2 - 1, L - 4) clamped, L = 3
    drafter = load_drafter(path, target, aux_layers=(0, 1, 2))  # the copy head reads the last layer third
    assert drafter.draft_vocab_size == DRAFT_VOCAB and drafter.lm_head.weight.shape[0] == DRAFT_VOCAB
    assert torch.equal(drafter.d2t, state["d2t"]) and torch.equal(drafter.t2d, state["t2d"])
    assert drafter.rope_table.shape[0] == target.rope_table.shape[0]  # covers every target position, not 32
    kept = torch.arange(DRAFT_VOCAB) + state["d2t"]
    assert torch.equal(drafter.to_target_ids(torch.arange(DRAFT_VOCAB)), kept)

    _, alone = run(target, None, replace(CONFIG, num_speculative_tokens=0))
    none, got_none = run(target, drafter, CONFIG)
    full, got_full = run(target, drafter, replace(CONFIG, mode="FULL_AND_PIECEWISE"))
    assert got_none == alone and got_full == alone  # lossless in both modes
    s_none, s_full = none.stats(), full.stats()
    # Drafts were accepted (through d2t) and rejected (targets outside the draft vocabulary), equally in both modes
    assert 0 < s_none["accepted_tokens"] == s_full["accepted_tokens"] < s_none["draft_tokens"]
    every_token = {t for out in alone for t in out}
    assert every_token - set(kept.tolist())  # the target emitted tokens the head can never draft
    # FULL_AND_PIECEWISE traced the target once and the drafter twice (its first step reads the three fused target
    # layers [T, 3H], later ones its own [T, H]); without graphs on the CPU every forward is a counted fallback
    assert dict(full.compiled.counters.traces) == {"target": 1, "drafter": 2}
    assert s_full["fallbacks"] == sum(s_full["dispatch"].values()) > 0


def test_disagreeing_layout_is_refused(tmp_path, target, checkpoint):
    _, state = checkpoint
    wrong = write_checkpoint(tmp_path / "vocab", published_config(target, 32000), state)
    with pytest.raises(ValueError, match="draft_vocab_size=32000 but lm_head.weight and d2t have 60"):
        load_drafter(wrong, target)
    mask = dict(state, t2d=~state["t2d"])
    bad_mask = write_checkpoint(tmp_path / "mask", published_config(target, DRAFT_VOCAB), mask)
    with pytest.raises(ValueError, match="t2d must be True exactly at the target ids of the draft vocabulary"):
        load_drafter(bad_mask, target)
    beyond = dict(state, d2t=state["d2t"] + 96)
    with pytest.raises(ValueError, match="largest target id reached through d2t is 189 .smallest 96. .* vocab_size=96"):
        load_drafter(write_checkpoint(tmp_path / "d2t", published_config(target, DRAFT_VOCAB), beyond), target)
