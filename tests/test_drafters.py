"""Drafters load from checkpoints in their upstream layouts (and from modules in memory), run through the
paged cache, and equal an independent dense reference; mismatched pairs are refused by name.
Tolerance 1e-4 (float32, CPU)."""

import json

import pytest
import torch
from safetensors.torch import save_file

from draftgraph.models.builtin import module_from_state_dict
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.drafters import load_drafter
from draftgraph.models.drafters.loader import truncated_draft_model
from tests import dense_ref
from tests.helpers import PagedRunner, tiny_hf_model

ATOL = 1e-4
H, V, INTER, HEADS, KV, HD = 64, 96, 112, 4, 2, 16
THETA = 10000.0
CFG = {"heads": HEADS, "kv_heads": KV, "head_dim": HD, "theta": THETA, "eps": 1e-5}
HEAD_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": H,
    "vocab_size": V,
    "intermediate_size": INTER,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 256,
    "rope_theta": THETA,
}


@pytest.fixture(scope="module")
def target():
    return CausalLM.from_hf(tiny_hf_model("llama"))


def write_ckpt(path, config, state, fmt="safetensors"):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if fmt == "bin":
        torch.save(state, path / "pytorch_model.bin")
    else:
        save_file({k: v.contiguous() for k, v in state.items()}, path / "model.safetensors")
    return str(path)


module_from_state = module_from_state_dict  # a user's in-memory drafter under upstream key names


def run_drafter(drafter, ids, hidden, steps=1):
    """Run one sequence through the drafter; returns (next_hidden, logits) of the last call."""
    runner = PagedRunner(drafter.cfg, num_layers=drafter.num_kv_layers)
    meta, pos = runner.batch([(0, ids.shape[0])])
    with torch.no_grad():
        nxt, lh = drafter(ids, pos, hidden, meta, runner.cache.layers)
        return nxt, drafter.compute_logits(lh)


def eagle_state(gen, with_embedding=True):
    w = dense_ref.random_layer("layers.0.", H, INTER, HEADS, KV, HD, input_norm=False, gen=gen)
    w["fc.weight"] = torch.randn(H, 2 * H, generator=gen) * 0.08
    w["fc.bias"] = torch.randn(H, generator=gen) * 0.1
    if with_embedding:
        w["embed_tokens.weight"] = torch.randn(V, H, generator=gen)
    return w


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("with_embedding", [True, False])
def test_eagle_checkpoint(tmp_path, target, fmt, with_embedding):
    gen = torch.Generator().manual_seed(1)
    w = eagle_state(gen, with_embedding)
    drafter = load_drafter(write_ckpt(tmp_path / "eagle", HEAD_CONFIG | {"num_hidden_layers": 1}, w, fmt), target)
    assert drafter.kind == "eagle"
    ids, hidden = torch.randint(0, V, (9,)), torch.randn(9, H)
    nxt, logits = run_drafter(drafter, ids, hidden)
    emb = w["embed_tokens.weight"] if with_embedding else target.embed_tokens.weight
    x = torch.cat([emb[ids], hidden], -1) @ w["fc.weight"].t() + w["fc.bias"]
    ref = dense_ref.layer(x, x, w, "layers.0.", CFG, torch.arange(9))  # layer 0: no input norm
    torch.testing.assert_close(nxt, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits, ref @ target.head_weight.t(), atol=ATOL, rtol=0)


def eagle3_state(gen, draft_vocab=40):
    w = dense_ref.random_layer("midlayer.", H, INTER, HEADS, KV, HD, in_features=2 * H, gen=gen)
    w["midlayer.hidden_norm.weight"] = 1 + torch.randn(H, generator=gen) * 0.1
    w["fc.weight"] = torch.randn(H, 3 * H, generator=gen) * 0.05
    w["norm.weight"] = 1 + torch.randn(H, generator=gen) * 0.1
    w["lm_head.weight"] = torch.randn(draft_vocab, H, generator=gen) * 0.1
    kept = torch.sort(torch.randperm(V, generator=gen)[:draft_vocab]).values  # target ids in the draft vocab
    w["d2t"] = kept - torch.arange(draft_vocab)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[kept] = True
    w["t2d"] = t2d
    return w, kept


