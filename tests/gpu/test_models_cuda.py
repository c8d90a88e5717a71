"""GPU tier: our models with the Triton attention kernels on CUDA against transformers on the same GPU.

float32: 2e-4 absolute on logits (ieee dots in our kernels; cuBLAS float32 on both sides).
bf16: compared against our own float32 run of the same weights, 0.15 absolute on logits of magnitude ~3
(bf16 rounding of weights and activations through 3 layers).
"""

import pytest
import torch

from draftgraph.models.causal_lm import CausalLM
from tests.helpers import PagedRunner, tiny_hf_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_prefill_and_decode_match_transformers_on_cuda(family, impl):
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = tiny_hf_model(family).cuda()
    ours = CausalLM.from_hf(hf, attn_impl=impl)
    ids = torch.randint(0, hf.config.vocab_size, (3, 19), device="cuda")
    with torch.no_grad():
        ref = hf(ids).logits  # [3, 19, V]
    runner = PagedRunner(ours.cfg, block_size=8, device="cuda")
    with torch.no_grad():
        meta, pos = runner.batch([(r, 12) for r in range(3)])  # prefill 12 tokens each
        h, _ = ours(ids[:, :12].flatten(), pos, meta, runner.cache.layers)
        torch.testing.assert_close(ours.compute_logits(h).view(3, 12, -1), ref[:, :12], atol=2e-4, rtol=0)
        for t in range(12, 19):  # batched decode, 3 requests
            meta, pos = runner.batch([(r, 1) for r in range(3)])
            h, _ = ours(ids[:, t], pos, meta, runner.cache.layers)
            torch.testing.assert_close(ours.compute_logits(h), ref[:, t], atol=2e-4, rtol=0)


def test_bf16_model_close_to_float32():
    hf = tiny_hf_model("llama").cuda()
    outs = []
    ids = torch.randint(0, hf.config.vocab_size, (20,), device="cuda")
    for dtype in (torch.float32, torch.bfloat16):
        ours = CausalLM.from_hf(hf, dtype=dtype, attn_impl="triton")
        runner = PagedRunner(ours.cfg, block_size=16, device="cuda")
        meta, pos = runner.batch([(0, 20)])
        with torch.no_grad():
            outs.append(ours.compute_logits(ours(ids, pos, meta, runner.cache.layers)[0]).float())
    torch.testing.assert_close(outs[1], outs[0], atol=0.15, rtol=0)
