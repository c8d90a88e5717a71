"""Drafters tested where they are accepted: each head is built from the acceptance target's own layers
(models/builtin.py: acceptance_pair, upper residual branches scaled, so the target's first layer alone
predicts the target's next token most of the time), and must then

- propose what an independent reference computes from the published formula with the same weights (written here
  over tests/dense_ref.py, sharing no code with draftgraph.models), and
- be accepted in the engine: mean accepted length at K = 3 well above a random head's (~0), with greedy tokens
  equal to the target's own.

A head wired wrong (a swapped projection, a wrong hidden input) fails both. Mode NONE on the CPU, float32: what
is under test is the head, not compiling (tests/test_piecewise.py and tests/test_draft_loop.py compile these
drafter kinds)."""

import copy
from dataclasses import replace

import pytest
import torch
import transformers

import draftgraph as dg
from draftgraph.models.builtin import TINY_ACCEPTANCE, acceptance_pair, module_from_state_dict
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.drafters import load_drafter
from tests import dense_ref
from tests.helpers import PagedRunner

K = 3
ATOL = 1e-4
# One full-strength layer, three scaled to 0.05: a one-layer head copied from layer 0 agrees with the target (the
# one-layer truncated draft model: 2.56 accepted of K = 3).
SPEC = replace(TINY_ACCEPTANCE, draft_layers=1, late_scale=0.05)


@pytest.fixture(scope="module")
def pair():
    hf, target, _ = acceptance_pair(SPEC, dtype=torch.float32)
    return hf, target


def layer0(hf, prefix: str) -> dict:
    """The target's layer 0 under upstream key names, at `prefix` (independent copies)."""
    return {prefix + k: v.detach().clone() for k, v in hf.model.layers[0].state_dict().items()}


def ref_cfg(hf) -> dict:
    c = hf.config
    theta = (getattr(c, "rope_parameters", None) or {}).get("rope_theta", getattr(c, "rope_theta", 10000.0))
    return {"heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "theta": theta, "eps": c.rms_norm_eps}  # fmt: skip


def embedding_rms(hf) -> float:
    return hf.model.embed_tokens.weight.pow(2).mean(-1).sqrt().mean().item()


PARAMS = dg.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
CONFIG = dg.CompileConfig(mode="NONE", num_speculative_tokens=K, max_num_seqs=4, progress=False)


@pytest.fixture(scope="module")
def alone(pair):
    """The target's own greedy tokens on prompts() (no drafter), shared by every drafter's test."""
    engine = dg.compile_model(pair[1], None, replace(CONFIG, num_speculative_tokens=0))
    return [o.token_ids for o in engine.generate(prompts(), PARAMS)]


def mean_accepted(target, drafter, prompts):
    """(mean accepted drafts per verify step, the speculative tokens) on `prompts`."""
    engine = dg.compile_model(target, drafter, CONFIG)
    got = [o.token_ids for o in engine.generate(prompts, PARAMS)]
    s = engine.stats()
    return s["accepted_tokens"] / s["verify_steps"], got


def prompts(n=4, length=12):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, SPEC.vocab_size, (n, length), generator=g).tolist()


def run_head(drafter, ids, hidden):
    runner = PagedRunner(drafter.cfg, num_layers=drafter.num_kv_layers)
    meta, pos = runner.batch([(0, ids.shape[0])])
    with torch.no_grad():
        nxt, lh = drafter(ids, pos, hidden, meta, runner.cache.layers)
        return nxt, drafter.compute_logits(lh)


# ---- MTP (DeepSeek-V3's layout on a Llama target) -------------------------------------------------------------


