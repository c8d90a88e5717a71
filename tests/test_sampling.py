"""Sampling: the processed distributions, the hashed noise, and speculative sampling preserving the
target's distribution (chi-square against exact marginals computed with transformers).

The sort-free top-k / top-p is checked against `sorted_probabilities`, the former sort-based implementation
(with a stable sort, which fixes the order of equal logits to vocabulary order): the kept sets are equal
exactly on small vocabularies and probabilities agree to 1e-6; on 32k vocabularies (float32 mass sums over
thousands of tokens) a token may differ only where its exact mass-before lies within 1e-5 of top_p."""

import itertools

import pytest
import torch
from scipy.stats import chisquare

import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.drafters import truncated_draft_model
from draftgraph.ops.sampling.noise import uniform_noise
from draftgraph.ops.sampling.probs import _ordered_keys, _probabilities, _threshold_key
from draftgraph.runtime.rejection import rejection_sample
from draftgraph.runtime.sampler import SamplingTensors, probabilities, sample_from_probs
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


def test_noise_extremes_stay_inside_the_open_interval():
    """The largest and smallest hashes give uniforms strictly inside (0, 1) in float32: a uniform of 1.0 makes
    -log(u) a signed zero, whose sign torch and Triton's negation disagree on (the race would pick differently)."""
    from draftgraph.ops.sampling.noise import UNIFORM_SCALE, UNIFORM_SHIFT

    hashes = torch.tensor([0, (1 << UNIFORM_SHIFT) - 1, 0xFFFFFFFF, 0xFFFFFFFF - (1 << UNIFORM_SHIFT)])
    u = ((hashes >> UNIFORM_SHIFT).float() + 0.5) * UNIFORM_SCALE
    assert u.dtype == torch.float32 and bool((u > 0).all()) and bool((u < 1).all())
    assert bool((-torch.log(u) > 0).all())  # a strictly positive exponential: no signed zero to divide by


def test_exponential_race_draws_from_p():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 100_000
    draws = sample_from_probs(p.expand(n, 4), torch.arange(n), torch.zeros(n, dtype=torch.long), 3, True)
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
        [sample_from_probs(q[i].expand(n, vocab), st.seeds, torch.full((n,), i), 9, True) for i in range(2)], 1
    )
    pos = torch.arange(1, 4).expand(n, 3)
    tokens, accepted = rejection_sample(target_logits, drafts, q.expand(n, 2, vocab), st, pos, True)
    first = tokens[:, 0]
    p0 = target_logits[0, 0].softmax(-1).double()
    counts = torch.bincount(first, minlength=vocab).double()
    assert chi_p(counts, p0) > 1e-3
    assert 0 < accepted.float().mean() < 2


def test_deterministic_drafts_without_q_equal_a_one_hot_q():
    """The n-gram drafter passes no q (runtime/rejection.py): the same tokens and counts as a one-hot q at each
    draft, and the first emitted token follows p (accepted with p(x), recovered from p without x)."""
    n, vocab = 20_000, 6
    g = torch.Generator().manual_seed(1)
    target_logits = torch.randn(1, 3, vocab, generator=g).expand(n, 3, vocab)
    st = st_for([1.0] * n, seeds=list(range(n)))
    drafts = torch.randint(0, vocab, (n, 2), generator=g)
    pos = torch.arange(1, 4).expand(n, 3)
    one_hot = torch.nn.functional.one_hot(drafts, vocab).float()
    tokens, accepted = rejection_sample(target_logits, drafts, None, st, pos, True)
    ref_tokens, ref_accepted = rejection_sample(target_logits, drafts, one_hot, st, pos, True)
    assert torch.equal(tokens, ref_tokens) and torch.equal(accepted, ref_accepted)
    counts = torch.bincount(tokens[:, 0], minlength=vocab).double()
    assert chi_p(counts, target_logits[0, 0].softmax(-1).double()) > 1e-3
    assert 0 < accepted.float().mean() < 2


