"""DeepSeek-V3.2 (sparse MLA with the lightning indexer) against transformers' DeepseekV32ForCausalLM on the
same random weights (float32, CPU): config and weights, logits, greedy generation in NONE, PIECEWISE and
FULL_AND_PIECEWISE with continuous batching, dense MLA on the same weights giving other tokens, and the MTP
drafter (V3's MTP layout around a sparse-attention layer) lossless at K = 1, 3, 5.

index_topk = 8 is smaller than most prompts (1-39 tokens), so the indexer's choice changes the result.
16 indexer heads: a key scores exactly 0.0 only when all 16 of its head dots are <= 0 (about 2^-16 per
pair), so exact ties at the top-k boundary, where torch.topk's order (transformers) and ours (lower position
first) may differ, are vanishingly rare; with 2-4 heads such ties are common and tokens could differ.

Tolerances: logits 1e-4 absolute (summation order only).
"""

import pytest
import torch
import transformers

import draftgraph as dg
from draftgraph.models.builtin import deepseek_layer_weights, module_from_state_dict
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.drafters import load_drafter
from tests.helpers import PagedRunner, tiny_deepseek_config
from tests.test_engine import ragged

ATOL = 1e-4
TOPK, INDEX_HEADS, INDEX_DIM = 8, 16, 16


def tiny_v32_model(seed=1, **overrides):
    """A small DeepSeek-V3.2 (the V3 test model's shape: q LoRA, yarn, grouped routing, a first dense layer)
    with the indexer; random norms (LayerNorm biases included) so a wrong mapping cannot hide. Seed 1: its
    greedy outputs repeat a token often enough (26 of 95 tokens) for the copy MTP drafter to be accepted."""
    kw = {
        k: v for k, v in tiny_deepseek_config().to_dict().items() if k in transformers.DeepseekV32Config.__annotations__
    }
    kw.update(index_topk=TOPK, index_n_heads=INDEX_HEADS, index_head_dim=INDEX_DIM, mlp_layer_types=None, **overrides)
    kw.pop("head_dim", None)
    torch.manual_seed(seed)
    model = transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


@pytest.fixture(scope="module")
def hf():
    return tiny_v32_model()


@pytest.fixture(scope="module")
def target(hf):
    return CausalLM.from_hf(hf)


