"""The exponential race in Triton (ops/sampling/triton_race.py, the op `draftgraph::race_sample`) against
noise.race_reference, the torch ops it replaces: the same tokens, exactly (the hash's bits are the same in
uint32 registers as in masked int64 tensors). On a CPU machine the kernel runs under TRITON_INTERPRET=1
(conftest.py) on short rows with small forced chunks and steps, so that winners fall across chunk (stage-1
program) and step (BLOCK) boundaries."""

import pytest
import torch

from draftgraph.ops.sampling.noise import race_reference
from draftgraph.ops.sampling.op import race_sample
from draftgraph.ops.sampling.triton_race import race_triton
from draftgraph.runtime.sampler import SALT_DRAFT, SALT_TARGET, sample_from_probs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SPLITS = [(None, None), (100, 32), (37, 16), (60, 64)]  # one stage; then two: 2, 5 and 3 chunks of a 160-column row


def rows(vocab: int = 160) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Peaked and flat rows, a top-k-like row of zeros but 3 columns (in the first, a middle and the last chunk
    of every split), a one-column row, a NaN row (nothing kept), with seeds and positions past 32 bits (the hash
    keeps their low 32 bits, as the reference's masks do). Few rows and columns: the interpreter runs each
    (row, chunk) program's steps in Python, so the cost is rows x chunks x steps."""
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(8, vocab, generator=g) * torch.linspace(0.1, 4, 8)[:, None], -1)
    probs[5] = 0
    probs[5, [5, 80, vocab - 1]] = torch.tensor([0.2, 0.3, 0.5])
    probs[6] = 0
    probs[6, 123] = 1.0
    probs[7] = float("nan")
    seeds = torch.tensor([0, 2**31 - 1, 2, 2**40 + 9, 4, 5, 6, 7])
    positions = torch.tensor([0, 1, 2**32 + 5, 3, 2**45, 5, 6, 7])
    return probs, seeds, positions


@pytest.mark.parametrize("chunk,block", SPLITS)
@pytest.mark.parametrize("salt", [SALT_TARGET, SALT_DRAFT])
def test_kernel_draws_the_reference_tokens(chunk, block, salt):
    probs, seeds, positions = rows()
    want = race_reference(probs, seeds, positions, salt)
    got = race_triton(probs.to(DEVICE), seeds.to(DEVICE), positions.to(DEVICE), salt, chunk=chunk, block=block)
    assert got.dtype == torch.int64 and torch.equal(got.cpu(), want), (got, want)
    assert got[5] in (5, 80, 159) and got[6] == 123 and got[7] == 0  # zeros never win; a NaN row: its first


def test_many_rows_and_the_op_on_each_device():
    g = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(40, 97, generator=g), -1)  # chunks of 64 and 33 columns: steps of 32 and 1
    seeds, positions = torch.randint(0, 2**62, (40,), generator=g), torch.randint(0, 2**20, (40,), generator=g)
    want = race_reference(probs, seeds, positions, SALT_TARGET)
    got = race_triton(probs.to(DEVICE), seeds.to(DEVICE), positions.to(DEVICE), SALT_TARGET, chunk=64, block=32)
    assert torch.equal(got.cpu(), want)
    assert torch.equal(race_sample(probs, seeds, positions, SALT_TARGET), want)  # CPU: the reference
    for race_kernel in (True, False):  # CPU: the reference either way (the kernel is for CUDA tensors only)
        assert torch.equal(sample_from_probs(probs, seeds, positions, SALT_TARGET, race_kernel), want)


def test_bad_inputs_name_the_fix():
    probs, seeds, positions = rows()
    with pytest.raises(ValueError, match="float32 probs"):
        race_triton(probs.half(), seeds, positions, SALT_TARGET)
    with pytest.raises(ValueError, match="one seed and one position per row"):
        race_triton(probs, seeds[:3], positions, SALT_TARGET)
    with pytest.raises(ValueError, match="32-bit"):
        race_triton(probs, seeds, positions, 2**32)
