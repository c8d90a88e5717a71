"""The logits-processing kernels (ops/logits/triton_penalties.py, triton_logprobs.py) against their torch-ops
references (ops/logits/penalties.py `process_reference`, logprobs.py `gather_reference`). On CPU the kernels run
under TRITON_INTERPRET=1 (conftest.py), on small vocabularies and small blocks (blocks and chunks cut rows inside);
on CUDA natively. Penalties in float32: equal (the division is IEEE and, on CUDA, no multiply-add is contracted;
the interpreter's numpy float32 ops are IEEE too), inactive and padding rows bit for bit. Logprobs: the same top
ids, values to 1e-5."""

import pytest
import torch

import draftgraph as dg
from draftgraph.ops.logits.logprobs import gather_reference
from draftgraph.ops.logits.penalties import process_reference
from draftgraph.ops.logits.triton_logprobs import gather_triton
from draftgraph.ops.logits.triton_penalties import process_triton
from draftgraph.runtime.penalties import PenaltyState

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class _Req:
    def __init__(self, slot, prompt, output, params, stop_ids=frozenset()):
        self.slot, self.prompt, self.output, self.params, self.stop_ids = slot, prompt, output, params, stop_ids


def _state(vocab: int, reqs) -> PenaltyState:
    pen = PenaltyState(max_num_seqs=4, vocab_size=vocab, device=DEVICE)
    pen.admit(reqs)
    return pen


def _both(pen, logits, slots, drafts, **kw):
    args = (logits.to(DEVICE), slots.to(DEVICE), None if drafts is None else drafts.to(DEVICE), pen.tables)
    return process_triton(*args, **kw).cpu(), process_reference(*args).cpu()


def test_penalties_match_the_reference_with_drafts_bias_and_min_tokens():
    """Slots with every kind of processing (repeated drafts, drafts on biased and stop tokens, min_tokens reached
    inside the verify rows, a bias on token 0 and a zero bias), a slot asking for nothing and the scratch slot
    (padding rows): blocks of 32 columns cut the 100-column rows."""
    vocab, k = 100, 4
    g = torch.Generator().manual_seed(0)
    bias = {0: 2.5, 2: 1.5, 40: -3.0, 41: 0.0}
    p0 = dg.SamplingParams(max_tokens=20, frequency_penalty=0.7, presence_penalty=0.4, repetition_penalty=1.3,
                           min_tokens=3, logit_bias=bias, stop_token_ids=(5, 6))  # fmt: skip
    p1 = dg.SamplingParams(max_tokens=20, repetition_penalty=0.8, frequency_penalty=-0.5)
    reqs = [
        _Req(0, [1, 3, 40], [4, 2], p0, frozenset({5, 6})),
        _Req(1, [7, 8], [9], p1),
        _Req(2, [1], [1, 1], dg.SamplingParams()),  # asks for nothing: raw logits
    ]
    pen = _state(vocab, reqs)
    logits = torch.randn(5, k + 1, vocab, generator=g) * 3
    logits[0, :, 2] = -0.0  # a biased -0.0
    drafts = torch.randint(0, vocab, (5, k), generator=g)
    drafts[0] = torch.tensor([2, 2, 5, 40])  # repeated, biased, a stop token
    drafts[1] = torch.tensor([9, 7, 9, 9])
    slots = torch.tensor([0, 1, 2, 4, 4])  # 4: the scratch slot (padding rows)
    ours, ref = _both(pen, logits, slots, drafts, block=32)
    assert torch.equal(ours, ref)
    assert torch.equal(ours[2:].view(torch.int32), logits[2:].view(torch.int32))  # bit for bit: no processing
    assert torch.isinf(ours[0, :, 5]).tolist() == [True, False, False, False, False]  # 2 outputs: the third is row 0
    assert not torch.equal(ours[0, 1:, 2], process_reference(logits, slots, None, pen.tables)[0, 1:, 2])  # counted


def test_penalties_without_drafts_in_half_precision_through_a_stride():
    """One row per request (a last prompt chunk: no drafts), bfloat16 logits read through a stride."""
    vocab = 70
    g = torch.Generator().manual_seed(1)
    p = dg.SamplingParams(max_tokens=20, presence_penalty=1.0, repetition_penalty=1.5, logit_bias={69: 5.0},
                          min_tokens=1, stop_token_ids=(3,))  # fmt: skip
    pen = _state(vocab, [_Req(1, [2, 69], [], p, frozenset({3}))])
    wide = (torch.randn(2, 1, vocab + 10, generator=g) * 2).bfloat16()
    logits = wide[..., :vocab]
    ours, ref = _both(pen, logits, torch.tensor([1, 0]), None, block=64)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours, ref)  # bfloat16's tolerance: the interpreter rounds float32 to it by truncation
    assert torch.isinf(ours[0, 0, 3]) and torch.equal(ours[1].view(torch.int16), logits[1].view(torch.int16))