def eagle3_dense(w, emb_table, ids, hidden, pos):
    if hidden.shape[-1] != H:
        hidden = hidden @ w["fc.weight"].t()
    emb = emb_table[ids]
    x = torch.cat(
        [
            dense_ref.rms(emb, w["midlayer.input_layernorm.weight"], 1e-5),
            dense_ref.rms(hidden, w["midlayer.hidden_norm.weight"], 1e-5),
        ],
        -1,
    )
    out = dense_ref.layer(x, hidden, w, "midlayer.", CFG, pos)
    return out, dense_ref.rms(out, w["norm.weight"], 1e-5) @ w["lm_head.weight"].t()


@pytest.mark.parametrize("source", ["checkpoint", "module"])
def test_eagle3(tmp_path, target, source):
    gen = torch.Generator().manual_seed(2)
    w, kept = eagle3_state(gen)
    config = HEAD_CONFIG | {"num_hidden_layers": 1, "draft_vocab_size": 40}
    src = write_ckpt(tmp_path / "e3", config, w) if source == "checkpoint" else module_from_state(w)
    drafter = load_drafter(src, target, kind=None if source == "checkpoint" else "eagle3")
    assert drafter.kind == "eagle3" and drafter.draft_vocab_size == 40
    assert drafter.aux_layers == (1, 0, 0)  # (1, L/2 - 1, L - 4) for L = 3, clamped into the model
    ids, aux = torch.randint(0, V, (7,)), torch.randn(7, 3 * H)
    nxt, logits = run_drafter(drafter, ids, aux)
    ref_h, ref_logits = eagle3_dense(w, target.embed_tokens.weight, ids, aux, torch.arange(7))
    torch.testing.assert_close(nxt, ref_h, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    # Later steps feed back the head's own [T, H] output, skipping fc.
    nxt2, logits2 = run_drafter(drafter, ids, nxt)
    torch.testing.assert_close(
        logits2, eagle3_dense(w, target.embed_tokens.weight, ids, nxt, torch.arange(7))[1], atol=ATOL, rtol=0
    )
    draft_ids = logits.argmax(-1)
    assert torch.equal(drafter.to_target_ids(draft_ids), kept[draft_ids])
    probs = drafter.draft_probs_to_target(logits.softmax(-1), V)
    assert probs.shape == (7, V) and torch.allclose(probs.sum(-1), torch.ones(7))
    assert probs[:, ~w["t2d"]].eq(0).all()


def mtp_state(gen, layer, with_head=True):
    p = f"model.layers.{layer}."
    w = dense_ref.random_layer(p, H, INTER, HEADS, KV, HD, gen=gen)
    w[p + "enorm.weight"] = 1 + torch.randn(H, generator=gen) * 0.1
    w[p + "hnorm.weight"] = 1 + torch.randn(H, generator=gen) * 0.1
    w[p + "eh_proj.weight"] = torch.randn(H, 2 * H, generator=gen) * 0.08
    w[p + "shared_head.norm.weight"] = 1 + torch.randn(H, generator=gen) * 0.1
    if with_head:
        w[p + "shared_head.head.weight"] = torch.randn(V, H, generator=gen) * 0.1
    return w


@pytest.mark.parametrize("with_head", [True, False])
def test_mtp_layer_in_target_checkpoint(tmp_path, with_head):
    hf = tiny_hf_model("llama")
    hf.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    state = load_file(tmp_path / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    w = mtp_state(gen, layer=3, with_head=with_head)
    state.update(w)
    save_file(state, tmp_path / "model.safetensors")
    cfg = json.loads((tmp_path / "config.json").read_text()) | {"num_nextn_predict_layers": 1}
    (tmp_path / "config.json").write_text(json.dumps(cfg))

    target = CausalLM.from_pretrained(str(tmp_path))  # the extra layer is not the target's
    drafter = load_drafter(str(tmp_path), target)
    assert drafter.kind == "mtp" and drafter.num_kv_layers == 1
    ids, hidden = torch.randint(0, V, (8,)), torch.randn(8, H)
    nxt, logits = run_drafter(drafter, ids, hidden)
    p = "model.layers.3."
    emb = target.embed_tokens.weight[ids]
    x = (
        torch.cat(
            [dense_ref.rms(emb, w[p + "enorm.weight"], 1e-5), dense_ref.rms(hidden, w[p + "hnorm.weight"], 1e-5)], -1
        )
        @ w[p + "eh_proj.weight"].t()
    )
    xin = dense_ref.rms(x, w[p + "input_layernorm.weight"], 1e-5)
    ref = dense_ref.layer(xin, x, w, p, CFG, torch.arange(8))
    head = w[p + "shared_head.head.weight"] if with_head else target.head_weight
    torch.testing.assert_close(nxt, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(
        logits, dense_ref.rms(ref, w[p + "shared_head.norm.weight"], 1e-5) @ head.t(), atol=ATOL, rtol=0
    )


@pytest.mark.parametrize("source", ["checkpoint", "hf_object"])
def test_independent_draft_model(tmp_path, target, source):
    small = tiny_hf_model("llama", seed=5, num_hidden_layers=1)
    if source == "checkpoint":
        small.save_pretrained(tmp_path)
        src = str(tmp_path)
    else:
        src = small
    drafter = load_drafter(src, target)
    assert drafter.kind == "draft_model" and drafter.target_hidden == "none"
    ids = torch.randint(0, V, (11,))
    _, logits = run_drafter(drafter, ids, None)
    with torch.no_grad():
        torch.testing.assert_close(logits, small(ids[None]).logits[0], atol=ATOL, rtol=0)


def test_truncated_draft_model_shares_target_weights(target):
    drafter = truncated_draft_model(target, 1)
    assert drafter.cfg.num_layers == 1
    assert drafter.model.layers[0] is target.layers[0] and drafter.model.head_weight is target.head_weight
    ids = torch.randint(0, V, (5,))
    _, logits = run_drafter(drafter, ids, None)
    assert logits.shape == (5, V) and torch.isfinite(logits).all()


def test_mismatched_pairs_are_refused(tmp_path, target):
    gen = torch.Generator().manual_seed(4)
    w = eagle_state(gen)
    bad = dict(w, **{"fc.weight": torch.randn(H, 2 * H + 8)})
    with pytest.raises(ValueError, match=r"fc.weight shape is \[64, 136\] in the drafter but \[64, 128\]"):
        load_drafter(write_ckpt(tmp_path / "a", HEAD_CONFIG, bad), target)
    with pytest.raises(ValueError, match="hidden_size is 32 in the drafter but 64 in the target"):
        load_drafter(write_ckpt(tmp_path / "b", HEAD_CONFIG | {"hidden_size": 32}, w), target, kind="eagle")
    with pytest.raises(ValueError, match="vocab_size is 50 in the drafter but 96 in the target"):
        load_drafter(tiny_hf_model("llama", vocab_size=50, num_hidden_layers=1), target)
    w3, _ = eagle3_state(gen)
    with pytest.raises(ValueError, match=r"fc input features \(3 x target hidden\) is 192 in the drafter but 96"):
        small_target = CausalLM.from_hf(tiny_hf_model("llama", hidden_size=32, intermediate_size=48))
        load_drafter(module_from_state(w3), small_target, kind="eagle3")
    w3b = dict(w3, d2t=w3["d2t"] + 200)
    with pytest.raises(ValueError, match="largest target id reached through d2t is .* vocab_size=96"):
        load_drafter(module_from_state(w3b), target, kind="eagle3")
    wm = mtp_state(gen, 3)
    wm["model.layers.3.shared_head.head.weight"] = torch.randn(V + 4, H)
    with pytest.raises(ValueError, match=r"head layout\) is \[100, 64\] in the drafter but \[96, 64\]"):
        load_drafter(module_from_state(wm), target, kind="mtp")
    wq = eagle_state(gen)
    wq["layers.0.self_attn.k_proj.weight"] = torch.randn(HEADS * HD, H)  # 4 KV heads, config says 2
    with pytest.raises(ValueError, match=r"layers.0.attn.qkv.weight has shape \[160, 64\].*implies \[128, 64\]"):
        load_drafter(module_from_state(wq), target, kind="eagle")
    with pytest.raises(ValueError, match="drafter kind 'medusa' is unknown"):
        load_drafter(module_from_state(w), target, kind="medusa")
