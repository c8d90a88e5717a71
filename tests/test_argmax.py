"""`torch.ops.draftgraph.argmax_rows` and its two-stage Triton kernel (ops/sampling) against torch.argmax: equal
indices, exactly (the first maximum wins, NaN above all, as ATen). On a CPU machine the kernel runs under
TRITON_INTERPRET=1 (conftest.py) on short rows with small forced chunks and steps, so that ties, NaNs and row
ends fall across chunk (stage-1 program) and step (BLOCK) boundaries; the file takes seconds. On CUDA the same
checks run natively, plus the 128k vocabulary under the default rule and a CUDA-graph replay."""

import pytest
import torch

from draftgraph.ops.sampling.op import argmax_rows_reference, greedy_argmax
from draftgraph.ops.sampling.triton_argmax import ArgmaxRule, argmax_triton, choose_chunk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (columns per stage-1 program, columns per step): one stage; two stages with steps inside chunks; chunk not a
# multiple of the step; chunks smaller than a step (more programs than lanes per row)
SPLITS = [(None, None), (100, 32), (37, 16), (60, 64)]


def check(logits: torch.Tensor, chunk, block) -> torch.Tensor:
    got = argmax_triton(logits.to(DEVICE), chunk=chunk, block=block).cpu()
    want = logits.argmax(-1)
    assert got.dtype == torch.int64 and torch.equal(got, want), (got, want)
    return got


