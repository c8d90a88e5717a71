"""DeepSeek-V3: our MLA + MoE model against transformers' DeepseekV3ForCausalLM on the same random weights
(float32, CPU; yarn RoPE with mscale, q LoRA, grouped routing, shared and dense layers), checkpoints in
both expert layouts, and the two kernels (MLA attention, grouped expert matmul) against their references.

Tolerances: logits 1e-4 absolute (summation order only); Triton against the references 1e-5 in float32
(ieee dots; on CPU they run under the Triton interpreter), 2e-2 in bfloat16.
"""

import pytest
import torch

import draftgraph.ops.splitting  # noqa: F401  (registers the attention ops)
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.config import ModelConfig
from draftgraph.models.moe import route
from draftgraph.ops.mla.forms import MLACost, mla_forward, plan_mla
from draftgraph.ops.moe.op import moe_experts_reference
from draftgraph.ops.moe.triton_moe import align_pairs, moe_experts_triton
from tests.helpers import PagedRunner, tiny_deepseek_model

ATOL = 1e-4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VARIANTS = {
    "v3": {},
    "no-q-lora-default-rope": dict(q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "no-interleave": dict(rope_interleave=False),
}


def build(variant):
    hf = tiny_deepseek_model(**VARIANTS[variant])
    return hf, CausalLM.from_hf(hf)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_full_sequence_logits_match_transformers(variant):
    hf, ours = build(variant)
    assert ours.cfg.mla is not None and ours.cfg.moe is not None
    ids = torch.randint(0, 96, (2, 23))
    with torch.no_grad():
        ref = hf(ids).logits
    runner = PagedRunner(ours.cfg)
    meta, pos = runner.batch([(0, 23), (1, 23)])
    with torch.no_grad():
        hidden, _ = ours(ids.flatten(), pos, meta, runner.cache.layers)
        logits = ours.compute_logits(hidden)
    torch.testing.assert_close(logits.view(2, 23, -1), ref, atol=ATOL, rtol=0)
    # The cache holds the latent and the RoPE key per token, not per-head K/V.
    latent, rope = runner.cache.layers[0]
    assert latent.shape[2:] == (32,) and rope.shape[2:] == (8,)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_then_paged_decode_matches_transformers(variant):
    hf, ours = build(variant)
    ids = torch.randint(0, 96, (1, 21))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    runner = PagedRunner(ours.cfg, block_size=4)
    got = []
    with torch.no_grad():
        meta, pos = runner.batch([(0, 9)])
        hidden, _ = ours(ids[0, :9], pos, meta, runner.cache.layers)
        got.append(ours.compute_logits(hidden, torch.tensor([8])))
        for t in range(9, 21):
            meta, pos = runner.batch([(0, 1)])
            hidden, _ = ours(ids[0, t : t + 1], pos, meta, runner.cache.layers)
            got.append(ours.compute_logits(hidden))
    torch.testing.assert_close(torch.cat(got), ref[8:], atol=ATOL, rtol=0)


def test_checkpoint_with_per_expert_layout_loads(tmp_path):
    """save_pretrained writes one module per expert (the hub layout); both layouts load to the same model."""
    hf, ours = build("v3")
    hf.save_pretrained(tmp_path)
    from_dir = CausalLM.from_pretrained(str(tmp_path))
    for (n1, p1), (n2, p2) in zip(ours.state_dict().items(), from_dir.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_config_errors_name_the_value():
    from tests.helpers import tiny_deepseek_config

    with pytest.raises(ValueError, match="n_routed_experts=8 is not a multiple of n_group=3"):
        ModelConfig.from_hf(tiny_deepseek_config(n_group=3))
    with pytest.raises(ValueError, match="topk_group=5 must lie in"):
        ModelConfig.from_hf(tiny_deepseek_config(topk_group=5))


def test_routing_matches_transformers():
    hf = tiny_deepseek_model()
    gate = hf.model.layers[1].mlp.gate
    x = torch.randn(37, 64)
    with torch.no_grad():
        _, ref_w, ref_ids = gate(x)
        m = CausalLM.from_hf(hf).cfg.moe
        logits = torch.nn.functional.linear(x, gate.weight)
        w, ids = route(logits, gate.e_score_correction_bias, m.top_k, m.n_group, m.topk_group, m.norm_topk_prob,
                       m.routed_scaling_factor)  # fmt: skip
    order_ref, order = ref_ids.sort(dim=1), ids.sort(dim=1)
    assert torch.equal(order_ref.values, order.values)
    torch.testing.assert_close(w.gather(1, order.indices), ref_w.gather(1, order_ref.indices))


# ---- kernels against their references ----------------------------------------------------------------


def test_align_pairs_tiles_each_expert():
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [5, 3]])
    sorted_ids, tile_expert, total, tiles = align_pairs(ids, num_experts=8, bm=4)
    # expert 0: pairs 1, 4; expert 1: 3; expert 3: 0, 2, 5, 7; expert 5: 6 -> 4 padded tiles of 4
    assert int(total) == 16 and tiles == (8 + 8 * 3 + 3) // 4
    assert tile_expert[:4].tolist() == [0, 1, 3, 5]
    assert sorted_ids[:16].tolist() == [1, 4, 8, 8, 3, 8, 8, 8, 0, 2, 5, 7, 6, 8, 8, 8]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_moe_triton_matches_reference(dtype, tol, tokens):
    e, h, inter, k = 8, 64, 32, 3
    gate_up = (torch.randn(e, 2 * inter, h) * 0.1).to(DEVICE, dtype)
    down = (torch.randn(e, h, inter) * 0.1).to(DEVICE, dtype)
    x = torch.randn(tokens, h).to(DEVICE, dtype)
    ids = torch.stack([torch.randperm(e)[:k] for _ in range(tokens)]).to(DEVICE)
    w = torch.rand(tokens, k, device=DEVICE)
    ref = moe_experts_reference(x, gate_up, down, ids, w)
    got = moe_experts_triton(x, gate_up, down, ids, w)
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


