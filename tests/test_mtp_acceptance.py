"""MTP heads on their own families' targets, tested where they are accepted (as tests/test_drafter_acceptance.py
does for the Llama family): DeepSeek-V3's MTP layer (MLA + MoE, the target's layer shape) and Qwen3.5's MTP head
(a gated full-attention layer, zero-centred norms).

Each target is nearly one of its layers (every other layer's residual branches scaled by LATE), and the head copies
that layer; each head must then
- propose what the published formula computes with the same weights: written here, with the decoder layer run by
  transformers' own module of the target (the layer the head copies), sharing no code with draftgraph.models;
- be accepted: mean accepted length at K = 3 far above a random head's (~0: 1 in 44 proposals in
  tests/test_qwen3_5.py), with greedy tokens equal to the target's own.
Mode NONE on the CPU, float32."""

from dataclasses import replace

import torch

import draftgraph as dg
from draftgraph.models.builtin import module_from_state_dict
from draftgraph.models.builtin_qwen3_5 import builtin_qwen3_5_hf
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.drafters import load_drafter
from tests import dense_ref
from tests.helpers import tiny_deepseek_model
from tests.test_drafter_acceptance import CONFIG, PARAMS, run_head

ATOL = 1e-4
LATE = 0.05


def scaled(hf, keep: int):
    """`hf` with every layer but `keep` scaled to LATE in its residual branches (attention / linear-attention output
    and MLP / expert down projections)."""
    with torch.no_grad():
        for i, layer in enumerate(hf.model.layers):
            if i != keep:
                ends = ("o_proj.weight", "out_proj.weight", "down_proj.weight", "down_proj")  # down_proj: fused experts
                names = [n for n, _ in layer.named_parameters() if n.endswith(ends)]
                assert any("down_proj" in n for n in names) and any("o_proj" in n or "out_proj" in n for n in names)
                for n in names:
                    layer.get_parameter(n).mul_(LATE)
    return hf


def embedding_rms(hf) -> float:
    return hf.model.embed_tokens.weight.pow(2).mean(-1).sqrt().mean().item()


def alone_and_prompts(target, vocab):
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab, (4, 12), generator=g).tolist()
    engine = dg.compile_model(target, None, replace(CONFIG, num_speculative_tokens=0))
    return prompts, [o.token_ids for o in engine.generate(prompts, PARAMS)]


def accepted(target, drafter, prompts):
    engine = dg.compile_model(target, drafter, CONFIG)
    got = [o.token_ids for o in engine.generate(prompts, PARAMS)]
    s = engine.stats()
    return s["accepted_tokens"] / s["verify_steps"], got, s["acceptance_histogram"]


def hf_layer(hf, i, x, pos):
    """transformers' own decoder layer `i` of `hf` over one sequence x [T, H] (causal, no cache)."""
    with torch.no_grad():
        x, pos = x[None], pos[None]
        out = hf.model.layers[i](x, position_embeddings=hf.model.rotary_emb(x, pos), position_ids=pos)
    return (out[0] if isinstance(out, tuple) else out)[0]


def inputs(vocab, hidden, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (9,), generator=g), torch.randn(9, hidden, generator=g)


# ---- DeepSeek-V3 MTP --------------------------------------------------------------------------------------------


