"""Qwen3.5 hybrids (Gated DeltaNet + gated attention, dense and MoE) against transformers' generate, the
state rings' rollback, and the checkpoint layouts. Tiny random float32 models; tokens must be equal, states
within 1e-5 (float32 arithmetic in a different order)."""

import pytest
import torch
import transformers

import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.config import ModelConfig
from draftgraph.models.drafters.loader import truncated_draft_model
from draftgraph.runtime.attn_metadata import MetadataBuilder, RequestSlice
from draftgraph.runtime.kv_cache import KVCacheSpec, PagedKVCache
from draftgraph.runtime.state_cache import StateCache, StateCacheSpec

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
SMALL = dict(vocab_size=96, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=8, max_position_embeddings=256, layer_types=LAYER_TYPES)  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=40)


def tiny_qwen3_5(moe: bool = False, seed: int = 0):
    """transformers' Qwen3_5(Moe)ForCausalLM with random weights, norms and gates randomized too."""
    torch.manual_seed(seed)
    if moe:
        model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**SMALL, **MOE))
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**SMALL, intermediate_size=96))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "dt_bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def prompts_and_params():
    """Five prompts (one of 77 tokens: three chunks of 32), 10 tokens each."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 40, 77, 12, 3)]
    return prompts, dg.SamplingParams(max_tokens=10, ignore_eos=True)


def hf_generate(hf) -> list[list[int]]:
    prompts, params = prompts_and_params()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=params.max_tokens, min_new_tokens=params.max_tokens)  # fmt: skip
        out.append(ref[0, len(p) :].tolist())
    return out


def run(target, drafter=None, mode="NONE", k=3):
    """Our tokens: 2 requests at a time (continuous batching), chunks of 32 tokens."""
    prompts, params = prompts_and_params()
    cfg = dg.CompileConfig(mode=mode, num_speculative_tokens=k, max_num_seqs=2, max_num_batched_tokens=32,
                           capture_sizes=(4, 8, 16, 32) if mode != "NONE" else (), compile_backend="eager",
                           progress=False)  # fmt: skip
    eng = dg.compile_model(target, drafter, cfg)
    return [o.token_ids for o in eng.generate(prompts, params)], eng


@pytest.fixture(scope="module")
def dense():
    hf = tiny_qwen3_5()
    return hf, CalledOnce(hf)


class CalledOnce:
    """The target and transformers' tokens, built once per module."""

    def __init__(self, hf):
        self.target = CausalLM.from_hf(hf)
        self.ref = hf_generate(hf)


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE"])
def test_target_matches_transformers_generate(dense, mode):
    _, d = dense
    out, eng = run(d.target, mode=mode)
    assert out == d.ref
    if mode == "PIECEWISE":  # 4 splitting ops (3 gated_delta_net, 1 paged_attention) -> 5 pieces + input checks
        assert eng.compiled.counters.pieces == 6


def test_moe_target_matches_transformers_generate():
    hf = tiny_qwen3_5(moe=True)
    target = CausalLM.from_hf(hf)
    assert type(target.layers[0].mlp).__name__ == "QwenMoE" and target.layers[0].mlp.gate_up.shape == (4, 48, 64)
    assert run(target)[0] == hf_generate(hf)


@pytest.mark.parametrize("mode", ["NONE", "FULL_AND_PIECEWISE"])
def test_truncated_draft_model_is_lossless(dense, mode):
    """A 2-layer prefix of the target (two Gated DeltaNet layers and the attention layer... its own state
    rings) drafts K = 3: rejections at every depth, tokens equal to the target's alone."""
    _, d = dense
    out, eng = run(d.target, truncated_draft_model(d.target, 2), mode=mode)
    assert out == d.ref
    hist = eng.stats()["acceptance_histogram"]
    assert sum(hist[:3]) > 0 and hist[3] > 0  # both rejections and full acceptance happened


def _forward(target, cache, builder, ids, num_cached, block_table):
    meta, positions = builder.build([RequestSlice(block_table, num_cached, len(ids))])
    return target(torch.tensor(ids), positions, meta, cache.layers)[0]


def _cache(target, ring: int):
    cfg = target.cfg
    spec = KVCacheSpec.for_model(cfg, cfg.num_layers, 16, 4)
    cache = PagedKVCache(spec, "cpu")
    cache.state = StateCache(StateCacheSpec.for_model(cfg, spec.linear_layers, 2, ring), 16, "cpu")
    for i in spec.linear_layers:
        cache.layers[i] = cache.state.layer(i)
    cache.state.block_rows[3] = 1  # the request's first block (3) -> state row 1
    return cache


def test_a_reserved_block_map_keeps_its_size_and_address_as_the_cache_grows():
    """A KV cache growing in place (CUDA VMM) under graphs captured on its probe: the state block map is the whole
    reservation from the start, so those graphs' gather of a block id past the probe's size stays in bounds (a view
    of num_blocks failed compiled code's bounds check on the H200: a device-side assert)."""
    spec = StateCacheSpec((0, 2), num_rows=3, ring=4, conv_ring=6, conv_dim=8, num_v_heads=2, head_k_dim=4,
                          head_v_dim=4, dtype=torch.float32)  # fmt: skip
    state = StateCache(spec, num_blocks=5, device="cpu", reserve_blocks=64)
    before = state.block_rows
    state.block_rows[40] = 2
    state.resize_blocks(48)
    assert state.block_rows.shape == (64,) and state.block_rows.data_ptr() == before.data_ptr()
    assert not state.block_rows.any()  # a resize starts every map entry afresh
    assert StateCache(spec, num_blocks=5, device="cpu").block_rows.shape == (5,)  # no reservation: num_blocks