class MLAShape:
    num_layers, num_kv_heads, head_dim = 1, 1, 8

    def __init__(self, dtype, rank=32, rope=8):
        self.dtype, self.kv_entry_shapes = dtype, ((rank,), (rope,))


# Prefill past one 64-row tile, chunked prefill, verify-shaped and decode rows, the last row padding.
MLA_STEPS = [[(0, 70), (1, 3)], [(0, 4), (1, 1), (2, 40)], [(0, 1), (1, 36), (2, 1)]]
# The default cost model absorbs everything at these sizes (its fixed cost outweighs any saving). Without
# the fixed cost, with a lower gate and cheaper keys, "auto" splits every step: the 70-, 40- and 36-row
# requests decompress, the 1- to 4-row ones absorb.
SPLIT_COST = MLACost(fixed_us=0.0, gate_rows=16, key_ps=100.0)
PLAN_COST = MLACost(fixed_us=0.0, gate_rows=16)


def mla(q_nope, q_pe, c, pe, latent, rope_c, w_kv_b, meta, form, impl):
    """The op; "auto" runs through mla_forward with SPLIT_COST so the split is exercised."""
    args = (q_nope, q_pe, c, pe, latent, rope_c, w_kv_b, meta.slot_mapping, meta.block_tables, meta.token_req,
            meta.token_kv_len, 0.2)  # fmt: skip
    if form == "auto":
        plan = plan_mla(form, SPLIT_COST, q_nope.shape[1], *args[8:11], latent.shape[1], 64)
        assert plan.absorbed_rows.numel() and plan.decompressed_rows.numel()  # a real split, every step
        return mla_forward(*args, form, impl, SPLIT_COST)
    return torch.ops.draftgraph.mla_attention(*args, form, impl)


