"""Our Llama-family models against transformers on the same random weights (float32, CPU).

Tolerance: 1e-4 absolute on logits of magnitude ~1. Both sides run float32; the only differences are
summation order (fused QKV / gate-up matmuls, attention through the paged cache) at ~1e-6.
"""

import pytest
import torch

from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.config import ModelConfig
from tests.helpers import PagedRunner, tiny_hf_model

ATOL = 1e-4
VARIANTS = {
    "llama": dict(family="llama"),
    "llama3-rope": dict(
        family="llama",
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama-tied": dict(family="llama", tie_word_embeddings=True),
    "llama-bias": dict(family="llama", attention_bias=True, mlp_bias=True),
    "qwen2": dict(family="qwen2"),
    "qwen3": dict(family="qwen3"),
    "mistral": dict(family="mistral"),
    "mistral-window": dict(family="mistral", sliding_window=7),
}


def build(variant):
    kw = dict(VARIANTS[variant])
    hf = tiny_hf_model(kw.pop("family"), **kw)
    return hf, CausalLM.from_hf(hf)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_full_sequence_logits_match_transformers(variant):
    hf, ours = build(variant)
    ids = torch.randint(0, hf.config.vocab_size, (2, 23))
    with torch.no_grad():
        ref = hf(ids).logits  # [2, 23, V]
    runner = PagedRunner(ours.cfg)
    meta, pos = runner.batch([(0, 23), (1, 23)])  # two requests in one flat batch
    with torch.no_grad():
        hidden, _ = ours(ids.flatten(), pos, meta, runner.cache.layers)
        logits = ours.compute_logits(hidden)
    torch.testing.assert_close(logits.view(2, 23, -1), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_then_paged_decode_matches_transformers(variant):
    hf, ours = build(variant)
    ids = torch.randint(0, hf.config.vocab_size, (1, 21))
    with torch.no_grad():
        ref = hf(ids).logits[0]  # [21, V]
    runner = PagedRunner(ours.cfg, block_size=4)
    got = []
    with torch.no_grad():
        meta, pos = runner.batch([(0, 9)])  # prefill 9 tokens, crossing two block boundaries
        hidden, _ = ours(ids[0, :9], pos, meta, runner.cache.layers)
        got.append(ours.compute_logits(hidden, torch.tensor([8])))  # last token only
        for t in range(9, 21):  # then one token per step
            meta, pos = runner.batch([(0, 1)])
            hidden, _ = ours(ids[0, t : t + 1], pos, meta, runner.cache.layers)
            got.append(ours.compute_logits(hidden))
    torch.testing.assert_close(torch.cat(got), ref[8:], atol=ATOL, rtol=0)


def test_logits_only_for_requested_rows():
    hf, ours = build("llama")
    runner = PagedRunner(ours.cfg)
    meta, pos = runner.batch([(0, 5), (1, 7)])
    ids = torch.randint(0, 96, (12,))
    with torch.no_grad():
        hidden, _ = ours(ids, pos, meta, runner.cache.layers)
        last = meta.query_start_loc[1:] - 1  # the last token of each request
        logits = ours.compute_logits(hidden, last)
    assert logits.shape == (2, 96)
    torch.testing.assert_close(logits, ours.compute_logits(hidden)[last])


def test_aux_hidden_states_are_layer_outputs():
    hf, ours = build("llama")
    ids = torch.randint(0, 96, (1, 6))
    with torch.no_grad():
        hf_states = hf(ids, output_hidden_states=True).hidden_states  # embeddings, then each layer
        runner = PagedRunner(ours.cfg)
        meta, pos = runner.batch([(0, 6)])
        _, aux = ours(ids[0], pos, meta, runner.cache.layers, aux_layers=(0, 1))
    torch.testing.assert_close(aux[0], hf_states[1][0], atol=ATOL, rtol=0)
    torch.testing.assert_close(aux[1], hf_states[2][0], atol=ATOL, rtol=0)
    runner = PagedRunner(ours.cfg)
    meta, pos = runner.batch([(0, 6)])
    with torch.no_grad():  # order as asked, repeats kept: EAGLE-3 concatenates exactly these
        _, aux = ours(ids[0], pos, meta, runner.cache.layers, aux_layers=(1, 0, 0))
    assert len(aux) == 3 and torch.equal(aux[1], aux[2])
    torch.testing.assert_close(aux[0], hf_states[2][0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("sharded", [False, True])
def test_save_pretrained_roundtrip(tmp_path, sharded):
    hf, from_memory = build("qwen2")
    hf.save_pretrained(tmp_path, max_shard_size="20KB" if sharded else "1GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    loaded = CausalLM.from_pretrained(str(tmp_path))
    assert loaded.cfg == from_memory.cfg
    ids = torch.randint(0, 96, (10,))
    outs = []
    for model in (from_memory, loaded):
        runner = PagedRunner(model.cfg)
        meta, pos = runner.batch([(0, 10)])
        with torch.no_grad():
            outs.append(model.compute_logits(model(ids, pos, meta, runner.cache.layers)[0]))
    assert torch.equal(outs[0], outs[1])


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="model_type='gpt2'.*supported"):
        ModelConfig.from_hf({"model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope_type='longrope'"):
        ModelConfig.from_hf(
            {
                "model_type": "llama",
                "vocab_size": 8,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4},
            }
        )


def test_checkpoint_shape_mismatch_is_refused(tmp_path):
    hf, _ = build("llama")
    hf.save_pretrained(tmp_path)
    import json

    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_key_value_heads"] = 4  # the weights have 2 KV heads
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.qkv\.weight has shape \[128, 64\].*implies \[192, 64\]"):
        CausalLM.from_pretrained(str(tmp_path))


def test_builtin_hf_pair_is_the_builtin_pair_as_transformers_objects():
    """What worker processes load (CLI --tp): the transformers draft holds the target's first layers, so it
    computes what the in-memory truncated draft model computes."""
    from draftgraph.models.builtin import BuiltinSpec, builtin_hf_pair

    spec = BuiltinSpec(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=2,
                       num_kv_heads=1, head_dim=16, draft_layers=1, max_position_embeddings=128)  # fmt: skip
    target, draft = builtin_hf_pair(spec)
    assert draft.config.num_hidden_layers == 1 and target.config.num_hidden_layers == 3
    ids = torch.tensor([[3, 14, 15, 92, 65, 35]])
    assert torch.equal(draft.lm_head.weight, target.lm_head.weight)
    with torch.no_grad():
        got = draft(ids).logits
        target.model.layers = torch.nn.ModuleList(target.model.layers[:1])  # the target cut to its first layer
        target.config.num_hidden_layers = 1
        ref = target(ids).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
