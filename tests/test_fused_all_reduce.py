"""The one-row all-reduce fused into the GEMVs around it (ops/collectives/fused.py) under the Triton interpreter: two
forked processes as two ranks over one shared CPU buffer (as tests/test_peer_all_reduce.py runs the push kernels).
Each rank makes the same calls in the same order: a fused pair (the row-parallel GEMV that sends, then the norm GEMV
that sums, or on every other call the reader kernel and the plain norm GEMV: FusedRule.reader), then the same sum by
the standalone lamport or push kernel and add_rms_norm's GEMV on it (the reference, and the standalone kernels
interleaved with the fused pair's slots and epoch), over mixed widths, dtypes, tilings, -0.0 partials, the whole
sequence twice (a replay). The fused pair's outputs equal the reference bit for bit on every
call; the layout's fused region; the ops' fakes and their one-process fallback. The kernels on a GPU and the model
wiring are not run here (tests/gpu/ and scripts/bench_tp.py --fuse-all-reduce)."""

import os

import pytest
import torch
import torch.multiprocessing as mp

from draftgraph.ops.collectives.push import ALIGN, PushAllReduce, PushLayout, prepare
from tests.helpers import join_forked

KIB = 1024
JOIN_S = 600
EPS = 1e-5
# (hidden H, the sender's K, the reader's N, dtype, silu_mul, tiled): tiled = small tiles (several K chunks and
# programs), else choose_config's
CALLS = [
    (64, 48, 24, torch.float32, False, True),
    (100, 32, 40, torch.float16, True, True),
    (256, 16, 8, torch.float32, False, False),
    (16, 64, 72, torch.float16, False, True),
    (512, 8, 4, torch.float16, False, False),
    (40, 24, 16, torch.float32, True, True),
    (128, 40, 33, torch.float16, False, True),
]
REPLAYS = 2


def _inputs():
    g = torch.Generator().manual_seed(0)
    calls = []
    for i, (h, k, n, dt, silu, _) in enumerate(CALLS * REPLAYS):
        per_rank = []
        for rank in range(2):
            x = torch.randn(1, 2 * k if silu else k, generator=g)
            w = torch.randn(h, k, generator=g) / k**0.5
            if i % 2 == rank and dt == torch.float16 and not silu:
                # every fifth column a tiny negative float32 sum, rounded to -0.0 (the sentinel: sent as +0.0; the
                # GEMV's float32 sums start at +0.0, so only the rounding to a 2-byte dtype makes a -0.0)
                x = torch.full_like(x, 6e-8)
                w[::5] = -1e-3
            r = torch.randn(1, h, generator=g)
            nw = 1 + 0.1 * torch.randn(h, generator=g)
            w2 = torch.randn(n, h, generator=g) / h**0.5
            b = torch.randn(n, generator=g) if i % 3 == 0 else None
            per_rank.append(tuple(t if t is None else t.to(dt) for t in (x, w, r, nw, w2, b)))
        calls.append(per_rank)
    return calls


def _rank(rank, whole, span, layout, calls, results, bad):
    from draftgraph.ops.collectives.fused import all_reduce_norm_gemv_triton, gemv_send_triton, lamport_read_triton
    from draftgraph.ops.linear.triton_gemv import (
        GemvConfig,
        add_rms_norm_gemv_triton,
        choose_config,
        gemv_triton,
        silu_mul_gemv_triton,
    )

    shares = [whole[r * span : r * span + layout.end] for r in range(2)]
    push = PushAllReduce(layout, rank, shares[rank], [s.data_ptr() for s in shares])
    for i, per_rank in enumerate(calls):
        h, k, n, dt, silu, tiled = CALLS[i % len(CALLS)]
        x, w, r, nw, w2, b = per_rank[rank]
        small = GemvConfig(block_n=4, block_k=16, num_warps=4)
        send_cfg = small if tiled else choose_config(1, k, silu_mul=silu)
        norm_cfg = small if tiled else choose_config(1, h, norm=True)
        y = gemv_send_triton(x, w, push, send_cfg, silu_mul=silu)
        if i % 2:  # FusedRule.reader "kernel": the reader kernel (small blocks: several programs), then the norm GEMV
            summed_fused = lamport_read_triton(y, push, block=16 if tiled else 1024)
            s, out = add_rms_norm_gemv_triton(summed_fused, r, nw, EPS, w2, b, norm_cfg)
        else:  # "gemv": inside the norm GEMV
            s, out = all_reduce_norm_gemv_triton(y, r, nw, EPS, w2, b, push, norm_cfg)
        # the reference: the plain GEMV, a standalone all-reduce (lamport, push: their own slots), add_rms_norm's GEMV
        y_ref = silu_mul_gemv_triton(x, w, None, send_cfg) if silu else gemv_triton(x, w, None, send_cfg)
        summed = push.all_reduce(y_ref.contiguous(), ("lamport", "push")[i % 3 == 2])
        s_ref, out_ref = add_rms_norm_gemv_triton(summed, r, nw, EPS, w2, b, norm_cfg)
        bits = torch.int32 if dt == torch.float32 else torch.int16
        for j, (got, want) in enumerate(((y, y_ref), (s, s_ref), (out, out_ref))):
            if not torch.equal(got.view(bits), want.view(bits)):
                bad[rank, i, j] = 1
        results[rank, i, 0, :h] = y.float()
        results[rank, i, 1, :h] = s.float()
        results[rank, i, 2, :n] = out.float()
    results[rank, -1, 0, :4] = push.fused_state.float()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors need the Triton interpreter")