@pytest.mark.parametrize("kind", ["draft_model", "eagle", "eagle3_reduced", "ngram"])
def test_speculative_sampling_preserves_the_target_distribution(kind):
    """Tokens 2 and 3 come from the first verify step (K = 2); their frequencies over 8000 seeded requests
    must match the exact marginals, and the same counts must reject a marginal shifted by 2 %. `eagle3_reduced`:
    the draft distribution covers 10 of the 16 target ids (zero elsewhere), as EAGLE-3's reduced vocabulary."""
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
    low = 0.02 if kind == "ngram" else 0.1  # prompt lookup proposes what followed an earlier token: seldom p's mode
    assert low < eng.stats()["acceptance_rate"] < 0.95  # drafts were accepted and rejected
    samples = torch.tensor([o.token_ids for o in outs])  # [n, 3]

    assert_target_marginals(hf, prompt, vocab, samples)


def assert_target_marginals(hf, prompt: list[int], vocab: int, samples: torch.Tensor) -> None:
    """Samples [n, 3] of 3 tokens after `prompt`: the 2nd and 3rd tokens' counts fit the target's exact marginals
    (chi-square), and reject them with 2 % of the mass moved (the test can fail)."""
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


def sorted_probabilities(logits, temperature, top_k, top_p, dtype=torch.float32):
    """The former sort-based `_probabilities` (stable sort), the oracle of the sort-free one; masses in dtype.
    Returns the probabilities and each token's mass before it in sorted order (top-k renormalised)."""
    logits = logits.float()
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    logits = (logits / temp[:, None]).to(dtype)
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    drop = rank >= k[:, None]
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = torch.empty_like(logits).scatter_(-1, order, sorted_logits.softmax(-1))
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs), torch.empty_like(logits).scatter_(-1, order, mass_before)


def param_grid(vocab):
    """One row per (top_k, top_p, temperature): every off / edge value of each."""
    rows = list(itertools.product([0, 1, 5, vocab - 1, vocab, vocab + 3], [0.1, 0.5, 0.9, 1.0], [0.0, 0.7, 1.0, 2.0]))
    return (
        torch.tensor([r[2] for r in rows]),
        torch.tensor([r[0] for r in rows]),
        torch.tensor([r[1] for r in rows]),
    )


@pytest.mark.parametrize("kind", ["normal", "ties", "float16", "bfloat16"])
def test_sort_free_probabilities_equal_the_sorted_ones(kind):
    vocab = 40
    temp, top_k, top_p = param_grid(vocab)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(len(temp), vocab, generator=g) * 3
    if kind == "ties":  # 6 distinct values per row, and -inf (padded vocabulary entries)
        logits = torch.randint(-3, 3, logits.shape, generator=g).float()
        logits[:, -4:] = float("-inf")
    elif kind != "normal":
        logits = logits.to(getattr(torch, kind))
    ours = _probabilities(logits, temp, top_k, top_p)
    ref, _ = sorted_probabilities(logits, temp, top_k, top_p)
    assert torch.equal(ours > 0, ref > 0)
    torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)
    assert not torch.equal(ours > 0, torch.ones_like(ours, dtype=torch.bool))  # the grid does cut tokens


def test_sort_free_ties_keep_the_lowest_indices_first():
    flat = torch.zeros(3, 5)
    flat[:, 4] = -1.0
    temp, top_k, top_p = torch.ones(3), torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.3, 0.5])
    kept = _probabilities(flat, temp, top_k, top_p) > 0
    # top_k 2 of four equal tokens: the first two; top_p: tokens 0, 1 then while the mass before is < top_p
    # (p of each tie is ~0.229, so 0.3 keeps 2 tokens and 0.5 keeps 3).
    assert kept.tolist() == [
        [True, True, False, False, False],
        [True, True, False, False, False],
        [True] * 3 + [False] * 2,
    ]


def test_sort_free_top_p_zero_keeps_nothing_as_the_sort_did():
    """SamplingParams refuses top_p 0; the processing itself behaves as the sort-based version did (NaN rows)."""
    logits = torch.randn(2, 7, generator=torch.Generator().manual_seed(2))
    args = (logits, torch.ones(2), torch.tensor([0, 3]), torch.zeros(2))
    assert _probabilities(*args).isnan().all() and sorted_probabilities(*args)[0].isnan().all()