@pytest.mark.parametrize("form", ["absorbed", "decompressed", "auto"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_mla_triton_matches_reference(form, dtype, tol):
    """The op end to end (cache write, either form, padding rows) with the Triton kernels against the
    PyTorch references; 20 heads make two head blocks in the absorbed kernel, the second partly masked."""
    heads, rank, rope, nope, head_v = 20, 32, 8, 16, 16
    outs, caches = {}, {}
    for impl in ("reference", "triton"):
        gen = torch.Generator().manual_seed(0)
        w_kv_b = (torch.randn(heads * (nope + head_v), rank, generator=gen) * 0.2).to(DEVICE, dtype)
        runner = PagedRunner(MLAShape(dtype, rank, rope), num_blocks=64, block_size=4, device=DEVICE)
        latent, rope_c = runner.cache.layers[0]
        outs[impl] = []
        for parts in MLA_STEPS:
            meta, _ = runner.batch(parts)
            meta.slot_mapping[-1] = -1  # the last row acts as padding: writes nothing, reads nothing
            meta.token_kv_len[-1] = 0
            t = meta.num_tokens
            q_nope, q_pe, c, pe = (
                torch.randn(*shape, generator=gen).to(DEVICE, dtype)
                for shape in ((t, heads, nope), (t, heads, rope), (t, rank), (t, rope))
            )
            outs[impl].append(mla(q_nope, q_pe, c, pe, latent, rope_c, w_kv_b, meta, form, impl))
        caches[impl] = (latent.clone(), rope_c.clone())
    for a, b in zip(outs["reference"], outs["triton"]):
        assert b.shape[1:] == (heads, head_v)
        assert not b[-1].any()  # the padding row
        torch.testing.assert_close(b.float(), a.float(), atol=tol, rtol=tol)
    for a, b in zip(caches["reference"], caches["triton"]):
        assert torch.equal(a, b)


def test_mla_forms_agree_with_each_other():
    """Same inputs, the reference in each form: the decompressed form is the absorbed one re-associated."""
    heads, rank, rope, nope, head_v = 4, 32, 8, 16, 16
    results = {}
    for form in ("absorbed", "decompressed", "auto"):
        gen = torch.Generator().manual_seed(1)
        w_kv_b = torch.randn(heads * (nope + head_v), rank, generator=gen) * 0.2
        runner = PagedRunner(MLAShape(torch.float32, rank, rope), num_blocks=64, block_size=4)
        latent, rope_c = runner.cache.layers[0]
        results[form] = []
        for parts in MLA_STEPS:
            meta, _ = runner.batch(parts)
            t = meta.num_tokens
            q_nope, q_pe, c, pe = (
                torch.randn(*shape, generator=gen)
                for shape in ((t, heads, nope), (t, heads, rope), (t, rank), (t, rope))
            )
            results[form].append(mla(q_nope, q_pe, c, pe, latent, rope_c, w_kv_b, meta, form, "reference"))
    for form in ("decompressed", "auto"):
        for a, b in zip(results["absorbed"], results[form]):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_auto_form_decompresses_long_requests_only():
    """The planner: shapes alone keep decode / verify absorbed (no host read); past the gate, a request
    decompresses when its saving (causal pairs) outweighs rebuilding its keys: a fresh prompt from 47 rows
    with the default per-pair and per-key costs. Each decompressed request is tiled by 64 rows."""
    from draftgraph.ops.mla.forms import DEFAULT_COST

    runner = PagedRunner(MLAShape(torch.float32), num_blocks=192, block_size=4)

    def plan(parts, form="auto", cost=PLAN_COST):
        meta, _ = runner.batch(parts)
        return plan_mla(form, cost, 16, meta.block_tables, meta.token_req, meta.token_kv_len, 4, 64)

    assert plan([(0, 70), (1, 30), (2, 1)], "absorbed") is None
    p = plan([(3, 70), (4, 30), (5, 1)])  # 101 rows over 3 requests: one may have 99 >= 16
    assert p.decompressed_rows.tolist() == list(range(70))
    assert p.absorbed_rows.tolist() == list(range(70, 101))
    assert p.q_blocks.tolist() == [[0, 64], [64, 70]]
    assert p.key_start.unique().tolist() == [0] and p.kv_len.tolist() == list(range(1, 71))
    blocks = torch.tensor(runner.tables[3].blocks).repeat_interleave(4)[:70]
    assert torch.equal(p.key_slots, blocks * 4 + torch.arange(70) % 4)
    assert plan([(3, 4), (4, 4), (5, 4)]) is None  # verify-shaped: at most 10 rows each, under the gate
    p = plan([(3, 40), (4, 40)])  # chunks after 74 and 34 cached tokens: keys are the whole context
    assert p.absorbed_rows.numel() == 0 and p.key_slots.numel() == 114 + 74
    assert p.key_start.unique().tolist() == [0, 114] and p.q_blocks.tolist() == [[0, 40], [40, 80]]
    assert plan([(6, 40), (7, 40)], cost=DEFAULT_COST) is None  # 16 heads: saving under the fixed cost
    p = plan([(8, 2), (9, 1)], "decompressed")  # forced: every request, however short
    assert p.decompressed_rows.tolist() == [0, 1, 2] and p.absorbed_rows.numel() == 0
    # The workspace cap: rebuilt K/V of 100 bytes per key and room for 80 keys -> the second request absorbs.
    meta, _ = runner.batch([(11, 70), (12, 70)])
    capped = MLACost(fixed_us=0.0, gate_rows=16, workspace_bytes=8000)
    p = plan_mla("auto", capped, 16, meta.block_tables, meta.token_req, meta.token_kv_len, 4, 64, key_bytes=100)
    assert p.decompressed_rows.tolist() == list(range(70)) and p.absorbed_rows.tolist() == list(range(70, 140))
    # One plan per forward: the next layer's call with the same metadata reuses it; a write replans.
    meta, _ = runner.batch([(10, 70)])
    args = (meta.block_tables, meta.token_req, meta.token_kv_len, 4, 64)
    first = plan_mla("auto", PLAN_COST, 16, *args)
    assert plan_mla("auto", PLAN_COST, 16, *args) is first
    assert plan_mla("decompressed", PLAN_COST, 16, *args) is not first  # other settings
    meta.token_kv_len[69] = 70  # same value, but written: the builder refilling the buffer looks like this
    again = plan_mla("auto", PLAN_COST, 16, *args)
    assert again is not first and torch.equal(again.key_slots, first.key_slots)


def check_chunked_logits(hf, ours, device="cpu", atol=ATOL):
    """Two requests: prompts of 38 and 98 tokens in two chunks each, then 6 decode steps; logits against
    transformers run on each sequence alone (with the default cost model, "auto" absorbs at this size)."""
    ids = [torch.randint(0, 96, (1, 44), device=device), torch.randint(0, 96, (1, 104), device=device)]
    with torch.no_grad():
        refs = [hf(x).logits[0] for x in ids]
    runner = PagedRunner(ours.cfg, block_size=4, device=device)
    steps = [[(0, 35), (1, 36)], [(0, 3), (1, 62)]] + [[(0, 1), (1, 1)]] * 6
    done, got = [0, 0], [[], []]
    with torch.no_grad():
        for parts in steps:
            meta, pos = runner.batch(parts)
            x = torch.cat([ids[r][0, done[r] : done[r] + n] for r, n in parts])
            hidden, _ = ours(x, pos, meta, runner.cache.layers)
            logits = ours.compute_logits(hidden)
            row = 0
            for r, n in parts:
                got[r].append(logits[row : row + n])
                done[r], row = done[r] + n, row + n
    for r in range(2):
        torch.testing.assert_close(torch.cat(got[r]), refs[r], atol=atol, rtol=0)


@pytest.mark.parametrize("form", ["absorbed", "decompressed", "auto"])
def test_chunked_prefill_and_decode_match_transformers_in_each_form(form):
    from draftgraph.models.deepseek import set_mla_form

    hf, ours = build("v3")
    assert set_mla_form(ours, form) == 3
    check_chunked_logits(hf, ours)


# ---- the MTP drafter in every mode ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    from tests.copy_drafters import copy_deepseek_mtp

    target = CausalLM.from_hf(tiny_deepseek_model())
    return target, copy_deepseek_mtp(target)


def mode_engine(
    target, drafter, mode, k=3, backend="eager", sizes=(1, 2, 4, 8, 16, 32, 64, 72), artifacts=None, **config
):
    """The engine `generate` runs; `config`: more CompileConfig fields."""
    import draftgraph as dg

    cfg = dg.CompileConfig(
        mode=mode,
        num_speculative_tokens=k,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        capture_sizes=sizes if mode != "NONE" else (),
        compile_backend=backend,
        progress=False,
        **{"gpu_memory_utilization": 0.0, **config},  # on CUDA too: a cache of max_num_seqs requests
    )
    return dg.compile_model(target, drafter, cfg, artifacts=artifacts, strict_artifacts=artifacts is not None)


def run(eng, temperature=0.0, requests=8):
    """Tokens of `requests` ragged requests on `eng`, greedy or sampled (seed i for request i)."""
    import draftgraph as dg
    from tests.test_engine import ragged

    prompts, params, arrivals = ragged(requests)
    if temperature:
        params = [dg.SamplingParams(max_tokens=p.max_tokens, ignore_eos=True, temperature=temperature, seed=i)
                  for i, p in enumerate(params)]  # fmt: skip
    return [o.token_ids for o in eng.generate(prompts, params, arrivals)]


def generate(target, drafter, mode, temperature=0.0, requests=8, **build_args):
    """Tokens of `requests` ragged requests and the engine (mode_engine's arguments in `build_args`)."""
    eng = mode_engine(target, drafter, mode, **build_args)
    return run(eng, temperature, requests), eng


@pytest.fixture(scope="module")
def mode_engines(pair):
    """One engine per mode, built at its first use and shared by the greedy and sampled lossless cases: a build
    traces, and both temperatures run the same graphs."""
    built = {}

    def get(mode):
        if mode not in built:  # FULL: the fused loop inside the one-graph step; FULL_AND_PIECEWISE: auto (unfused)
            built[mode] = mode_engine(*pair, mode, fuse_draft_loop=mode == "FULL")
        return built[mode]

    return get


def test_mtp_drafter_is_a_deepseek_layer_from_the_checkpoint_layout(pair):
    target, drafter = pair
    assert drafter.kind == "mtp" and type(drafter.block).__name__ == "DeepseekLayer"
    assert type(drafter.block.mlp).__name__ == "MoE"  # layer index num_hidden_layers: past the dense layers
    assert drafter.block.mlp.gate_up.shape == (8, 64, 64)  # per-expert weights stacked


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_lossless_in_every_mode(pair, mode_engines, temperature):
    """Greedy: tokens equal plain decoding with the target alone, and transformers' generate() (so every compiled
    mode below is checked against an oracle we did not write). Both: every graph mode gives the tokens of mode NONE
    (sampling noise is per (seed, position), so the path a step takes cannot change them)."""
    from tests.helpers import hf_greedy
    from tests.test_engine import ragged

    target, drafter = pair
    eng = mode_engines("NONE")
    ref = run(eng, temperature)
    if not temperature:  # sampled speculative decoding is lossless in distribution, not token for token
        assert ref == generate(target, None, "NONE", k=0)[0]
        prompts, params, _ = ragged(8)
        few = [0, 3, 6]  # the shortest continuations (4, 6 and 8 tokens): transformers' generate is slow per token
        want = hf_greedy(tiny_deepseek_model(), [prompts[i] for i in few], [params[i].max_tokens for i in few])
        assert [ref[i] for i in few] == want, "transformers"
    assert eng.stats()["accepted_tokens"] > 0  # the copy drafter agrees with the target sometimes: acceptance ran
    for mode in ("PIECEWISE", "FULL", "FULL_AND_PIECEWISE"):
        fuse = mode == "FULL"
        eng = mode_engines(mode)
        out = run(eng, temperature)
        assert out == ref, mode
        c = eng.compiled.counters
        # target: 3 MLA ops -> 4 pieces and its input checks; drafter step: 1 -> 2 pieces and its checks; each
        # fused loop (K = 3): its checks, then per step the drafter's 2 pieces and a token-choice piece
        assert c.traces["target"] == 1 and c.traces["drafter"] == 1
        if fuse:
            assert c.traces["draft_loop"] == 2 and c.pieces == 5 + 3 + 2 * (1 + 3 * 3)
        else:
            assert "draft_loop" not in c.traces and c.pieces == 5 + 3


def test_artifacts_load_without_tracing(pair, tmp_path):
    """Built artifacts of the MTP pair (pieces around the two-output MLA op, FULL graphs, the fused loop)
    load with no trace and no compile, and give the same tokens."""
    from draftgraph.artifacts.store import build_artifacts

    target, drafter = pair
    ref, eng = generate(target, drafter, "FULL_AND_PIECEWISE", sizes=(1, 4, 16, 64))
    build_artifacts(eng, str(tmp_path / "a"))
    got, loaded = generate(target, drafter, "FULL_AND_PIECEWISE", sizes=(1, 4, 16, 64), artifacts=str(tmp_path / "a"))
    assert not loaded.compiled.counters.traces and loaded.compiled.counters.inductor_compiles == 0
    assert got == ref


def test_inductor_pieces_match_eager(pair):
    """The MLA and MoE ops inside Inductor-compiled pieces (CPU): the same tokens as mode NONE."""
    target, drafter = pair
    ref, _ = generate(target, drafter, "NONE")
    out, eng = generate(target, drafter, "PIECEWISE", backend="inductor", sizes=(4, 72))
    assert out == ref
    c = eng.compiled.counters
    # 6 pieces with kernels and 2 input-checks pieces (plain FX); one symbolic compile per unique piece with
    # kernels, whatever the sizes
    assert c.pieces == 8 and c.inductor_compiles == c.unique_pieces - 2 == 6


def test_target_and_mtp_drafter_from_one_checkpoint_directory(tmp_path, pair):
    """The DeepSeek layout: the MTP layer is `model.layers.{num_hidden_layers}.*` in the target's own
    checkpoint. compile_model(dir, dir) detects it, loads both, and generates the in-memory pair's tokens."""
    from safetensors.torch import save_file

    import draftgraph as dg
    from draftgraph.models.builtin import deepseek_layer_weights
    from tests.test_engine import ragged

    hf = tiny_deepseek_model()
    hf.save_pretrained(tmp_path)
    target = CausalLM.from_hf(hf)
    h, p = 64, "model.layers.3."
    w = deepseek_layer_weights(p, target.cfg, torch.Generator().manual_seed(3))
    w.update({p + n: torch.ones(h) for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")})
    w[p + "eh_proj.weight"] = torch.randn(h, 2 * h) * 0.05
    save_file({k: v.contiguous() for k, v in w.items()}, str(tmp_path / "mtp.safetensors"))
    cfg = dg.CompileConfig(
        mode="NONE", num_speculative_tokens=2, max_num_seqs=4, max_num_batched_tokens=64, gpu_memory_utilization=0.0
    )
    from_dir = dg.compile_model(str(tmp_path), str(tmp_path), cfg)
    assert from_dir.drafter.kind == "mtp" and from_dir.target.cfg.moe.num_experts == 8
    prompts, params, _ = ragged(4)
    got = [o.token_ids for o in from_dir.generate(prompts, params)]
    plain = dg.compile_model(target, None, dg.CompileConfig(mode="NONE", max_num_seqs=4, gpu_memory_utilization=0.0))
    assert got == [o.token_ids for o in plain.generate(prompts, params)]  # lossless with a random MTP layer
