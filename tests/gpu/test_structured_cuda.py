"""GPU tier: structured output inside the captured one-graph step (runtime/grammar.py).

A draft model at K = 3 on CUDA: requests with a JSON schema, a regex and an EBNF grammar beside one without,
arriving over the first steps. FULL_AND_PIECEWISE gives mode NONE's tokens (greedy), every structured output
validates / matches and finishes with "stop", greedy requests give their tokens alone, the uniform
batches replay the "_grammar" step graphs (captured by the first step that needs one), and nothing falls back.
"""

import json
import re

import pytest
import torch

import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model
from tests.test_structured import EBNF, EBNF_AS_REGEX, REGEX, SCHEMA, check_schema
from tests.test_text import train_tokenizer

pytestmark = pytest.mark.gpu
PROMPTS = ["hello world", "the quick brown fox", "speculative decoding", "hello world", "the lazy dog"]
PARAMS = [
    dg.SamplingParams(max_tokens=24, regex=REGEX, ignore_eos=True),
    dg.SamplingParams(max_tokens=48, json_schema=SCHEMA),
    dg.SamplingParams(max_tokens=24, grammar=EBNF),
    dg.SamplingParams(max_tokens=16),
    dg.SamplingParams(max_tokens=48, json_schema=SCHEMA, temperature=0.8, seed=7),
]
ARRIVALS = [0, 0, 1, 1, 2]


def test_grammars_run_inside_the_step_graph():
    torch.backends.cuda.matmul.allow_tf32 = False
    tok = train_tokenizer()
    target = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=len(tok)), device="cuda", attn_impl="triton")
    outs, alone = {}, {}
    for mode in ("NONE", "FULL_AND_PIECEWISE"):
        cfg = dg.CompileConfig(mode=mode, num_speculative_tokens=3, max_num_seqs=8, max_num_batched_tokens=64,
                               device="cuda", gpu_memory_utilization=0.0, capture_sizes=(1, 2, 4, 8, 16, 32),
                               full_capture_sizes=(1, 2, 4, 8), progress=False, check_addresses=True)  # fmt: skip
        with dg.compile_model(target, make_drafter("draft_model", target), cfg, tokenizer=tok) as eng:
            outs[mode] = eng.generate(PROMPTS, PARAMS, ARRIVALS)
            stats = eng.stats()
            # alone (batch 1): the request without a grammar, and the greedy JSON request
            alone[mode] = [eng.generate([PROMPTS[i]], PARAMS[i])[0].token_ids for i in (3, 1)]
            replays = dict(eng.compiled.counters.graph_replays) if eng.compiled is not None else {}
    full, none = outs["FULL_AND_PIECEWISE"], outs["NONE"]
    assert [o.token_ids for o in full[:4]] == [o.token_ids for o in none[:4]]
    for mode in outs:
        o = outs[mode]
        assert re.fullmatch(REGEX, o[0].text) and re.fullmatch(EBNF_AS_REGEX, o[2].text), mode
        for out in (o[1], o[4]):
            check_schema(json.loads(out.text))
        assert all(o[i].finish_reason == "stop" for i in (0, 1, 2, 4)), mode
        assert [o[3].token_ids, o[1].token_ids] == alone[mode]
    assert stats["fallbacks"] == 0
    steps = {k: v for k, v in replays.items() if k.startswith("step/q4/") and v}
    assert any(k.endswith("/sample_grammar") for k in steps) and "step/q4/b1/greedy_grammar" in steps, steps
    print(steps, f"acceptance {stats['acceptance_rate']:.2f}")
