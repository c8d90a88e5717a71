"""Pinned acceptance (CompileConfig.synthetic_acceptance, benchmarks only): the accept decision is drawn with the
given conditional rates, on the device, in the same step code as real acceptance. The measured mean acceptance
length matches 1 + sum_i prod_{j<=i} rate_j; accepted rows emit the drafts and the next row the target's token;
NONE and FULL_AND_PIECEWISE (the one-graph step's code, CPU: eager backend, no graphs) draw the same decisions;
sampled requests are refused, the build warns, and stats() carries the label."""

import logging
from dataclasses import replace

import pytest
import torch

import draftgraph as dg
from draftgraph.compiler.config import expected_acceptance_length
from draftgraph.models.causal_lm import CausalLM
from draftgraph.runtime.rejection import rejection_sample, synthetic_accept
from draftgraph.runtime.sampler import SamplingTensors
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model

K = 3
# vLLM's per-position acceptance for EAGLE-3 on MT-Bench (0.730, 0.521, 0.355) as conditional rates
RATES = (0.730, 0.521 / 0.730, 0.355 / 0.521)
CONFIG = dg.CompileConfig(mode="NONE", num_speculative_tokens=K, max_num_seqs=8, max_num_batched_tokens=64,
                          compile_backend="eager", progress=False, synthetic_acceptance=RATES)  # fmt: skip
GREEDY = dg.SamplingParams(max_tokens=180, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pair():
    target = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96))
    return target, make_drafter("eagle3", target)


def prompts(n=8):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 96, (n, 6), generator=g).tolist()


def test_formula_and_the_emitted_tokens_row_by_row():
    """Many independent rows of one verify: P(draft i accepted) = prod_{j<=i} rate_j (each within 4 sigma), and
    each row emits its drafts up to the first rejection, then the target's token of that row."""
    n = 40_000
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(n, K + 1, 96, generator=g)
    drafts = torch.randint(0, 96, (n, K), generator=g)
    positions = torch.randint(0, 4000, (n, 1), generator=g) + torch.arange(K + 1)
    greedy = SamplingTensors(*(torch.zeros(n),) * 4, greedy_rows=(True,) * n)
    tokens, accepted = rejection_sample(logits, drafts, None, greedy, positions, False, RATES)
    expected = torch.tensor(RATES).cumprod(0)
    for i in range(K):
        freq = (accepted > i).double().mean().item()
        sigma = (expected[i] * (1 - expected[i]) / n) ** 0.5
        assert abs(freq - expected[i]) < 4 * sigma, (i, freq, expected[i])
    assert abs(1 + accepted.double().mean().item() - expected_acceptance_length(RATES)) < 0.03
    argmax = logits.argmax(-1)
    for row in range(200):
        a = int(accepted[row])
        assert tokens[row, :a].tolist() == drafts[row, :a].tolist() and int(tokens[row, a]) == int(argmax[row, a])
    # Fewer rates than K: positions past them are never accepted; rate 1 always, rate 0 never
    _, acc = synthetic_accept(argmax, drafts, positions, (1.0,))
    assert acc.eq(1).all()
    _, acc = synthetic_accept(argmax, drafts, positions, (1.0, 0.0, 1.0))
    assert acc.eq(1).all()


def run(target, drafter, config):
    eng = dg.compile_model(target, drafter, config)
    outs = [o.token_ids for o in eng.generate(prompts(), GREEDY)]
    return eng, outs


def test_engine_mean_length_modes_label_and_refusal(pair, caplog):
    target, drafter = pair
    with caplog.at_level(logging.WARNING, logger="draftgraph"):
        none, toks = run(target, drafter, CONFIG)
    assert any("PINNED ACCEPTANCE" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)
    s = none.stats()
    assert s["synthetic_acceptance"] == list(RATES)
    # ~8 x 180 / 2.6 = 550 verify rows: the standard error of the mean length is ~0.05
    assert s["verify_steps"] > 400
    assert abs(s["mean_accepted_length"] - expected_acceptance_length(RATES)) < 0.15, s["mean_accepted_length"]
    hist = torch.tensor(s["acceptance_histogram"], dtype=torch.float64)
    reach = torch.cat([torch.ones(1), torch.tensor(RATES).cumprod(0), torch.zeros(1)]).double()  # P(>= i accepted)
    assert torch.allclose(hist / hist.sum(), reach[:-1] - reach[1:], atol=0.06), hist  # 0.27, 0.21, 0.17, 0.355

    full, toks_full = run(target, drafter, replace(CONFIG, mode="FULL_AND_PIECEWISE"))
    assert toks_full == toks and full.stats()["accepted_tokens"] == s["accepted_tokens"]
    assert full.stats()["dispatch"].get("step/none", 0) > 0  # uniform batches ran the one-graph step's code

    with pytest.raises(ValueError, match="temperature=0.7: this engine pins acceptance"):
        none.add_request([1, 2, 3], dg.SamplingParams(max_tokens=4, temperature=0.7))
    real = dg.compile_model(target, drafter, replace(CONFIG, synthetic_acceptance=()))
    real.generate(prompts(2), replace(GREEDY, max_tokens=8))
    assert real.stats()["synthetic_acceptance"] is None


def test_rates_are_validated(pair):
    target, drafter = pair
    with pytest.raises(ValueError, match=r"rates \[1.2\] lie outside \[0, 1\]"):
        dg.CompileConfig(synthetic_acceptance=(0.5, 1.2))
    with pytest.raises(TypeError, match="must be a tuple of conditional acceptance rates"):
        dg.CompileConfig(synthetic_acceptance=[0.5])
    with pytest.raises(ValueError, match="has 4 rates but K .* is 3; give at most 3 rates"):
        dg.compile_model(target, drafter, replace(CONFIG, synthetic_acceptance=(0.5,) * 4))
    with pytest.raises(ValueError, match="is 0; give at most 0 rates .*, and a drafter"):
        dg.compile_model(target, None, CONFIG)