def tied_rows(vocab: int = 301) -> torch.Tensor:
    """Rows whose maximum occurs several times, the copies across chunk (100, 37, 60) and step boundaries,
    in the same lane of different steps and in different lanes, in later chunks and earlier lanes; the last
    column (a chunk of one). Short rows: the interpreter runs each (row, chunk) program in Python."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-3, 3, (8, vocab), generator=g).float()  # row 0: ~170 ties at the top, everywhere
    for row, cols in enumerate([[99, 100], [199, 200, 260], [36, 37], [40, 10], [250, 300], [59, 60, 120], [280]], 1):
        x[row, cols] = 5.0
    return x


@pytest.mark.parametrize("chunk,block", SPLITS)
def test_ties_first_index_wins(chunk, block):
    got = check(tied_rows(), chunk, block)
    assert got[1:].tolist() == [99, 199, 36, 10, 250, 59, 280]


# 1000: whole chunks, a partial step; 1001: a last chunk of one column; 1299: a last chunk of 3 steps and 3 columns,
# and 13 partials folded 2 a step by stage 2 (its step from the vocabulary: ceil(1299 / 1024)), the last masked
@pytest.mark.parametrize("vocab", [1, 5, 1000, 1001, 1299])
def test_ragged_vocabulary(vocab):
    x = torch.randn(3, vocab, generator=torch.Generator().manual_seed(vocab))
    x[2, -1] = 10.0  # the last column, in the last (partial) step of the last (partial) chunk
    got = check(x, 100, 32)
    assert got[2] == vocab - 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype):
    """16-bit logits: rounding makes nearby values equal (float32 noise below half a 16-bit ulp), and the kernel's
    float32 comparisons keep them equal (the widening is exact)."""
    g = torch.Generator().manual_seed(1)
    x = (torch.randint(-20, 20, (4, 1100), generator=g) * 0.1 + torch.randn(4, 1100, generator=g) * 1e-4).to(dtype)
    assert (x == x.max(-1, keepdim=True).values).sum(-1).min() > 1  # ties do occur
    check(x, 257, 64)
    check(x, None, None)


def test_infinities_and_nan():
    """-inf rows give 0; +inf beats numbers; NaN beats everything, +inf included, and the first NaN wins."""
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(2))
    x[0] = float("-inf")
    x[1, :] = float("-inf")
    x[1, 233] = -1e30
    x[2, [40, 260]] = float("inf")
    x[3, [250, 120]] = float("nan")
    x[3, 7] = float("inf")
    x[4] = float("nan")
    x[5, 299] = float("nan")
    for chunk, block in SPLITS:
        assert check(x, chunk, block).tolist()[:6] == [0, 233, 40, 120, 0, 299]


def test_strided_views_and_no_rows():
    base = torch.randint(-4, 4, (9, 400), generator=torch.Generator().manual_seed(3)).float()
    check(base[::2, 5:-3], 100, 32)  # row stride 800, rows start mid-row
    check(base[:, :16].t(), 3, 8)  # column stride 400 (a transposed view)
    check(torch.empty(0, 1000), 100, 32)  # N = 0: nothing launched
    check(torch.empty(0, 1000), None, None)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match=r"logits \[N, V\]; got shape \(2, 3, 4\)"):
        argmax_triton(torch.zeros(2, 3, 4, device=DEVICE))
    with pytest.raises(ValueError, match="got torch.int64"):
        argmax_triton(torch.zeros(2, 3, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="0 columns"):
        argmax_triton(torch.zeros(2, 0, device=DEVICE))
    with pytest.raises(ValueError, match="got shape \\(4,\\)"):
        argmax_rows_reference(torch.zeros(4))


def test_rule_picks():
    """On 132 SMs (target 528 programs) at V = 128256: chunks per row fall as rows grow, one stage from 528."""
    picks = {n: choose_chunk(n, 128256, 132) for n in (1, 5, 32, 160, 527, 528, 640)}
    assert picks == {1: 1024, 5: 1280, 32: 7680, 160: 32256, 527: 64256, 528: 128256, 640: 128256}
    assert all(c % 256 == 0 or c == 128256 for c in picks.values())
    assert choose_chunk(1, 128256, None) == 128256  # no SM count (interpreter): one stage
    assert choose_chunk(1, 700, 132) == 700  # a short row: one chunk
    assert choose_chunk(0, 128256, 132) == 128256
    assert choose_chunk(4, 128256, 132, ArgmaxRule(programs_per_sm=1, min_chunk=4096)) == 3840 + 256
    with pytest.raises(ValueError, match="min_chunk = 0"):
        ArgmaxRule(min_chunk=0)


def test_op_opcheck_and_greedy_argmax():
    x = tied_rows()
    torch.library.opcheck(torch.ops.draftgraph.argmax_rows.default, (x,))
    assert torch.equal(torch.ops.draftgraph.argmax_rows(x), x.argmax(-1))
    x3 = x.view(2, 4, x.shape[-1])
    assert torch.equal(greedy_argmax(x3), x3.argmax(-1))  # leading dims
    assert torch.equal(greedy_argmax(x.long()), x.long().argmax(-1))  # other dtypes: torch.argmax


def test_op_is_one_opaque_node_under_compile():
    """Dynamo records the op as one call; AOT (the fake) and Inductor give torch.argmax's answer."""
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm

    def fn(logits):
        return torch.ops.draftgraph.argmax_rows(logits * 2.0) + 1

    x = tied_rows()
    want = x.argmax(-1) + 1
    assert torch.equal(torch.compile(fn, backend=count, fullgraph=True)(x), want)
    calls = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    op = torch.ops.draftgraph.argmax_rows
    assert sum(c in (op, op.default) for c in calls) == 1 and len(calls) == 3  # mul, the op, add
    assert torch.equal(torch.compile(fn, backend="aot_eager", fullgraph=True)(x), want)
    assert torch.equal(torch.compile(fn, backend="inductor", fullgraph=True)(x), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the default rule's split and a graph replay")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_vocabulary_128k_in_a_graph(dtype):
    vocab = 128256
    for rows in (1, 5, 32, 160, 640):
        x = torch.randn(rows, vocab, device="cuda").to(dtype)
        x[:, 70000] = x[:, 1000] = 100.0  # a tie across chunks: 1000 wins
        assert torch.equal(torch.ops.draftgraph.argmax_rows(x), x.argmax(-1))
    x = torch.randn(5, vocab, device="cuda").to(dtype)
    torch.ops.draftgraph.argmax_rows(x)  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.draftgraph.argmax_rows(x)
    x.copy_(torch.randn(5, vocab, device="cuda").to(dtype))
    graph.replay()
    assert torch.equal(out, x.argmax(-1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the op inside an Inductor graph")
def test_cuda_greedy_argmax_under_inductor():
    x = torch.randn(2, 5, 128256, device="cuda").bfloat16()
    x[..., 90000] = x[..., 9] = 50.0
    fn = torch.compile(lambda logits: greedy_argmax(logits.float() * 0.5), fullgraph=True)
    assert torch.equal(fn(x), x.argmax(-1)) and fn(x).eq(9).all()
