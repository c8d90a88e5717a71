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

from dataclasses import replace

import pytest
import torch

import draftgraph as dg
from draftgraph.models.builtin import TINY_ACCEPTANCE, acceptance_pair, module_from_state_dict
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


def mean_accepted(target, drafter, prompts):
    """(mean accepted drafts per verify step, the speculative tokens, the target-alone tokens)."""
    params = dg.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    cfg = dg.CompileConfig(mode="NONE", num_speculative_tokens=K, max_num_seqs=4, progress=False)
    runs = []
    for d, k in ((drafter, K), (None, 0)):
        engine = dg.compile_model(target, d, replace(cfg, num_speculative_tokens=k))
        runs.append(([o.token_ids for o in engine.generate(prompts, params)], engine.stats()))
    (got, s), (want, _) = runs
    return s["accepted_tokens"] / s["verify_steps"], got, want


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


def test_mtp_head_from_the_target_is_accepted_and_matches_the_formula(pair):
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
    acc, got, want = mean_accepted(target, drafter, prompts())
    assert got == want  # lossless
    # Measured 1.77 of K = 3 (the truncated one-layer draft model: 2.56; enorm only approximates the raw embedding
    # the target's layer 0 sees); a random MTP head accepts ~0 (0.02 here with a hidden share 50x larger; 1 in 44
    # in tests/test_qwen3_5.py), and one wired wrong is back near 0.
    assert acc >= 1.5, acc
