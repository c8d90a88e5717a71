"""GPU tier: draftgraph's own Triton kernels compiled in the compile workers (compiler/op_warmup.py). With
workers, each distinct call of our ops in the traced graphs runs once in a worker (attention, the greedy
argmax, the sampling probabilities), the engine waits for them, and the tokens equal those of an engine
that compiled everything in its own process; the kernels the engine then uses are the same variants."""

import pytest
import torch

import draftgraph as dg
from draftgraph.models.llama import CausalLM
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model
from tests.test_engine import ragged

pytestmark = pytest.mark.gpu


def _run(target, drafter, workers):
    prompts, params, arrivals = ragged(8)
    params = [dg.SamplingParams(max_tokens=p.max_tokens, ignore_eos=True, temperature=(0.0, 0.8)[i % 2], seed=i)
              for i, p in enumerate(params)]  # fmt: skip
    cfg = dg.CompileConfig(mode="FULL_AND_PIECEWISE", num_speculative_tokens=3, max_num_seqs=8,
                           max_num_batched_tokens=64, device="cuda", gpu_memory_utilization=0.0,
                           capture_sizes=(1, 4, 16, 64), full_capture_sizes=(1, 8), progress=False,
                           compile_workers=workers)  # fmt: skip
    eng = dg.compile_model(target, drafter, cfg)
    return [o.token_ids for o in eng.generate(prompts, params, arrivals)], eng.compiled.counters


def test_kernels_compiled_by_workers():
    torch.backends.cuda.matmul.allow_tf32 = False
    target = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96), device="cuda", attn_impl="triton")
    drafter = make_drafter("eagle", target)
    ref, c0 = _run(target, drafter, 0)
    toks, c2 = _run(target, drafter, 2)
    assert toks == ref
    assert c0.worker_op_calls == 0 and c2.compile_workers == 2 and c2.compile_worker_failures == 0
    # attention (target and drafter share a layout), the argmax and the sampling probabilities at least
    assert c2.worker_op_calls >= 3 and c2.warmup_seconds["op_calls_wait"] > 0
    assert set(c2.kernel_variants) == set(c0.kernel_variants)