def test_deepseek_mtp_layer_from_the_target_is_accepted_and_matches_the_formula():
    # Every layer a MoE layer (first_k_dense_replace=0), so the MTP layer (a MoE layer, past the dense ones) can copy
    # layer 0, which the target nearly is
    hf = scaled(tiny_deepseek_model(first_k_dense_replace=0), keep=0)
    target = CausalLM.from_hf(hf)
    h, n, rms, eps = hf.config.hidden_size, hf.config.num_hidden_layers, embedding_rms(hf), hf.config.rms_norm_eps
    gen, p = torch.Generator().manual_seed(1), f"model.layers.{n}."
    w = {p + k: v.detach().clone() for k, v in hf.model.layers[0].state_dict().items()}
    w[p + "enorm.weight"] = torch.full((h,), rms)  # the normed embedding back at its own size: what layer 0 sees
    w[p + "hnorm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    w[p + "eh_proj.weight"] = torch.cat([torch.eye(h), 0.02 * rms / h**0.5 * torch.randn(h, h, generator=gen)], 1)
    w[p + "shared_head.norm.weight"] = hf.model.norm.weight.detach().clone()
    drafter = load_drafter(module_from_state_dict(w), target, kind="mtp")
    assert drafter.kind == "mtp" and type(drafter.block.mlp).__name__ == "MoE"
    ids, hidden = inputs(hf.config.vocab_size, h)
    nxt, logits = run_head(drafter, ids, hidden)
    # h' = M [RMSNorm(Emb(t_{i+1})); RMSNorm(h_i)], one decoder layer (MLA + MoE), then OutHead(RMSNorm(.))
    e = dense_ref.rms(hf.model.embed_tokens.weight.detach()[ids], w[p + "enorm.weight"], eps)
    x = torch.cat([e, dense_ref.rms(hidden, w[p + "hnorm.weight"], eps)], -1) @ w[p + "eh_proj.weight"].t()
    ref = hf_layer(hf, 0, x, torch.arange(9))
    torch.testing.assert_close(nxt, ref, atol=ATOL, rtol=0)
    ref_logits = dense_ref.rms(ref, w[p + "shared_head.norm.weight"], eps) @ hf.lm_head.weight.detach().t()
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    prompts, alone = alone_and_prompts(target, hf.config.vocab_size)
    acc, got, hist = accepted(target, drafter, prompts)
    assert got == alone  # lossless
    # Measured 2.53 of K = 3 (histogram [2, 5, 1, 28]); a random head accepts ~0
    assert acc >= 1.9, (acc, hist)


# ---- Qwen3.5 MTP ------------------------------------------------------------------------------------------------


def zc_rms(x, w, eps):
    """Qwen3.5's zero-centred RMSNorm: the scale is 1 + w."""
    return dense_ref.rms(x, 1 + w, eps)


def test_qwen3_5_mtp_head_from_the_target_is_accepted_and_matches_the_formula():
    hf = builtin_qwen3_5_hf()
    full = hf.config.layer_types.index("full_attention")  # the one gated-attention layer: the head's shape
    hf = scaled(hf, keep=full)
    target = CausalLM.from_hf(hf)
    h, rms, eps = hf.config.hidden_size, embedding_rms(hf), hf.config.rms_norm_eps
    gen = torch.Generator().manual_seed(1)
    w = {"mtp.layers.0." + k: v.detach().clone() for k, v in hf.model.layers[full].state_dict().items()}
    w["mtp.pre_fc_norm_embedding.weight"] = torch.full((h,), rms - 1)  # zero-centred: scale rms
    w["mtp.pre_fc_norm_hidden.weight"] = 0.1 * torch.randn(h, generator=gen)
    w["mtp.fc.weight"] = torch.cat([torch.eye(h), 0.02 * rms / h**0.5 * torch.randn(h, h, generator=gen)], 1)
    w["mtp.norm.weight"] = hf.model.norm.weight.detach().clone()
    drafter = load_drafter(module_from_state_dict(w), target, kind="mtp")
    assert drafter.kind == "mtp" and type(drafter).__name__ == "Qwen3_5MTPDrafter"
    ids, hidden = inputs(hf.config.vocab_size, h)
    nxt, logits = run_head(drafter, ids, hidden)
    # x = fc([norm_e(Emb(t_{i+1})); norm_h(h_i)]), one full-attention decoder layer, its norm, the target's head
    e = zc_rms(hf.model.embed_tokens.weight.detach()[ids], w["mtp.pre_fc_norm_embedding.weight"], eps)
    x = torch.cat([e, zc_rms(hidden, w["mtp.pre_fc_norm_hidden.weight"], eps)], -1) @ w["mtp.fc.weight"].t()
    ref = zc_rms(hf_layer(hf, full, x, torch.arange(9)), w["mtp.norm.weight"], eps)
    torch.testing.assert_close(nxt, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits, ref @ hf.lm_head.weight.detach().t(), atol=ATOL, rtol=0)
    prompts, alone = alone_and_prompts(target, hf.config.vocab_size)
    acc, got, hist = accepted(target, drafter, prompts)
    assert got == alone  # lossless
    # Measured 2.36 of K = 3 (histogram [5, 3, 4, 27]); the random head of tests/test_qwen3_5.py: 1 in 44 proposals
    assert acc >= 1.9, (acc, hist)
