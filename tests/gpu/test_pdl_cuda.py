"""GPU tier: kernels launched with programmatic dependent launch (ops/launch.py PdlRule, on compute capability 9.0
and up: the one-row GEMVs, RoPE, split-KV attention and its merge): a bf16 Llama engine (FULL_AND_PIECEWISE, its
step graphs captured with the launches' programmatic edges) gives the same greedy tokens as the same engine with PDL
off, request by request, at batch 1 (every projection a one-row GEMV, PDL on each) and in a ragged batch; and the
kernels did launch with it."""

import pytest
import torch

from draftgraph.models.causal_lm import CausalLM
from draftgraph.ops import launch
from draftgraph.ops.attention import triton_split_kv
from draftgraph.ops.linear import triton_gemv
from draftgraph.ops.rope import triton_rope
from tests.helpers import full_engine_tokens, tiny_hf_model

pytestmark = pytest.mark.gpu


def test_pdl_engine_equals_the_engine_without(monkeypatch):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch: compute capability 9.0 and up (Hopper)")
    hf = tiny_hf_model("llama", vocab_size=96, hidden_size=256, intermediate_size=512)
    target = CausalLM.from_hf(hf, device="cuda", dtype=torch.bfloat16, attn_impl="triton")
    launched = {}
    for module in (triton_gemv, triton_rope, triton_split_kv):
        real = module.pdl_args
        name = module.__name__.rsplit(".", 1)[1]
        record = lambda pdl, r=real, n=name: launched.setdefault(n, set()).add(pdl) or r(pdl)  # noqa: E731
        monkeypatch.setattr(module, "pdl_args", record)
    outs = {}
    for level in (0, 3):
        monkeypatch.setattr(launch, "PDL_RULE", launch.PdlRule(level=level))
        outs[level] = full_engine_tokens(target)
    assert outs[3] == outs[0]
    # (each engine's kernels at its level: the one-row GEMVs, RoPE, split-KV attention)
    assert launched == {"triton_gemv": {0, 3}, "triton_rope": {0, 3}, "triton_split_kv": {0, 3}}
