"""GPU tier: DeepSeek-V3.2 with the Triton indexer and sparse MLA kernels (ops/sparse_mla/triton_*.py).

1. The kernels at V3.2's sizes (bf16, 64 indexer heads of 128, topk 2048, 512 + 64 latent, 16 heads) against
   the references over a 3000-token context: verify rows (1+K = 4), a prefill chunk, decode rows, padding.
2. Both ops captured in one CUDA graph and replayed with other lengths and inputs: equal to eager references;
   no host sync while capturing or replaying (sync debug mode "error").
3. Greedy tokens of the tiny float32 V3.2 model (top-8 of prompts up to 39 tokens; 16 indexer heads, so exact
   score ties ~never: tests/test_deepseek_v32.py) equal transformers' generate on CUDA in NONE, PIECEWISE and
   FULL_AND_PIECEWISE, without a drafter and with the MTP drafter at K = 3 (and at K = 1 and 5 in
   FULL_AND_PIECEWISE); in FULL_AND_PIECEWISE the uniform
   steps replay the one-graph step (verify, acceptance, the fused draft loop) and nothing falls back; a steady
   uniform step waits on the device once.

Tolerances: bf16 kernels 2e-2 (picks compared as sets, near ties excepted as in tests/test_sparse_mla_triton.py);
float32 graph replays 1e-5; tokens exact.
"""

import dataclasses

import pytest
import torch

import draftgraph as dg
import draftgraph.ops.sparse_mla.op  # noqa: F401  (registers the indexer and sparse MLA ops when run alone)
from draftgraph.models.causal_lm import CausalLM
from tests.helpers import PagedRunner
from tests.test_deepseek_v32 import copy_v32_mtp, tiny_v32_model
from tests.test_engine import ragged

pytestmark = pytest.mark.gpu
SIZES = (1, 2, 4, 8, 16, 32, 64, 72)


class V32Shape:
    """One layer of V3.2's caches: latent 512, RoPE key 64, index key 128 per token."""

    num_layers, num_kv_heads, head_dim = 1, 1, 64

    def __init__(self, dtype):
        self.dtype, self.kv_entry_shapes = dtype, ((512,), (64,), (128,))


def ops(x, meta, caches, topk, impl):
    """The indexer then sparse MLA, as a V3.2 layer calls them; returns (picks, output)."""
    latent, rope, index = caches
    args = (meta.slot_mapping, meta.block_tables, meta.token_req, meta.token_kv_len)
    picks = torch.ops.draftgraph.indexer_topk(x["iq"], x["ik"], x["iw"], index, *args, 128**-0.5, topk, impl)
    out = torch.ops.draftgraph.sparse_mla_attention(
        x["q_nope"], x["q_pe"], x["c"], x["pe"], latent, rope, x["w_kv_b"], picks, *args, 0.07, impl
    )
    return picks, out


def inputs(t, gen, dtype, heads=16):
    shapes = dict(iq=(t, 64, 128), ik=(t, 128), iw=(t, 64), q_nope=(t, heads, 128), q_pe=(t, heads, 64), c=(t, 512),
                  pe=(t, 64), w_kv_b=(heads * 256, 512))  # fmt: skip
    x = {k: torch.randn(*s, generator=gen).cuda() for k, s in shapes.items()}
    x["w_kv_b"] *= 0.05
    return {k: v if k == "iw" else v.to(dtype) for k, v in x.items()}  # head weights stay float32