def test_fused_pair_equals_lamport_then_norm_gemv_two_forked_ranks():
    layout = PushLayout(2, 2 * KIB, max_programs=8, bytes_per_program=1024, fused_bytes=2 * KIB)
    span = -(-layout.end // ALIGN) * ALIGN
    raw = torch.zeros(2 * span + ALIGN, dtype=torch.uint8).share_memory_()
    off = (-raw.data_ptr()) % ALIGN
    whole = raw[off : off + 2 * span]
    for r in range(2):
        prepare(whole[r * span : r * span + layout.end], layout)
    calls = _inputs()
    results = torch.full((2, len(calls) + 1, 3, 512), float("nan")).share_memory_()
    bad = torch.zeros((2, len(calls), 3), dtype=torch.int32).share_memory_()
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_rank, args=(r, whole, span, layout, calls, results, bad)) for r in range(2)]
    for p in procs:
        p.start()
    join_forked(procs, JOIN_S, "a row was lost")
    # bit for bit against the plain GEMV, the standalone all-reduce and add_rms_norm's GEMV, every call, both ranks
    assert bad.sum().item() == 0, bad.nonzero().tolist()
    for i in range(len(calls)):
        h, _, _, dt, _, _ = CALLS[i % len(CALLS)]
        y0, y1 = (results[rank, i, 0, :h].to(dt) for rank in range(2))
        for rank in range(2):  # s = (y0 + y1 in float32, rounded) + the residual, rounded: the same on both ranks
            r = calls[i][rank][2][0]
            want = ((y0.float() + y1.float()).to(dt).float() + r.float()).to(dt)
            assert torch.equal(results[rank, i, 1, :h].to(dt), want), (i, rank)
        if dt == torch.float16 and not CALLS[i % len(CALLS)][4]:  # the sender's -0.0 columns (sent as +0.0)
            assert bool((torch.signbit(results[i % 2, i, 0, :h:5]) & (results[i % 2, i, 0, :h:5] == 0)).all()), i
    # the last call's reader was the kernel (odd): it re-armed its own rows and left none to the next reader
    assert len(calls) % 2 == 0
    assert results[:, -1, 0, :4].tolist() == [[len(calls), 0, 0, 0]] * 2
    for rank in range(2):  # every fused row re-armed
        share = whole[rank * span : rank * span + layout.end]
        for size, bits in ((2, torch.int16), (4, torch.int32)):
            rows = share[layout.fused_at(size) : layout.fused_at(size) + layout.fused_rows_bytes].view(bits)
            assert bool((rows == torch.iinfo(bits).min).all()), (rank, size)


def test_fused_region_lies_after_the_flags_and_only_when_asked():
    plain = PushLayout(2, 16 * KIB, offset=1024 * KIB)
    fused = PushLayout(2, 16 * KIB, offset=1024 * KIB, fused_bytes=64 * KIB)
    assert fused.flags_at == plain.flags_at and plain.fused_rows_bytes == 0
    assert fused.fused_at(2) >= plain.end and fused.fused_at(2) % ALIGN == 0
    assert fused.fused_at(4) == fused.fused_at(2) + 3 * 2 * 64 * KIB and fused.end == fused.fused_at(4) + 6 * 64 * KIB
    with pytest.raises(ValueError, match="fused_bytes"):
        PushLayout(2, 16 * KIB, fused_bytes=100)


