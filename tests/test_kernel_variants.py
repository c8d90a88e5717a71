"""Launchers of draftgraph's Triton kernels must not compile a kernel per batch size
(docs/history/benchmarks-2026-11.md, 2026-11-23: constexprs derived from the row count made capture recompile
the sampling kernels at every captured size, 63 s of a 109 s cold start). Each launcher runs at several
batch-driven values (rows, split counts); the kernels' constexpr arguments must be equal across them, and every
integer argument that varies must be marked `do_not_specialize` (an int equal to 1 or divisible by 16 is
otherwise another kernel). Known, bounded variation is listed in ALLOWED with its reason. On the CPU the kernels
run in Triton's interpreter (conftest.py), which keeps the `triton.jit` arguments: the check is the same as on a
GPU."""

import inspect

import pytest
import torch

import draftgraph.ops.attention.triton_attention as ta
import draftgraph.ops.attention.triton_split_kv as sk
from draftgraph.ops.sampling import triton_argmax
from draftgraph.ops.sampling import triton_probs as sampling_triton
from tests.test_split_kv import HEAD_DIM, make_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (kernel, constexpr): why it may vary with the batch, and how many values it can take
ALLOWED = {
    ("_merge_kernel", "S_PAD"): "the split count's power of two (the rule gives powers of two up to 64)",
    ("_stage1", "BLOCK"): "a step of 2 ** n columns up to 8 KiB from the chunk (3 values at 128k columns)",
    ("_stage1", "ONE_STAGE"): "one stage when the rows alone fill the GPU",
}


def _spec(kernel):
    """(argument names, constexpr names, names not specialised) of a Triton JIT / interpreted function."""
    fn = kernel.fn
    params = inspect.signature(fn).parameters
    const = {n for n, p in params.items() if "constexpr" in str(p.annotation)}
    dns = getattr(kernel, "kwargs", {}).get("do_not_specialize") or getattr(kernel, "do_not_specialize", ())
    names = list(params)
    return names, const, {names[d] if isinstance(d, int) else d for d in dns}


class _Recorder:
    """Stands in for a kernel in its module: records each launch's arguments by name, then launches."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        names = _spec(self.kernel)[0]

        def run(*args, **kwargs):
            self.calls.append({**dict(zip(names, args)), **kwargs})
            return launch(*args, **kwargs)

        return run


def _record(monkeypatch, module, *names):
    recorders = {n: _Recorder(getattr(module, n)) for n in names}
    for n, r in recorders.items():
        monkeypatch.setattr(module, n, r)
    return recorders


def _check(recorders):
    for name, rec in recorders.items():
        assert rec.calls, f"{name} never launched"
        names, const, not_specialised = _spec(rec.kernel)
        for arg in names:
            values = {repr(c[arg]) for c in rec.calls if arg in c}
            if len(values) < 2 or (name, arg) in ALLOWED:
                continue
            if arg in const:
                pytest.fail(f"{name}: constexpr {arg} takes {sorted(values)} with the batch: one compile each")
            ints = [c[arg] for c in rec.calls if arg in c and type(c[arg]) is int]
            if len(ints) == len(rec.calls) and len({(v == 1, v % 16 == 0) for v in ints}) > 1:
                # Triton compiles an int argument's value classes apart (1, a multiple of 16, other)
                assert arg in not_specialised, f"{name}: int {arg} takes {sorted(set(ints))}: do_not_specialize it"


def test_sampling_launchers_do_not_specialise_on_rows(monkeypatch):
    recorders = _record(monkeypatch, sampling_triton, "_top_k_pass", "_top_p_pass", "_write")
    vocab = 4 * sampling_triton.MIN_CHUNK  # choose_splits gives 1 to 4 programs per row here
    g = torch.Generator().manual_seed(0)
    # rows 1 and 2 (the grid only: no kernel argument follows the rows), splits 4, 1 and 3 (S = 1, a power of
    # two, another): few programs, since the interpreter runs each of the 2 * 8 + 1 launches' programs in Python
    for rows, splits in ((1, 4), (2, 1), (1, 3)):
        logits = torch.randn(rows, vocab, generator=g).to(DEVICE)
        temp, top_k, top_p = (torch.full((rows,), v).to(DEVICE) for v in (0.9, 20.0, 0.8))
        # count / write steps of 1024 columns (the default; fewer interpreted steps than 256), mass steps of 256
        probs = sampling_triton.probabilities_triton(logits, temp, top_k.long(), top_p, splits=splits,
                                                     blocks=(1024, 256))  # fmt: skip
        assert torch.allclose(probs.sum(-1), torch.ones(rows, device=DEVICE), atol=1e-5)
    assert len(recorders["_top_k_pass"].calls) == 3 * 32 // sampling_triton.BITS  # every pass launched
    _check(recorders)


def test_argmax_launchers_do_not_specialise_on_rows(monkeypatch):
    recorders = _record(monkeypatch, triton_argmax, "_stage1", "_stage2")
    g = torch.Generator().manual_seed(1)
    for rows, chunk in ((1, 256), (5, 512), (2, 384)):  # the rule's chunk falls as the rows grow
        logits = torch.randn(rows, 2048, generator=g).to(DEVICE)  # 8, 4 and 6 chunks: two stages each
        assert torch.equal(triton_argmax.argmax_triton(logits, chunk=chunk).cpu(), logits.argmax(-1).cpu())
    _check(recorders)


def test_split_kv_launchers_do_not_specialise_on_the_split_count(monkeypatch):
    recorders = _record(monkeypatch, sk, "_split_kv_kernel", "_merge_kernel")
    q, k_cache, v_cache, meta = make_batch([130], [1])  # one decode row (and the padding): programs = rows x S
    args = (meta.block_tables, meta.token_req, meta.token_kv_len, HEAD_DIM**-0.5, 0)
    outs = [ta.attend_triton(q, k_cache, v_cache, *args, num_splits=s) for s in (2, 16, 3)]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-5, rtol=1e-5)
    _check(recorders)