def check_picks(got, want, x, meta, index_cache, topk):
    """Rows as sets, equal to the reference's except within rounding of a tie at the boundary (scores summed
    in another order): there, no unpicked position may score above a picked one (float64 scores) beyond 1e-4
    relative; at most 1 % of the rows may be such."""
    n_valid = torch.minimum(meta.token_kv_len.long(), torch.tensor(topk, device="cuda"))
    assert torch.equal((got >= 0).sum(1), n_valid) and torch.equal((want >= 0).sum(1), n_valid)
    differ = (got.sort(dim=1).values != want.sort(dim=1).values).any(1).nonzero().flatten().tolist()
    assert len(differ) <= max(1, got.shape[0] // 100), differ
    flat = index_cache.view(-1, index_cache.shape[-1])
    page = index_cache.shape[1]
    for t in differ:
        n = int(meta.token_kv_len[t])
        table = meta.block_tables[int(meta.token_req[t])].long()
        pos = torch.arange(n, device="cuda")
        keys = flat[table[pos // page] * page + pos % page].double()  # [n, Di]
        s = x["iw"][t].double() @ torch.relu(x["iq"][t].double() @ keys.T * 128**-0.5)  # [n]
        picked = torch.zeros(n, dtype=torch.bool, device="cuda")
        picked[got[t][got[t] >= 0].long()] = True
        assert s[~picked].max() <= s[picked].min() + 1e-4 * s.abs().max(), t


def test_kernels_at_deepseek_v32_sizes():
    """3000 and 2500 cached tokens (a 5540-row prefill batch), then a verify batch (1+3 rows), a 300-row
    prefill chunk, a decode row and a padding row: topk 2048 < most visible lengths, so the radix select runs
    on thousands of rows; the short request picks all its positions."""
    outs, caches = {}, {}
    for impl in ("reference", "triton"):
        runner = PagedRunner(V32Shape(torch.bfloat16), num_blocks=400, block_size=16, max_tokens=6144, device="cuda")
        caches[impl] = runner.cache.layers[0]
        gen = torch.Generator().manual_seed(0)
        outs[impl] = []
        for parts in ([(0, 3000), (1, 40), (2, 2500)], [(0, 4), (1, 300), (2, 1), (3, 1)]):
            meta, _ = runner.batch(parts)
            if len(parts) == 4:
                meta.slot_mapping[-1], meta.token_kv_len[-1] = -1, 0
            # the runner refills the same buffers for the next batch: keep this batch's own copy to check against
            meta = dataclasses.replace(
                meta,
                **{
                    f.name: v.clone()
                    for f in dataclasses.fields(meta)
                    if isinstance(v := getattr(meta, f.name), torch.Tensor)
                },
            )
            x = inputs(meta.num_tokens, gen, torch.bfloat16)
            outs[impl].append((x, meta, *ops(x, meta, caches[impl], 2048, impl)))
    for ref, tri in zip(caches["reference"], caches["triton"]):
        assert torch.equal(ref, tri)  # latent, RoPE key and index key written alike
    for (x, meta, p_ref, o_ref), (_, _, p_tri, o_tri) in zip(outs["reference"], outs["triton"]):
        check_picks(p_tri, p_ref, x, meta, caches["triton"][2], 2048)
        torch.testing.assert_close(o_tri.float(), o_ref.float(), atol=2e-2, rtol=2e-2)
    assert (p_tri[-1] == -1).all() and not o_tri[-1].any()  # the padding row


def test_kernels_capture_and_replay_without_host_sync():
    """Both ops in one CUDA graph (a mixed batch: verify rows, a chunk, decode rows, one of them padding at the
    first replay), replayed after the lengths and inputs change in place: equal to the references run eagerly
    on the same state. Capture and replays run under sync debug mode "error"."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_runner, runner = (
        PagedRunner(V32Shape(torch.float32), num_blocks=64, block_size=16, max_tokens=512, device="cuda")
        for _ in range(2)
    )
    gen = torch.Generator().manual_seed(1)
    for r in (ref_runner, runner):
        r.batch([(0, 300), (1, 200)])  # cached prefixes (positions only: the caches hold zeros there)
    ref_meta, meta = (r.batch([(0, 4), (1, 6), (2, 1), (3, 1)])[0] for r in (ref_runner, runner))
    x = inputs(12, gen, torch.float32)
    fresh = [inputs(12, gen, torch.float32) for _ in range(2)]
    last = (meta.token_kv_len[-1:].clone(), meta.slot_mapping[-1:].clone())
    ops(x, meta, runner.cache.layers[0], 64, "triton")  # warm-up: the kernels compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            picks, out = ops(x, meta, runner.cache.layers[0], 64, "triton")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for step, new in enumerate(fresh):
        for name, v in x.items():
            v.copy_(new[name])
        kv_len, slot = last if step else (torch.zeros_like(last[0]), -torch.ones_like(last[1]))
        meta.token_kv_len[-1:].copy_(kv_len)  # the last row: padding, then a decode row
        meta.slot_mapping[-1:].copy_(slot)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        ref_meta.token_kv_len.copy_(meta.token_kv_len)
        ref_meta.slot_mapping.copy_(meta.slot_mapping)
        want_picks, want = ops(x, ref_meta, ref_runner.cache.layers[0], 64, "reference")
        check_picks(picks, want_picks, x, meta, runner.cache.layers[0][2], 64)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        if step == 0:
            assert (picks[-1] == -1).all() and not out[-1].any()


@pytest.fixture(scope="module")
def hf():
    torch.backends.cuda.matmul.allow_tf32 = False
    return tiny_v32_model().cuda()


@pytest.fixture(scope="module")
def target(hf):
    return CausalLM.from_hf(hf, attn_impl="triton")


def transformers_greedy() -> list:
    """transformers' greedy generate on CUDA, one prompt at a time (run in a side process when the tier starts
    one: tests/gpu/side_process.py)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = tiny_v32_model().cuda()
    prompts, params, _ = ragged(8)
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0
    outs = []
    for prompt, p in zip(prompts, params):
        ids = torch.tensor([prompt], device="cuda")
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=p.max_tokens, min_new_tokens=p.max_tokens)  # fmt: skip
        outs.append(out[0, len(prompt) :].tolist())
    return outs


@pytest.fixture(scope="module")
def reference(side_reference):
    return side_reference(transformers_greedy)


def generate(target, drafter, mode, backend="eager", k=3):
    """8 ragged requests through 4 slots (continuous batching), K = k with a drafter."""
    prompts, params, arrivals = ragged(8)
    cfg = dg.CompileConfig(
        mode=mode, num_speculative_tokens=k if drafter else 0, max_num_seqs=4, max_num_batched_tokens=64,
        device="cuda", gpu_memory_utilization=0.0, capture_sizes=SIZES if mode != "NONE" else (),
        full_capture_sizes=(1, 2, 4), compile_backend=backend, progress=False, check_addresses=True,
    )  # fmt: skip
    eng = dg.compile_model(target, drafter, cfg)
    return [o.token_ids for o in eng.generate(prompts, params, arrivals)], eng


def none_runs() -> dict:
    """Mode NONE without and with the MTP drafter (in a side process beside the tier: tests/gpu/side_process.py)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    target = CausalLM.from_hf(tiny_v32_model().cuda(), attn_impl="triton")
    return {"plain": generate(target, None, "NONE")[0], "mtp": generate(target, copy_v32_mtp(target), "NONE")[0]}


@pytest.mark.side_reference.with_args(transformers_greedy)
@pytest.mark.side_reference.with_args(none_runs)
@pytest.mark.parametrize("with_drafter", [False, True])
def test_greedy_equals_transformers_in_every_mode(target, reference, side_reference, with_drafter):
    """With the drafter, Inductor compiles the FULL_AND_PIECEWISE pieces (the indexer op inside them, the
    fused draft loop); the other runs use the eager backend (the kernels and graphs are under test there, and
    one Inductor compile keeps the file near a minute). Mode NONE runs beside the tier."""
    drafter = copy_v32_mtp(target) if with_drafter else None
    assert side_reference(none_runs)["mtp" if with_drafter else "plain"] == reference, "NONE"
    for mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):
        backend = "inductor" if mode == "FULL_AND_PIECEWISE" and with_drafter else "eager"
        out, eng = generate(target, drafter, mode, backend)
        assert out == reference, mode
        s = eng.stats()
        assert s["fallbacks"] == 0, s["fallbacks_by_key"]
        if with_drafter:
            assert s["accepted_tokens"] > 0
        if mode == "FULL_AND_PIECEWISE":
            q = 4 if with_drafter else 1
            # uniform steps: the whole step (verify of 1+K rows per request, acceptance, K draft steps) as one
            # graph; mixed steps: piece graphs
            assert any(k.startswith(f"step/q{q}/") and v > 0 for k, v in s["dispatch"].items()), s["dispatch"]
            assert any("/piecewise/" in k for k in s["dispatch"]), s["dispatch"]
        print(f"V3.2 drafter={with_drafter} {mode}: acceptance {s['acceptance_histogram']}, {s['dispatch']}")


@pytest.mark.side_reference.with_args(transformers_greedy)
@pytest.mark.parametrize("k", [1, 5])
def test_mtp_at_other_draft_lengths(target, reference, k):
    """The MTP drafter at K = 1 and 5 in FULL_AND_PIECEWISE: the same tokens, one-graph steps, no fallback."""
    out, eng = generate(target, copy_v32_mtp(target), "FULL_AND_PIECEWISE", k=k)
    assert out == reference
    s = eng.stats()
    assert s["fallbacks"] == 0, s["fallbacks_by_key"]
    assert any(key.startswith(f"step/q{k + 1}/") and n > 0 for key, n in s["dispatch"].items()), s["dispatch"]
    print(f"V3.2 K={k}: acceptance {s['acceptance_histogram']}, {s['dispatch']}")


def test_steady_uniform_step_is_one_graph_and_one_wait(target):
    """4 requests decoding with the MTP drafter at K = 3: each step replays "step/q4/b4/greedy" once and waits
    on the device once (the packed result of the step before it: steps overlap), with no other sync (sync debug
    mode "error")."""
    cfg = dg.CompileConfig(
        mode="FULL_AND_PIECEWISE", num_speculative_tokens=3, max_num_seqs=4, max_num_batched_tokens=64,
        device="cuda", gpu_memory_utilization=0.0, progress=False, compile_backend="eager",
    )  # fmt: skip
    eng = dg.compile_model(target, copy_v32_mtp(target), cfg)
    params = dg.SamplingParams(max_tokens=40, ignore_eos=True)
    for i in range(4):
        eng.add_request([1 + i, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], params)  # 12 > top-8: the select runs
    eng.step()  # the prefill (a mixed batch)
    host = eng.runner.host
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for i in range(4):
            before = host.waits
            eng.step()
            assert host.waits == before + (i > 0)  # overlapped: the first is only launched, then one wait each
            assert eng._pending is not None  # the next step is queued before the last is read
    finally:
        torch.cuda.set_sync_debug_mode(0)
    hits = eng.runner.forwards.hits
    assert hits["step/q4/b4/greedy"] == 4, dict(hits)
    assert eng.stats()["fallbacks"] == 0