def test_fused_ops_fakes_and_one_process_fallback():
    """The ops' fakes shape like the plain ops'; without a peer (one process, the CPU) the writer is the plain
    linear and the reader add_rms_norm_linear of the copy the all_reduce op returns."""
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode

    import draftgraph.ops.collectives.fused  # noqa: F401  (registers the ops)
    from draftgraph.ops.norm.op import rms_norm_reference

    with FakeTensorMode():
        x, w = torch.empty(3, 8), torch.empty(16, 8)
        assert torch.ops.draftgraph.linear_send(x, w, "", False).shape == (3, 16)
        assert torch.ops.draftgraph.linear_send(torch.empty(3, 16), w, "", True).shape == (3, 16)
        s, y = torch.ops.draftgraph.all_reduce_add_rms_norm_linear(
            torch.empty(3, 16), torch.empty(3, 16), torch.empty(16), 1e-5, torch.empty(4, 16), None, ""
        )
        assert s.shape == (3, 16) and y.shape == (3, 4)
        with pytest.raises(ValueError, match="linear_send takes x"):
            torch.ops.draftgraph.linear_send(x, torch.empty(16, 4), "", False)
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 8, generator=g), torch.randn(16, 8, generator=g)
    y = torch.ops.draftgraph.linear_send(x, w, "", False)
    assert torch.equal(y, F.linear(x, w))
    gu = torch.randn(2, 16, generator=g)
    assert torch.equal(torch.ops.draftgraph.linear_send(gu, w, "", True), F.linear(F.silu(gu[:, :8]) * gu[:, 8:], w))
    r, nw, w2 = torch.randn(2, 16, generator=g), torch.randn(16, generator=g), torch.randn(4, 16, generator=g)
    s, out = torch.ops.draftgraph.all_reduce_add_rms_norm_linear(y, r, nw, 1e-5, w2, None, "")
    assert torch.equal(s, y + r) and torch.equal(out, F.linear(rms_norm_reference(y + r, nw, 1e-5), w2))


# ----------------------------------------------------------------------------------- the model's wiring, TP 2 gloo
def _check_wiring(tp):
    """Rank body: a tiny Llama at TP 2 with fuse_all_reduce equals it without, bit for bit, and the one process,
    with the layers' CUDA-only paths (sums in norms, norms in projections) forced on the CPU: the fused ops then
    run their unfused path (the all_reduce op over gloo), so this checks which partial goes where (o_proj, down,
    the next layer's input norm, the final norm's plain all_reduce, an aux layer's sum) and the ops' counts."""
    from unittest import mock

    from torch.utils._python_dispatch import TorchDispatchMode

    from draftgraph.models.causal_lm import CausalLM
    from draftgraph.models.layers import DecoderLayer
    from draftgraph.ops.choices import OpChoices
    from tests.helpers import PagedRunner, tiny_hf_model
    from tests.test_tensor_parallel import SHAPE

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            if name.startswith("draftgraph."):
                self.names[name] = self.names.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    hf = tiny_hf_model("llama", **SHAPE)
    unfused, fused = OpChoices(fuse_all_reduce=False), OpChoices(fuse_all_reduce=True)
    models = [CausalLM.from_hf(hf, tp=tp, ops=unfused), CausalLM.from_hf(hf, tp=tp, ops=fused)]
    layers = models[0].cfg.num_layers
    ids = torch.randint(0, models[0].cfg.vocab_size, (1,), generator=torch.Generator().manual_seed(1))
    outs, counts = [], []
    with (
        mock.patch.object(CausalLM, "sums_in_norms", lambda self, h: True),
        mock.patch.object(DecoderLayer, "norms_in_projections", lambda self, residual: True),
    ):
        for model in models:
            runner = PagedRunner(model.cfg)
            meta, pos = runner.batch([(0, 1)])
            with torch.no_grad(), Count() as count:
                hidden, aux = model(ids, pos, meta, runner.cache.layers, aux_layers=(0,))
            outs.append((hidden, aux[0]))
            counts.append(count.names)
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert "draftgraph.linear_send" not in counts[0], counts[0]
    on = counts[1]
    # o_proj and down of every layer but the last's down: no reader follows it (the final norm's plain all-reduce
    # sums it), so it sends nothing into the fused rows (a send no reader consumes leaves data the next step's
    # reader of that slot would read: the tokens of a TP 2 engine changed on the GPU)
    assert on["draftgraph.linear_send"] == 2 * layers - 1, on
    assert on["draftgraph.all_reduce_add_rms_norm_linear"] == 2 * layers - 1, on  # every norm after a partial
    # the embedding's, the aux layer's and the last down's (plain); the fused ones' fallback runs inside their op
    assert on["draftgraph.all_reduce"] == 3, on
    assert counts[0]["draftgraph.all_reduce"] == 1 + 2 * layers, counts[0]


def test_model_wiring_tp2_gloo_fused_equals_unfused(tmp_path):
    from tests.test_tensor_parallel import spawn

    spawn(_check_wiring, 2, tmp_path)
