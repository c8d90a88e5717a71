"""The Triton top-k / top-p kernels (ops/sampling/triton_probs.py) against the torch-ops version they implement
(`probabilities_torch_ops`): the kept sets equal exactly (ties at both cuts kept lowest index first) and the
probabilities to float32 rounding (1e-6 abs, 1e-5 rel). On CPU the kernels run under TRITON_INTERPRET=1
(conftest.py), on small vocabularies and few programs (the interpreter runs every program in Python); on CUDA
natively, plus a 128k vocabulary, where float sums in another order may move a token whose mass-before lies
within 1e-5 of top_p (checked against the sort's exact mass-before, as in test_sampling.py)."""

import pytest
import torch

from draftgraph.ops.sampling.probs import probabilities_torch_ops
from draftgraph.ops.sampling.triton_probs import choose_splits, probabilities_triton
from tests.test_sampling import param_grid, sorted_probabilities

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def both(logits, temp, top_k, top_p, **kernel_args):
    """(Triton on DEVICE, torch ops on the CPU), both on the CPU."""
    args = (logits, temp, top_k, top_p)
    ours = probabilities_triton(*(a.to(DEVICE) for a in args), **kernel_args).cpu()
    return ours, probabilities_torch_ops(*args)


def assert_same(ours, ref):
    assert torch.equal(ours > 0, ref > 0)
    assert torch.equal(ours.isnan(), ref.isnan())
    torch.testing.assert_close(ours.nan_to_num(), ref.nan_to_num(), atol=1e-6, rtol=1e-5)


def test_parameter_grid_matches_torch_ops():
    """Every (top_k, top_p, temperature) of the sampling tests' grid, one program per row (8-bit digits), on
    integer logits (6 values per row, -inf padding) and bfloat16-rounded ones (many equal tails) alternately."""
    vocab = 300
    temp, top_k, top_p = param_grid(vocab)
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(len(temp), vocab, generator=g) * 3).bfloat16().float()
    logits[::2] = torch.randint(-3, 3, (len(temp[::2]), vocab), generator=g).float()
    logits[::2, -4:] = float("-inf")
    ours, ref = both(logits, temp, top_k, top_p, splits=1, blocks=(512, 512), bits=8)
    assert_same(ours, ref)
    kept = (ref > 0).sum(-1)
    assert kept.min() == 1 and kept[::2].max() == vocab - 4 and kept[1::2].max() == vocab  # cuts and none


def test_ties_across_splits():
    """Rows split over 3 programs (4-bit digits, as on the GPU) with ties at both cuts straddling the splits:
    the ranks carry across programs."""
    vocab = 700
    g = torch.Generator().manual_seed(2)
    logits = torch.randint(-2, 2, (6, vocab), generator=g).float() * 0.5  # ~175 tokens per value
    logits[1, ::7] = 3.0  # 100 tokens tied at the top
    temp = torch.tensor([1.0, 1.0, 0.9, 1.3, 0.0, 1.0])
    top_k = torch.tensor([200, 50, 0, 400, 0, 3])
    top_p = torch.tensor([1.0, 0.3, 0.6, 0.95, 1.0, 0.0])  # row 5: top_p 0 keeps nothing (NaN, as the sort)
    # chunks of 256 columns (the splits at 256 and 512), each 2 count steps and 4 mass steps
    ours, ref = both(logits, temp, top_k, top_p, splits=3, blocks=(128, 64))
    assert_same(ours, ref)
    kept = (ref > 0).sum(-1).tolist()
    # row 0: 200 of ~175 + ~175 tied; row 1: 50 of the 100 tied at 3.0 (p = 0.02 each), then ~0.3 / 0.02 of them
    assert kept[0] == 200 and 10 < kept[1] < 50 and kept[4] == 1 and ref[5].isnan().all()
    assert ours[4].argmax() == logits[4].argmax()  # greedy: the first of ~175 tied maxima


def test_random_half_precision_logits_read_through_a_stride():
    """Distinct logits in float16, rows read through a stride (a slice of wider logits), 2 programs per row."""
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(4, 1200, generator=g) * 4).half()[:, :1000]
    temp = torch.tensor([0.7, 4.0, 1.5, 0.3])
    top_k = torch.tensor([0, 20, 999, 1])
    top_p = torch.tensor([0.9, 0.5, 0.99, 0.7])
    ours, ref = both(logits, temp, top_k, top_p, splits=2, blocks=(256, 128))
    assert_same(ours, ref)
    kept = (ref > 0).sum(-1).tolist()
    assert kept[3] == 1 and 1 < kept[1] < 20 and kept[2] > 100


def test_splits_rule():
    assert choose_splits(8, 128256, torch.device("cpu")) == 1  # the interpreter: one program per row
    if torch.cuda.is_available():
        n = choose_splits(1, 128256, torch.device("cuda"))
        assert 1 < n <= 128256 // 2048 + 1
        assert choose_splits(4096, 128256, torch.device("cuda")) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a 128k vocabulary needs the real kernels")
def test_large_vocabulary_on_cuda():
    n, vocab = 12, 128256
    g = torch.Generator().manual_seed(4)
    logits = (torch.randn(n, vocab, generator=g) * 2).bfloat16()
    temp = torch.tensor([1.0, 0.8, 1.0, 1.2, 1.0, 0.5, 0.0, 0.7, 1.0, 1.0, 0.6, 2.0])
    top_k = torch.tensor([0, 50, 0, 1000, vocab - 1, 40, 0, 1, 0, 100_000, 5, 0])
    top_p = torch.tensor([0.9, 0.9, 0.5, 0.95, 0.99, 1.0, 1.0, 0.5, 1.0, 0.999, 0.2, 0.8])
    _, mass_before = sorted_probabilities(logits, temp, top_k, top_p, dtype=torch.float64)
    for bits in (4, 2, 8):  # each digit width sums the masses in its own order
        ours, ref = both(logits, temp, top_k, top_p, bits=bits)
        differ = (ours > 0) != (ref > 0)
        assert ((mass_before[differ] - top_p.double()[:, None].expand_as(differ)[differ]).abs() < 1e-5).all()
        assert differ.sum() <= 0.001 * (ref > 0).sum()
        assert torch.equal(ours[5:8] > 0, ref[5:8] > 0)  # top-k alone, greedy, top-k 1: exact
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-4)
