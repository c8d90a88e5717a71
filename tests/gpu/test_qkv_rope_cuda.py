"""GPU tier: OpChoices.rope_in_projection (a Llama layer's input norm, QKV projection, RoPE and KV-cache write in one
kernel at one row: ops/linear/triton_qkv.py): a bf16 engine (FULL_AND_PIECEWISE, the step graphs captured with the
kernel) gives the same greedy tokens as the engine without it, request by request, at batch 1 and in a ragged batch;
and the kernel ran."""

import pytest
import torch

import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from draftgraph.ops.choices import OpChoices
from draftgraph.ops.linear import triton_qkv
from tests.helpers import tiny_hf_model
from tests.test_engine import ragged

pytestmark = pytest.mark.gpu


def test_rope_in_projection_engine_equals_the_engine_without(monkeypatch):
    hf = tiny_hf_model("llama", vocab_size=96, hidden_size=256, intermediate_size=512)
    launched = []
    real = triton_qkv.norm_gemv_rope_write_triton
    monkeypatch.setattr(triton_qkv, "norm_gemv_rope_write_triton", lambda *a: launched.append(1) or real(*a))
    outs = {}
    for fused in (False, True):
        ops = OpChoices(rope_in_projection=fused)
        target = CausalLM.from_hf(hf, device="cuda", dtype=torch.bfloat16, attn_impl="triton", ops=ops)
        cfg = dg.CompileConfig(mode="FULL_AND_PIECEWISE", max_num_seqs=8, max_num_batched_tokens=64, device="cuda",
                               gpu_memory_utilization=0.0, progress=False, check_addresses=True, ops=ops)  # fmt: skip
        eng = dg.compile_model(target, None, cfg)
        one = eng.generate([[5, 6, 7]], dg.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        prompts, params, arrivals = ragged(8)
        many = eng.generate(prompts, params, arrivals)
        outs[fused] = [o.token_ids for o in one + many]
        assert not any(k.startswith("step/") for k in eng.stats()["fallbacks_by_key"])
        eng.close()
        assert bool(launched) == fused  # (captured at batch 1; the engine without it never launches it)
    assert outs[True] == outs[False]