@pytest.mark.parametrize("accepted", [0, 1, 2, 3])
def test_rejection_leaves_the_state_of_the_accepted_tokens(dense, accepted):
    """A verify of 1 + K tokens, `accepted` drafts accepted: the state the next forward starts from (ring entry
    of the last accepted position, and the conv inputs before it) equals a fresh run over the accepted tokens
    only, and so does that next forward's output."""
    _, d = dense
    target, k = d.target, 3
    ring = k + 1
    table, builder = [3, 5, 7, 9], MetadataBuilder(64, 2, 4, 4, "cpu")
    g = torch.Generator().manual_seed(accepted)
    prompt, verify, nxt = (torch.randint(0, 96, (n,), generator=g).tolist() for n in (9, 1 + k, 1))
    cache = _cache(target, ring)
    with torch.no_grad():
        _forward(target, cache, builder, prompt, 0, table)
        _forward(target, cache, builder, verify, len(prompt), table)
        kept = prompt + verify[: accepted + 1]
        fresh = _cache(target, ring)
        _forward(target, fresh, builder, kept, 0, table)
        last = len(kept) - 1  # the last accepted position
        for i in cache.spec.linear_layers:
            conv, ssm, _ = cache.state.layer(i)
            conv_f, ssm_f, _ = fresh.state.layer(i)
            torch.testing.assert_close(ssm[1, last % ring], ssm_f[1, last % ring], atol=1e-5, rtol=1e-5)
            lc = conv.shape[1]
            cols = [p % lc for p in range(last - 2, last + 1)]  # the W - 1 = 3 inputs the next conv reads
            torch.testing.assert_close(conv[1, cols], conv_f[1, cols], atol=1e-5, rtol=1e-5)
        out = _forward(target, cache, builder, nxt, len(kept), table)
        ref = _forward(target, fresh, builder, nxt, len(kept), table)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_configs_and_checkpoint_layouts(tmp_path):
    """The multimodal wrapper config (text part in text_config) and its key layout (`model.language_model.*`,
    vision and MTP keys, experts one module each) load the same weights as the in-memory model."""
    hf = tiny_qwen3_5(moe=True)
    wrapper = transformers.Qwen3_5MoeConfig(text_config=hf.config.to_dict()).to_dict()
    cfg = ModelConfig.from_hf(wrapper)
    assert cfg == CausalLM.from_hf(hf).cfg.replace(eos_token_ids=cfg.eos_token_ids)
    assert cfg.hybrid.linear_layers == (0, 2, 3) and cfg.rotary_dim == 4 and cfg.hybrid.moe.top_k == 2
    state = {}
    for key, t in hf.state_dict().items():
        key = key.replace("model.", "model.language_model.", 1)
        if key.endswith("experts.gate_up_proj"):
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2)
                state[key.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate
                state[key.replace("gate_up_proj", f"{e}.up_proj.weight")] = up
        elif key.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                state[key.replace("down_proj", f"{e}.down_proj.weight")] = t[e]
        else:
            state[key] = t
    state.update({"mtp.fc.weight": torch.zeros(64, 128), "model.visual.patch.weight": torch.zeros(3)})
    ours = CausalLM.from_state_dict(cfg, state).state_dict()
    mine = CausalLM.from_hf(hf).state_dict()
    assert ours.keys() == mine.keys() and all(torch.equal(ours[k], mine[k]) for k in ours)
    with pytest.raises(ValueError, match="layer_types holds"):
        ModelConfig.from_hf({**hf.config.to_dict(), "layer_types": ["linear_attention", "mamba", "x", "y"]})


def test_checkpoint_directory(dense, tmp_path):
    hf, d = dense
    hf.save_pretrained(tmp_path / "q")
    target = CausalLM.from_pretrained(str(tmp_path / "q"))
    assert run(target, k=0)[0] == d.ref


@pytest.mark.parametrize("k", [1, 3, 5])
def test_mtp_drafter_is_lossless(dense, k):
    """The MTP head in its checkpoint layout (`mtp.*`, random weights): one gated-attention layer, the target's
    embedding and head, paged KV only; tokens equal the target's alone at every K."""
    from draftgraph.models.builtin import builtin_drafter

    _, d = dense
    drafter = builtin_drafter("mtp", d.target)
    assert type(drafter).__name__ == "Qwen3_5MTPDrafter" and type(drafter.block.attn).__name__ == "GatedAttention"
    out, eng = run(d.target, drafter, k=k)
    assert out == d.ref and eng.stats()["verify_steps"] > 0


def test_preemption_restarts_the_state(dense):
    """A cache too small for all four running requests: preempted ones recompute from position 0 (a zero
    state, a new first block mapped to their row) and the tokens stay transformers'."""
    _, d = dense
    prompts, params = prompts_and_params()
    cfg = dg.CompileConfig(num_speculative_tokens=3, max_num_seqs=4, max_num_batched_tokens=32, block_size=4,
                           num_kv_blocks=34, progress=False)  # fmt: skip
    eng = dg.compile_model(d.target, truncated_draft_model(d.target, 2), cfg)
    assert [o.token_ids for o in eng.generate(prompts, params)] == d.ref
    assert eng.stats()["preemptions"] > 0
