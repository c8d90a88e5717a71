"""Sampling: the processed distributions, the hashed noise, and speculative sampling preserving the
target's distribution (chi-square against exact marginals computed with transformers)."""

import itertools

import pytest
import torch
from scipy.stats import chisquare

import draftgraph as dg
from draftgraph.models.drafters import truncated_draft_model
from draftgraph.models.llama import CausalLM
from draftgraph.runtime.rejection import rejection_sample
from draftgraph.runtime.sampler import SamplingTensors, probabilities, sample_from_probs, uniform_noise
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model


def chi_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of observed counts against a distribution (expected counts renormalized to the total)."""
    counts = counts.double()
    probs = probs.double() / probs.double().sum()
    return chisquare(counts.numpy(), (probs * counts.sum()).numpy()).pvalue


def st_for(temps, top_k=0, top_p=1.0, seeds=None):
    n = len(temps)
    return SamplingTensors(
        torch.tensor(temps, dtype=torch.float32),
        torch.full((n,), top_k),
        torch.full((n,), top_p),
        torch.tensor(seeds or list(range(n))),
        tuple(t <= 0 for t in temps),
    )


def test_probabilities_temperature_top_k_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    p = probabilities(logits, st_for([0.5]))
    torch.testing.assert_close(p, (logits / 0.5).softmax(-1))
    pk = probabilities(logits, st_for([1.0], top_k=2))
    torch.testing.assert_close(pk[0, :2], logits[0, :2].softmax(-1))
    assert pk[0, 2:].eq(0).all()
    full = logits.softmax(-1)[0]  # [0.61, 0.22, 0.14, ...]: the smallest prefix reaching 0.8 has 2 tokens
    pp = probabilities(logits, st_for([1.0], top_p=0.8))
    torch.testing.assert_close(pp[0, :2], full[:2] / full[:2].sum())
    assert pp[0, 2:].eq(0).all()
    assert probabilities(logits, st_for([0.0]))[0].tolist() == [1.0, 0, 0, 0, 0]


def test_noise_is_uniform_and_keyed_by_seed_and_position():
    n = 200_000
    u = uniform_noise(torch.arange(n) % 97, torch.arange(n) // 97, salt=1)
    assert u.min() > 0 and u.max() < 1
    counts = torch.histc(u, bins=20, min=0, max=1)
    assert chisquare(counts.numpy()).pvalue > 1e-3
    a = uniform_noise(torch.tensor([5, 5, 6]), torch.tensor([10, 11, 10]), salt=1)
    b = uniform_noise(torch.tensor([6, 5]), torch.tensor([10, 10]), salt=1)  # another batch, same keys
    assert a[0] == b[1] and a[2] == b[0] and len(set(a.tolist())) == 3
    assert uniform_noise(torch.tensor([5]), torch.tensor([10]), salt=2) != a[0]


def test_exponential_race_draws_from_p():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 100_000
    draws = sample_from_probs(p.expand(n, 4), torch.arange(n), torch.zeros(n, dtype=torch.long), salt=3)
    counts = torch.bincount(draws, minlength=4).double()
    assert chi_p(counts, p) > 1e-3


def test_rejection_sampler_unit_distribution():
    """One verify step with fixed p and q, many seeds: the emitted first token is distributed as p."""
    n, vocab = 60_000, 6
    g = torch.Generator().manual_seed(0)
    target_logits = torch.randn(1, 3, vocab, generator=g).expand(n, 3, vocab)
    q = torch.randn(2, vocab, generator=g).softmax(-1)
    st = st_for([1.0] * n, seeds=list(range(n)))
    drafts = torch.stack(
        [sample_from_probs(q[i].expand(n, vocab), st.seeds, torch.full((n,), i), 9) for i in range(2)], 1
    )
    pos = torch.arange(1, 4).expand(n, 3)
    tokens, accepted = rejection_sample(target_logits, drafts, q.expand(n, 2, vocab), st, pos)
    first = tokens[:, 0]
    p0 = target_logits[0, 0].softmax(-1).double()
    counts = torch.bincount(first, minlength=vocab).double()
    assert chi_p(counts, p0) > 1e-3
    assert 0 < accepted.float().mean() < 2


@pytest.mark.parametrize("kind", ["draft_model", "eagle"])
def test_speculative_sampling_preserves_the_target_distribution(kind):
    """Tokens 2 and 3 come from the first verify step (K = 2); their frequencies over 8000 seeded requests
    must match the exact marginals, and the same counts must reject a marginal shifted by 2 %."""
    vocab = 16
    hf = tiny_hf_model("llama", vocab_size=vocab)
    target = CausalLM.from_hf(hf)
    prompt = [3, 1, 4, 1, 5]
    n = 8000
    cfg = dg.CompileConfig(num_speculative_tokens=2, max_num_seqs=256, max_num_batched_tokens=2048)
    drafter = truncated_draft_model(target, 1) if kind == "draft_model" else make_drafter(kind, target)
    eng = dg.compile_model(target, drafter, cfg)
    params = [dg.SamplingParams(max_tokens=3, temperature=1.0, seed=i, ignore_eos=True) for i in range(n)]
    outs = eng.generate([prompt] * n, params)
    assert 0.1 < eng.stats()["acceptance_rate"] < 0.95  # drafts were accepted and rejected
    samples = torch.tensor([o.token_ids for o in outs])  # [n, 3]

    with torch.no_grad():  # exact marginals of tokens 2 and 3 by enumerating tokens 1 and 2
        ctx = torch.tensor([prompt + list(t) for t in itertools.product(range(vocab), repeat=2)])
        probs = hf(ctx).logits.double().softmax(-1)  # [V*V, 7, V]
        p1 = probs[0, len(prompt) - 1]  # [V]
        p2_given_1 = probs[::vocab, len(prompt)]  # row t1*V: context prompt + [t1]
        p3_given_12 = probs[:, len(prompt) + 1].view(vocab, vocab, vocab)
    marg2 = p1 @ p2_given_1
    marg3 = torch.einsum("a,ab,abc->c", p1, p2_given_1, p3_given_12)
    for col, marg in ((1, marg2), (2, marg3)):
        counts = torch.bincount(samples[:, col], minlength=vocab)
        assert chi_p(counts, marg) > 1e-3
        shifted = marg.clone()  # move 2 % of the mass from the likeliest token to the least likely one
        shifted[marg.argmax()] -= 0.02
        shifted[marg.argmin()] += 0.02
        assert chi_p(counts, shifted) < 1e-3