def test_config_weights_and_cache_layout(hf, target, tmp_path):
    cfg = target.cfg
    assert (cfg.indexer.num_heads, cfg.indexer.head_dim, cfg.indexer.topk, cfg.indexer.rope_dim) == (16, 16, 8, 8)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, True, True]  # mlp_layer_types; MTP: MoE
    assert cfg.kv_entry_shapes == ((32,), (8,), (16,))  # latent, RoPE key, index key: one slot for all three
    idx = target.layers[1].attn.indexer
    torch.testing.assert_close(idx.k_norm.bias, hf.model.layers[1].self_attn.indexer.k_norm.bias, atol=0, rtol=0)
    bf16 = CausalLM.from_hf(hf, dtype=torch.bfloat16)
    assert bf16.layers[0].attn.indexer.weights_proj.weight.dtype == torch.float32  # transformers keeps it fp32
    assert bf16.layers[0].attn.indexer.wq_b.weight.dtype == torch.bfloat16
    hf.save_pretrained(tmp_path)  # a config.json dict and the hub's per-expert layout load the same model
    from_dir = CausalLM.from_pretrained(str(tmp_path))
    assert from_dir.cfg.indexer == cfg.indexer
    for (n1, p1), (n2, p2) in zip(target.state_dict().items(), from_dir.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_prefill_then_decode_logits_match_transformers(hf, target):
    """A 9-token prefill (past the top-k of 8), then 14 decode steps through the paged caches."""
    ids = torch.randint(0, 96, (1, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0]
    runner = PagedRunner(target.cfg, block_size=4)
    got = []
    with torch.no_grad():
        meta, pos = runner.batch([(0, 9)])
        got.append(target.compute_logits(target(ids[0, :9], pos, meta, runner.cache.layers)[0]))
        for t in range(9, 23):
            meta, pos = runner.batch([(0, 1)])
            got.append(target.compute_logits(target(ids[0, t : t + 1], pos, meta, runner.cache.layers)[0]))
    torch.testing.assert_close(torch.cat(got), ref, atol=ATOL, rtol=0)


def hf_greedy(hf, prompts, params):
    """transformers' greedy generate, one prompt at a time (explicit mask: token 0 is not padding)."""
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0
    outs = []
    for prompt, p in zip(prompts, params):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=p.max_tokens, min_new_tokens=p.max_tokens)  # fmt: skip
        outs.append(out[0, len(prompt) :].tolist())
    return outs


def generate(target, drafter=None, mode="NONE", k=0, requests=8, backend="eager", sizes=(1, 2, 4, 8, 16, 32, 64, 72),
             **config):  # fmt: skip
    """`requests` ragged requests through 4 sequence slots (continuous batching); `config`: more CompileConfig
    fields."""
    prompts, params, arrivals = ragged(requests)
    cfg = dg.CompileConfig(
        mode=mode, num_speculative_tokens=k, max_num_seqs=4, max_num_batched_tokens=64, compile_backend=backend,
        capture_sizes=sizes if mode != "NONE" else (), progress=False, gpu_memory_utilization=0.0, **config,
    )  # fmt: skip
    eng = dg.compile_model(target, drafter, cfg)
    return [o.token_ids for o in eng.generate(prompts, params, arrivals)], eng


@pytest.fixture(scope="module")
def reference(hf):
    prompts, params, _ = ragged(8)
    return hf_greedy(hf, prompts, params)


def test_greedy_equals_transformers_generate_none(target, reference):
    assert sum(len(p) > TOPK for p in ragged(8)[0]) >= 5  # most prompts are longer than the top-k
    assert generate(target)[0] == reference


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_AND_PIECEWISE"])
def test_greedy_equals_transformers_generate_compiled(target, reference, mode):
    out, eng = generate(target, mode=mode)
    assert out == reference
    # 3 layers, one splitting op each (sparse_mla_attention; the indexer stays inside its piece) -> 4 pieces,
    # plus the input checks' piece: as many as V3's dense MLA
    assert eng.compiled.counters.traces["target"] == 1 and eng.compiled.counters.pieces == 5


def test_indexer_inside_inductor_pieces(target, reference):
    """Inductor compiles the pieces with the indexer op inside (it mutates the index-key cache in place):
    the same tokens; one compile per unique piece with kernels (the input-checks piece has none)."""
    out, eng = generate(target, mode="PIECEWISE", backend="inductor", sizes=(4, 72))
    assert out == reference
    c = eng.compiled.counters
    assert c.pieces == 5 and c.inductor_compiles == c.unique_pieces - 1 == 4
    assert all(kv[2].any() for kv in eng.runner.target_cache.layers)  # index keys written by the compiled pieces


def test_dense_mla_on_the_same_weights_gives_other_tokens(hf, target, reference):
    """The same weights without the indexer (DeepSeek-V3 dense MLA): other tokens, so sparsity is exercised."""
    state = {k: v for k, v in hf.state_dict().items() if ".indexer." not in k}
    dense = CausalLM.from_state_dict(target.cfg.replace(model_type="deepseek_v3", indexer=None), state)
    assert type(dense.layers[0].attn).__name__ == "MLAttention"
    out = generate(dense)[0]
    assert out != reference
    assert sum(a != b for a, b in zip(out, reference)) >= 3  # not one unlucky request: most of them differ


def copy_v32_mtp(target):
    """A V3.2 MTP layer (V3's layout; its block a sparse-attention layer with its own random indexer) whose
    attention and experts are silent, so it repeats the target's prediction: real, partial acceptance."""
    cfg, h = target.cfg, target.cfg.hidden_size
    p = f"model.layers.{cfg.num_layers}."
    w = deepseek_layer_weights(p, cfg, torch.Generator().manual_seed(7), quiet=True, std=0.2)
    assert p + "self_attn.indexer.wq_b.weight" in w
    w.update({p + n: torch.ones(h) for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")})
    w[p + "eh_proj.weight"] = torch.cat([torch.zeros(h, h), torch.eye(h)], dim=1)
    return load_drafter(module_from_state_dict(w), target, kind="mtp")


@pytest.fixture(scope="module")
def drafter(target):
    return copy_v32_mtp(target)


def test_mtp_drafter_is_a_sparse_attention_layer(drafter):
    assert drafter.kind == "mtp" and type(drafter.block.attn).__name__ == "SparseMLAttention"
    assert type(drafter.block.mlp).__name__ == "MoE"
    assert drafter.cfg.kv_entry_shapes[-1] == (INDEX_DIM,)  # its own index-key cache


@pytest.mark.parametrize("k", [1, 3, 5])
def test_mtp_lossless_every_k(target, drafter, reference, k):
    out, eng = generate(target, drafter, k=k)
    assert out == reference
    assert eng.stats()["accepted_tokens"] > 0  # acceptance paths run


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_AND_PIECEWISE"])
def test_mtp_lossless_compiled(target, drafter, reference, mode):
    out, eng = generate(target, drafter, mode=mode, k=3, fuse_draft_loop=True)  # the loop's pieces counted too
    assert out == reference
    c = eng.compiled.counters
    # target: 4 pieces + its checks; drafter step: 2 + checks; each fused loop variant (FULL modes, K = 3):
    # its checks, then per step the drafter's 2 pieces and a token-choice piece (test_deepseek.py's count)
    assert c.pieces == (5 + 3 if mode == "PIECEWISE" else 5 + 3 + 2 * (1 + 3 * 3))