def test_logprobs_match_the_reference():
    """Chunks of 32 columns (the last one partial) with the top 20 spread over several, ties at the top (lowest id
    first, as a stable sort), -0.0 and a row read through a stride."""
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(6, 150, generator=g) * 4
    logits = wide[:, :130]
    logits[1, ::9] = 30.0  # 15 tied maxima
    logits[2, 5] = -0.0
    chosen = torch.randint(0, 130, (6,), generator=g)
    ours = gather_triton(logits.to(DEVICE), chosen.to(DEVICE), 20, block=32).cpu()
    ref = gather_reference(logits, chosen, 20)
    n = 6 * 20
    ids, ref_ids = ours[:n].view(6, 20), ref[:n].view(6, 20)
    assert torch.equal(ids[[0, 2, 3, 4, 5]], ref_ids[[0, 2, 3, 4, 5]])  # distinct values: topk's order
    assert ids[1, :15].tolist() == list(range(0, 130, 9))  # ties: lowest id first
    assert torch.equal(ids[1, 15:], ref_ids[1, 15:])
    vals, ref_vals = ours[n:].view(torch.float64), ref[n:].view(torch.float64)
    torch.testing.assert_close(vals, ref_vals, atol=1e-5, rtol=0)


@pytest.mark.parametrize("vocab", [7, 33])
def test_logprobs_of_vocabularies_near_the_width(vocab):
    """The top width is the whole vocabulary (7) or most of one chunk-and-a-bit (33, chunks of 32)."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, vocab, generator=g)
    chosen = torch.tensor([0, vocab - 1, 3])
    n = min(20, vocab)
    ours = gather_triton(logits.to(DEVICE), chosen.to(DEVICE), n, block=32).cpu()
    ref = gather_reference(logits, chosen, n)
    assert torch.equal(ours[: 3 * n], ref[: 3 * n])
    torch.testing.assert_close(ours[3 * n :].view(torch.float64), ref[3 * n :].view(torch.float64), atol=1e-5, rtol=0)


def test_logprobs_with_more_chunks_than_top_tokens():
    """40 chunks of 16 columns (more than the 20 top tokens: most chunks offer nothing, the rest only their values
    at or above the 20th largest chunk maximum): distinct values, the top 20 inside 3 chunks, and 30 tied maxima
    over 30 chunks (the first 20 by id)."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 640, generator=g)
    logits[1, 100:120] += 10.0  # the top 20 in chunks 6, 7 (and none elsewhere)
    logits[2, 5::21] = 9.0  # 31 tied maxima, one per chunk or so
    chosen = torch.tensor([3, 110, 5])
    ours = gather_triton(logits.to(DEVICE), chosen.to(DEVICE), 20, block=16).cpu()
    ref = gather_reference(logits, chosen, 20)
    ids = ours[:60].view(3, 20)
    assert torch.equal(ids[:2], ref[:40].view(2, 20))
    assert sorted(ids[1].tolist()) == list(range(100, 120)) and ids[2].tolist() == list(range(5, 640, 21))[:20]
    torch.testing.assert_close(ours[60:].view(torch.float64), ref[60:].view(torch.float64), atol=1e-5, rtol=0)


def test_penalties_of_a_draft_step_match_the_reference():
    """A draft step's one row after the j = 3 drafts proposed before it (first_row 3: min_tokens counts them, their
    columns count them, one of them repeated and one on the biased token)."""
    vocab = 50
    g = torch.Generator().manual_seed(5)
    p = dg.SamplingParams(max_tokens=20, frequency_penalty=0.9, presence_penalty=0.2, repetition_penalty=1.2,
                          min_tokens=4, logit_bias={8: 2.0}, stop_token_ids=(1,))  # fmt: skip
    pen = _state(vocab, [_Req(0, [3], [], p, frozenset({1})), _Req(2, [4], [6], p, frozenset({1}))])
    logits = torch.randn(3, 1, vocab, generator=g)
    prior = torch.tensor([[8, 8, 5], [6, 9, 1], [2, 2, 2]])
    slots = torch.tensor([0, 2, 4])
    args = (logits.to(DEVICE), slots.to(DEVICE), prior.to(DEVICE), pen.tables)
    ours, ref = process_triton(*args, first_row=3, block=16).cpu(), process_reference(*args, first_row=3).cpu()
    assert torch.equal(ours, ref)
    assert torch.isinf(ours[0, 0, 1]) and not torch.isinf(ours[1, 0, 1])  # 0 + 3 < 4 <= 1 + 3
    assert not torch.equal(ref, process_reference(logits, slots, prior, pen.tables))  # first_row 0 differs
