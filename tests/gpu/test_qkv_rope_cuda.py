"""GPU tier: OpChoices.rope_in_projection (a Llama layer's input norm, QKV projection, RoPE and KV-cache write in one
kernel at one row: ops/linear/triton_qkv.py): a bf16 engine (FULL_AND_PIECEWISE, the step graphs captured with the
kernel) gives the same greedy tokens as the engine without it, request by request, at batch 1 and in a ragged batch;
and the kernel ran."""

import pytest
import torch

from draftgraph.models.causal_lm import CausalLM
from draftgraph.ops.choices import OpChoices
from draftgraph.ops.linear import triton_qkv
from tests.helpers import full_engine_tokens, tiny_hf_model

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
        outs[fused] = full_engine_tokens(target, ops)
        assert bool(launched) == fused  # (captured at batch 1; the engine without it never launches it)
    assert outs[True] == outs[False]