def test_sort_free_large_vocabulary():
    vocab = 32000
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(6, vocab, generator=g) * 2).bfloat16()  # bfloat16: hundreds of equal tail logits
    temp = torch.tensor([1.0, 0.8, 1.0, 1.2, 1.0, 0.5])
    top_k = torch.tensor([0, 50, 0, 1000, vocab - 1, 40])
    top_p = torch.tensor([0.9, 0.9, 0.5, 0.95, 0.99, 1.0])
    ours = _probabilities(logits, temp, top_k, top_p)
    ref, mass_before = sorted_probabilities(logits, temp, top_k, top_p, dtype=torch.float64)
    differ = (ours > 0) != (ref > 0)
    assert ((mass_before[differ] - top_p.double()[:, None].expand_as(differ)[differ]).abs() < 1e-5).all()
    assert differ.sum() <= 0.001 * (ref > 0).sum()
    assert (ours[5] > 0).sum() == 40 and torch.equal(ours[5] > 0, ref[5] > 0)  # top-k alone: exact
    torch.testing.assert_close(ours, ref.float(), atol=1e-5, rtol=1e-4)


def test_ordered_keys_and_threshold_search():
    x = torch.tensor([float("-inf"), -3e38, -1.0, -1e-45, -0.0, 0.0, 1e-45, 1.0, 3e38, float("inf")])
    keys = _ordered_keys(x).tolist()
    assert keys == sorted(keys) and keys[4] == keys[5] and len(set(keys)) == len(keys) - 1
    g = torch.Generator().manual_seed(4)
    k32 = torch.randint(-(2**31), 2**31, (3, 200), generator=g, dtype=torch.int64)
    k32[0, :5] = 2**31 - 1  # the extremes and repeated values
    k32[1, :100] = -(2**31)
    k32 = k32.to(torch.int32)
    for k in (1, 3, 100, 200):
        t = _threshold_key(k32, None, torch.tensor([[k]] * 3))
        assert torch.equal(t[:, 0], k32.long().topk(k, -1).values[:, -1].int())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
def test_sort_free_probabilities_in_a_cuda_graph():
    """Captured (so no host sync) and replayed on new logits: equal to eager, within the reference's rule, and
    the capture's memory is a few [N, V] buffers (the sort's workspace cost ~656 MiB of pool at 128k)."""
    n, vocab = 8, 128256
    g = torch.Generator(device="cuda").manual_seed(5)
    logits = (torch.randn(n, vocab, device="cuda", generator=g) * 2).bfloat16()
    temp = torch.tensor([1.0, 0.8, 0.0, 1.2, 1.0, 0.5, 1.0, 0.7], device="cuda")
    top_k = torch.tensor([0, 50, 0, 1000, vocab - 1, 40, 0, 1], device="cuda")
    top_p = torch.tensor([0.9, 0.9, 0.5, 0.95, 0.99, 1.0, 1.0, 0.5], device="cuda")
    args = (logits, temp, top_k, top_p)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _probabilities(*args)  # warm-up off the default stream, as capture wants
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.cuda.graph(graph):
        out = _probabilities(*args)
    peak = torch.cuda.max_memory_allocated() - before
    assert peak <= 12 * n * vocab * 4, f"capture peak {peak / 2**20:.1f} MiB"  # 12 float32 [N, V] buffers
    logits.copy_(logits.flip(-1))
    graph.replay()
    assert torch.equal(out, _probabilities(*args))
    ref, mass_before = sorted_probabilities(*args, dtype=torch.float64)
    differ = (out > 0) != (ref > 0)
    assert ((mass_before[differ] - top_p.double()[:, None].expand_as(differ)[differ]).abs() < 1e-5).all()
    torch.testing.assert_close(out, ref.float(), atol=1e-5, rtol=1e-4)
