"""GPU tier: draftgraph's own Triton kernels compiled ahead in threads (compiler/pool/kernels_ahead.py). Each
distinct call of our ops in the traced graphs runs once on zero inputs inside `compiling_ahead()`, which queues
its kernels' compiles on a thread pool and launches nothing; the traced code's first launches wait for them.
The one-graph step's token-choice calls, which no traced graph names, are seeded at warm-up's start. The tokens
equal mode NONE's (greedy and sampled rows), and nothing failed."""

import pytest
import torch

import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model
from tests.test_engine import ragged

pytestmark = pytest.mark.gpu


def _run(target, drafter, mode):
    prompts, params, arrivals = ragged(8)
    params = [dg.SamplingParams(max_tokens=p.max_tokens, ignore_eos=True, temperature=(0.0, 0.8)[i % 2], seed=i)
              for i, p in enumerate(params)]  # fmt: skip
    cfg = dg.CompileConfig(mode=mode, num_speculative_tokens=3, max_num_seqs=8, max_num_batched_tokens=64,
                           device="cuda", gpu_memory_utilization=0.0, capture_sizes=(1, 4, 16, 64),
                           full_capture_sizes=(1, 8), progress=False, block_size=32)  # fmt: skip
    eng = dg.compile_model(target, drafter, cfg)
    return [o.token_ids for o in eng.generate(prompts, params, arrivals)], eng


def test_kernels_compiled_ahead():
    torch.backends.cuda.matmul.allow_tf32 = False
    # A vocabulary and a block size no other GPU test uses (97: Triton specialises ints by divisibility by 16;
    # the advance takes the block size as a constexpr): the token-choice kernels' and the advance's variants
    # are new to this process whichever tests ran in it before
    target = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=97), device="cuda", attn_impl="triton")
    drafter = make_drafter("eagle", target)
    toks, eng = _run(target, drafter, "FULL_AND_PIECEWISE")  # first: none of its token-choice kernels compiled yet
    ref, _ = _run(target, drafter, "NONE")
    assert toks == ref
    ahead = eng.stats()["compile"]["kernels_ahead"]
    # the attention call of the traced graphs at least (target and drafter share a layout: the KV write and the
    # attention kernel), none failed; the traced code waited for their compiles to be queued, so it compiled
    # none of those kernels itself
    assert ahead["calls"] >= 1 and ahead["failed"] == 0 and "error" not in ahead, ahead
    # and the one-graph step's token choice (argmax and sampling probabilities at 4 and 32 verify rows, and at 1
    # and 8 rows of the drafter's logits: the loop runs unfused in the step) and the loop's metadata advance,
    # seeded before any graph named them (runtime/warmup.py): their kernels (argmax's first stage, the sampling
    # probabilities' three, the advance) ahead too
    assert ahead["calls"] >= 1 + 8 + 1 and ahead["kernels"] >= 5, ahead
    assert eng.compiled.ahead is None  # closed when the compile phase ended
    assert "compiled ahead in threads" in eng.warm_up_report