def mtp_from_target(hf, gen):
    """An MTP layer copying the target's layer 0: enorm scales the next token's embedding back to its own size
    (the layer then sees what the target's layer 0 sees), eh_proj passes that half on plus a small random share
    of the normed hidden state (so a head reading the wrong half, or the wrong hidden, is seen)."""
    h, n = SPEC.hidden_size, SPEC.num_layers
    p = f"model.layers.{n}."
    w = layer0(hf, p)
    w[p + "enorm.weight"] = torch.full((h,), embedding_rms(hf))
    w[p + "hnorm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    share = 0.02 * embedding_rms(hf) / h**0.5  # the hidden half adds ~2% of the embedding's size
    w[p + "eh_proj.weight"] = torch.cat([torch.eye(h), share * torch.randn(h, h, generator=gen)], dim=1)
    w[p + "shared_head.norm.weight"] = hf.model.norm.weight.detach().clone()
    return w, p


def mtp_reference(w, p, cfg, embed, head, ids, hidden):
    """DeepSeek-V3 MTP: h' = M [RMSNorm(Emb(t_{i+1})); RMSNorm(h_i)], one decoder layer, then the shared head
    OutHead(RMSNorm(.)). Returns (the layer's output, logits)."""
    e = dense_ref.rms(embed[ids], w[p + "enorm.weight"], cfg["eps"])
    h = dense_ref.rms(hidden, w[p + "hnorm.weight"], cfg["eps"])
    x = torch.cat([e, h], -1) @ w[p + "eh_proj.weight"].t()
    xin = dense_ref.rms(x, w[p + "input_layernorm.weight"], cfg["eps"])
    out = dense_ref.layer(xin, x, w, p, cfg, torch.arange(ids.shape[0]))
    return out, dense_ref.rms(out, w[p + "shared_head.norm.weight"], cfg["eps"]) @ head.t()


def test_mtp_head_from_the_target_is_accepted_and_matches_the_formula(pair, alone):
    hf, target = pair
    w, p = mtp_from_target(hf, torch.Generator().manual_seed(1))
    drafter = load_drafter(module_from_state_dict(w), target, kind="mtp")
    assert drafter.kind == "mtp"
    g = torch.Generator().manual_seed(2)
    ids, hidden = torch.randint(0, SPEC.vocab_size, (9,), generator=g), torch.randn(9, SPEC.hidden_size, generator=g)
    nxt, logits = run_head(drafter, ids, hidden)
    embed, head = hf.model.embed_tokens.weight.detach(), hf.lm_head.weight.detach()
    ref_out, ref_logits = mtp_reference(w, p, ref_cfg(hf), embed, head, ids, hidden)
    torch.testing.assert_close(nxt, ref_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    acc, got = mean_accepted(target, drafter, prompts())
    assert got == alone  # lossless
    # Measured 1.77 of K = 3 (the truncated one-layer draft model: 2.56; enorm only approximates the raw embedding
    # the target's layer 0 sees); a random MTP head accepts ~0 (0.02 here with a hidden share 50x larger; 1 in 44
    # in tests/test_qwen3_5.py), and one wired wrong is back near 0.
    assert acc >= 1.5, acc


# ---- the draft model (an independent transformers model of the target's first layer) --------------------------


def test_draft_model_of_the_first_layer_is_accepted_and_matches_the_formula(pair, alone):
    hf, target = pair
    cfg = copy.deepcopy(hf.config)
    cfg.num_hidden_layers = 1
    small = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    small.load_state_dict(hf.state_dict(), strict=False)  # the upper layers' keys are unexpected
    drafter = load_drafter(small, target, kind="draft_model")
    assert drafter.kind == "draft_model"
    ids = torch.randint(0, SPEC.vocab_size, (9,), generator=torch.Generator().manual_seed(2))
    nxt, logits = run_head(drafter, ids, None)
    # A causal LM: RMSNorm, one decoder layer, the final norm, the LM head
    w, c, e = layer0(hf, "l."), ref_cfg(hf), hf.model.embed_tokens.weight.detach()[ids]
    out = dense_ref.layer(dense_ref.rms(e, w["l.input_layernorm.weight"], c["eps"]), e, w, "l.", c, torch.arange(9))
    ref = dense_ref.rms(out, hf.model.norm.weight.detach(), c["eps"]) @ hf.lm_head.weight.detach().t()
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    acc, got = mean_accepted(target, drafter, prompts())
    assert got == alone  # lossless
    # Measured 2.56 of K = 3 (module docstring)
    assert acc >= 2.2, acc


# ---- EAGLE (EAGLE-1/2 layout on the Llama target) ----------------------------------------------------------------


def eagle_from_target(hf, gen):
    """An EAGLE head copying the target's layer 0: fc passes the next token's embedding on (plus a small random
    share of the target's hidden state and a small bias, so a swapped concat or a lost bias is seen); EAGLE's layer
    0 has no input norm, so the input norm (a division by the embedding's RMS, times its weight) is folded into
    q, k and v; no final norm (argmax-invariant here: the target's final norm weight is all ones)."""
    h, rms = SPEC.hidden_size, embedding_rms(hf)
    w = {k: v for k, v in layer0(hf, "layers.0.").items() if "input_layernorm" not in k}
    fold = hf.model.layers[0].input_layernorm.weight.detach() / rms
    for name in ("q_proj", "k_proj", "v_proj"):
        w[f"layers.0.self_attn.{name}.weight"] = w[f"layers.0.self_attn.{name}.weight"] * fold
    w["fc.weight"] = torch.cat([torch.eye(h), 0.02 * rms / h**0.5 * torch.randn(h, h, generator=gen)], dim=1)
    w["fc.bias"] = 0.01 * rms * torch.randn(h, generator=gen)
    return w


def eagle_reference(w, cfg, embed, head, ids, hidden):
    """EAGLE: x = fc([Emb(t_{i+1}); f_i]) (with bias), one decoder layer whose attention reads x unnormed, then the
    target's LM head on its output. Returns (the layer's output, logits)."""
    x = torch.cat([embed[ids], hidden], -1) @ w["fc.weight"].t() + w["fc.bias"]
    out = dense_ref.layer(x, x, w, "layers.0.", cfg, torch.arange(ids.shape[0]))
    return out, out @ head.t()


def test_eagle_head_from_the_target_is_accepted_and_matches_the_formula(pair, alone):
    hf, target = pair
    w = eagle_from_target(hf, torch.Generator().manual_seed(1))
    drafter = load_drafter(module_from_state_dict(w), target, kind="eagle")
    assert drafter.kind == "eagle" and drafter.target_hidden == "final"
    g = torch.Generator().manual_seed(2)
    ids, hidden = torch.randint(0, SPEC.vocab_size, (9,), generator=g), torch.randn(9, SPEC.hidden_size, generator=g)
    nxt, logits = run_head(drafter, ids, hidden)
    embed, head = hf.model.embed_tokens.weight.detach(), hf.lm_head.weight.detach()
    ref_out, ref_logits = eagle_reference(w, ref_cfg(hf), embed, head, ids, hidden)
    torch.testing.assert_close(nxt, ref_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    acc, got = mean_accepted(target, drafter, prompts())
    assert got == alone  # lossless
    # Measured 1.70 of K = 3 (the MTP head above: 1.77); a random head accepts ~0
    assert acc >= 1.4, acc


# ---- EAGLE-3 (its reduced-vocabulary layout on a near-bigram Llama target) ---------------------------------------
# EAGLE-3's layer adds its attention to the fused target hidden state (of the previous position), not to the next
# token's embedding, so it cannot copy a layer whose attention reads context. Its target here has layer 0's
# attention branch scaled down too (0.02, like the upper layers): the next token is then mostly layer 0's MLP of
# the current token's embedding, and the head recovers that embedding through attention focused on its own row.
# Its later draft steps add their own previous output to that residual (as published), which this untrained copy
# cannot undo: the first draft agrees most often (measured 41 of 59 steps), later ones less.
SPEC3 = replace(SPEC, num_kv_heads=2, late_scale=0.02)  # 2 x 64 value dims: the own-row copy keeps all 128 dims
FOCUS = 1.5  # q = k = FOCUS x the normed embedding: own row ~8 FOCUS^2 = 18 above the rest (~FOCUS^2 spread)


@pytest.fixture(scope="module")
def pair3():
    hf, target, _ = acceptance_pair(SPEC3, dtype=torch.float32)
    with torch.no_grad():
        hf.model.layers[0].self_attn.o_proj.weight.mul_(SPEC3.late_scale)
    return hf, CausalLM.from_hf(hf)


@pytest.fixture(scope="module")
def alone3(pair3):
    engine = dg.compile_model(pair3[1], None, replace(CONFIG, num_speculative_tokens=0))
    return [o.token_ids for o in engine.generate(prompts(), PARAMS)]


def eagle3_from_target(hf, gen):
    """An EAGLE-3 head reproducing the target's layer 0 on the next token: attention copies the token's embedding
    from its own row (q = k = FOCUS x its normed embedding, v its normed embedding, o the embedding's RMS), the MLP,
    its norms, the final norm and LM head are the target's; fc gives a small random share of the three target
    layers (so it is seen), and the draft vocabulary is the target's in a random order (through d2t)."""
    h, rms, p = SPEC3.hidden_size, embedding_rms(hf), "midlayer."
    w = {k: v for k, v in layer0(hf, p).items() if not k.startswith(p + "self_attn.")}

    def small(*shape):
        return 0.01 * torch.randn(*shape, generator=gen)

    for name, scale in (("q_proj", FOCUS), ("k_proj", FOCUS), ("v_proj", 1.0)):
        w[f"{p}self_attn.{name}.weight"] = torch.cat([scale * torch.eye(h), small(h, h)], dim=1)  # [emb; hidden]
    w[p + "self_attn.o_proj.weight"] = rms * torch.eye(h)
    w[p + "input_layernorm.weight"] = torch.ones(h)
    w[p + "hidden_norm.weight"] = 1 + 0.1 * torch.randn(h, generator=gen)
    w["fc.weight"] = 0.02 * rms / (3 * h) ** 0.5 * torch.randn(h, 3 * h, generator=gen)  # aux RMS ~1 or less
    w["norm.weight"] = hf.model.norm.weight.detach().clone()
    perm = torch.randperm(SPEC3.vocab_size, generator=gen)  # draft id i is target id perm[i]
    w["lm_head.weight"] = hf.lm_head.weight.detach()[perm].clone()
    w["d2t"] = perm - torch.arange(SPEC3.vocab_size)
    w["t2d"] = torch.ones(SPEC3.vocab_size, dtype=torch.bool)
    return w, perm


def eagle3_reference(w, cfg, embed, ids, aux):
    """EAGLE-3: g = fc([l_low; l_mid; l_high]) (three target layers' outputs), then one decoder layer whose attention
    reads [RMSNorm(Emb(t_{i+1})); RMSNorm(g)] (2H wide) and whose residual is g, its own final RMSNorm and LM head
    over the draft vocabulary. Returns (the layer's output, draft logits)."""
    p, eps = "midlayer.", cfg["eps"]
    g = aux @ w["fc.weight"].t()
    x = torch.cat([dense_ref.rms(embed[ids], w[p + "input_layernorm.weight"], eps),
                   dense_ref.rms(g, w[p + "hidden_norm.weight"], eps)], -1)  # fmt: skip
    out = dense_ref.layer(x, g, w, p, cfg, torch.arange(ids.shape[0]))
    return out, dense_ref.rms(out, w["norm.weight"], eps) @ w["lm_head.weight"].t()


def test_eagle3_head_is_accepted_and_matches_the_formula(pair3, alone3):
    hf, target = pair3
    w, perm = eagle3_from_target(hf, torch.Generator().manual_seed(1))
    drafter = load_drafter(module_from_state_dict(w), target, kind="eagle3")
    n = SPEC3.num_layers
    assert drafter.kind == "eagle3" and drafter.target_hidden == "aux"
    assert drafter.aux_layers == (1, n // 2 - 1, max(n - 4, 0))  # EAGLE-3's low, middle and high layers
    g = torch.Generator().manual_seed(2)
    ids, aux = torch.randint(0, SPEC3.vocab_size, (9,), generator=g), torch.randn(9, 3 * SPEC3.hidden_size, generator=g)
    nxt, logits = run_head(drafter, ids, aux)
    ref_out, ref_logits = eagle3_reference(w, ref_cfg(hf), hf.model.embed_tokens.weight.detach(), ids, aux)
    torch.testing.assert_close(nxt, ref_out, atol=ATOL, rtol=0)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=0)
    draft_ids = logits.argmax(-1)
    assert drafter.to_target_ids(draft_ids).tolist() == perm[draft_ids].tolist()  # through d2t
    acc, got = mean_accepted(target, drafter, prompts())
    assert got == alone3  # lossless
    # Measured 1.17 of K = 3 (histogram [18, 27, 0, 14]; 0.57 with the scales at 0.05); a random head accepts ~0
    assert acc >= 0.9, acc
