"""The n-gram (prompt lookup) matcher against a plain Python reference: the longest n in [n_min, n_max] whose last-n
suffix recurs earlier, its latest occurrence, the K tokens after it (fewer, padded, near the end), none without a
match; and one compiled trace for every history (no data-dependent branching: it can sit in a step graph)."""

import random

import pytest
import torch

from draftgraph.models.drafters.ngram_match import ngram_propose


def reference(tokens: list[int], k: int, n_min: int, n_max: int, pad: int) -> tuple[list[int], int]:
    m = len(tokens)
    for n in range(n_max, n_min - 1, -1):
        if m < n + 1:
            continue
        suffix = tokens[m - n :]
        for j in range(m - n - 1, -1, -1):  # latest occurrence first, ending before the suffix's own last token
            if tokens[j : j + n] == suffix:
                follow = tokens[j + n : j + n + k]
                return follow + [pad] * (k - len(follow)), len(follow)
    return [pad] * k, 0


def batch(rows: list[list[int]], width: int):
    hist = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        hist[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        hist[i, len(r) :] = 7  # stale tokens past the length must never match or be proposed
    return hist, torch.tensor([len(r) for r in rows])


def test_hand_cases():
    rows = [
        [5, 6, 7, 8, 9, 5, 6, 7],  # "5 6 7" recurs at 0: propose 8 9 5
        [1, 2, 3, 4],  # nothing recurs
        [3, 3, 3, 3],  # n = 3 at j = 0: one token follows inside the history before the suffix
        [9, 1, 2, 9, 1, 4, 9, 1],  # "9 1" twice: the latest (j = 3) proposes 4 9 1
        [],  # empty history
    ]
    hist, lengths = batch(rows, 12)
    drafts, n = ngram_propose(hist, lengths, k=3, n_min=1, n_max=3, pad_id=-1)
    assert drafts.tolist() == [[8, 9, 5], [-1, -1, -1], [3, -1, -1], [4, 9, 1], [-1, -1, -1]]
    assert n.tolist() == [3, 0, 1, 3, 0]
    with pytest.raises(ValueError, match="n_min=3, n_max=2 must satisfy 1 <= n_min <= n_max"):
        ngram_propose(hist, lengths, k=3, n_min=3, n_max=2)


@pytest.mark.parametrize("n_min,n_max,k", [(1, 4, 3), (2, 2, 5), (3, 5, 1)])
def test_random_histories_equal_the_reference(n_min, n_max, k):
    rng = random.Random(n_min * 10 + n_max)
    rows = [[rng.randrange(4) for _ in range(rng.randrange(0, 30))] for _ in range(64)]  # small vocab: many repeats
    hist, lengths = batch(rows, 32)
    drafts, n = ngram_propose(hist, lengths, k, n_min, n_max, pad_id=-1)
    for i, r in enumerate(rows):
        ref, count = reference(r, k, n_min, n_max, -1)
        assert drafts[i].tolist() == ref and int(n[i]) == count, (r, drafts[i], ref)
    assert 0 < int((n > 0).sum()) < len(rows)  # matched and unmatched rows both seen


def test_one_trace_for_every_history():
    counts = {"frames": 0}

    def backend(gm, inputs):
        counts["frames"] += 1
        return gm.forward

    fn = torch.compile(lambda h, lens: ngram_propose(h, lens, 3, 1, 3), backend=backend, fullgraph=True)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        hist = torch.randint(0, 3, (4, 16), generator=g)
        lens = torch.randint(0, 17, (4,), generator=g)
        assert [t.tolist() for t in fn(hist, lens)] == [t.tolist() for t in ngram_propose(hist, lens, 3, 1, 3)]
    assert counts["frames"] == 1  # no recompiles, no graph breaks (fullgraph)


def test_state_records_emitted_tokens_and_proposes_from_them():
    """NgramState (runtime/ngram_state.py): admitted prompts, then each step's emitted tokens (the first
    num_emitted of each row; padding rows into the scratch row) appended on the device; proposals equal the
    reference over the host's view of each history."""
    from types import SimpleNamespace

    from draftgraph.runtime.ngram_state import NgramState

    k, rng = 3, random.Random(5)
    state = NgramState(max_num_seqs=4, max_model_len=40, k=k, n_min=1, n_max=3, device="cpu")
    hist = {0: [1, 2, 3, 4, 1, 2], 2: [5, 6, 5]}
    state.admit([SimpleNamespace(slot=s, tokens=t) for s, t in hist.items()])
    for _ in range(6):
        tokens = torch.tensor([[rng.randrange(1, 7) for _ in range(k + 1)] for _ in range(3)])
        emitted = torch.tensor([rng.randrange(1, k + 2), rng.randrange(1, k + 2), 4])
        slots = torch.tensor([0, 2, state.scratch])  # the last row pads the batch
        drafts = state.step(slots, tokens, emitted)
        for row, s in enumerate((0, 2)):
            hist[s] += tokens[row, : emitted[row]].tolist()
            assert drafts[row].tolist() == reference(hist[s], k, 1, 3, 0)[0]
    assert state.lengths[:3].tolist() == [len(hist[0]), 0, len(hist[2])]


def test_ngram_settings_are_checked():
    import draftgraph as dg
    from draftgraph.models.drafters.ngram import is_ngram

    with pytest.raises(ValueError, match="1 <= ngram_min <= ngram_max <= 16"):
        dg.CompileConfig(ngram_min=0)
    with pytest.raises(ValueError, match="ngram_min=4, ngram_max=2"):
        dg.CompileConfig(ngram_min=4, ngram_max=2)
    with pytest.raises(TypeError, match="ngram_max=2.5 must be an int"):
        dg.CompileConfig(ngram_max=2.5)
    with pytest.raises(ValueError, match="drafter_kind='ngram' needs drafter='ngram'"):
        is_ngram("/some/checkpoint", "ngram")
    with pytest.raises(ValueError, match="drafter_kind='eagle'"):
        is_ngram("ngram", "eagle")
    assert is_ngram("ngram", None) and not is_ngram(None, None)
    with pytest.raises(ValueError, match="one-process engines only"):  # before any worker starts
        dg.compile_model(object(), "ngram", dg.CompileConfig(tensor_parallel_size=2))
