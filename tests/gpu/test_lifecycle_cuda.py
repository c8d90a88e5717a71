"""GPU tier: an engine gives its memory back. Built with the defaults (the KV cache sized to 0.9 of the device,
mapped in place through CUDA virtual memory, runtime/growable.py), used, and closed, five times in one process:
every engine gets the first one's KV cache size (nothing of the ones before is still held), and device memory
after each close is back within 1 GiB of where it was before the first build. Odd rounds leave through
`del engine` + `gc.collect()` instead of close(), which must give back the same."""

import gc

import pytest
import torch

import draftgraph as dg
from draftgraph.models.builtin import BuiltinSpec, builtin_pair

pytestmark = [pytest.mark.gpu, pytest.mark.whole_device]

ROUNDS = 5
GiB = 2**30
PROMPTS = [[1, 5, 9, 11], [7, 7, 3], [4, 2, 8, 16, 32]]


def used_bytes() -> int:
    gc.collect()
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def test_build_close_five_times_gives_the_memory_back(settled_device):
    target, drafter = builtin_pair(BuiltinSpec(), device="cuda", attn_impl="triton")
    config = dg.CompileConfig(num_speculative_tokens=3, max_num_seqs=8, device="cuda", progress=False)
    params = dg.SamplingParams(max_tokens=16, ignore_eos=True)
    torch.cuda.empty_cache()
    before = used_bytes()
    blocks, ref = None, None
    for i in range(ROUNDS):
        engine = dg.compile_model(target, drafter, config)
        tokens = [o.token_ids for o in engine.generate(PROMPTS, params)]
        kv = engine.config.num_kv_blocks
        print(f"round {i}: {kv} KV blocks, {engine.warm_up_report}")
        if i == 0:
            blocks, ref = kv, tokens
        assert kv == blocks, f"round {i}: {kv} KV blocks, the first engine had {blocks}: memory is still held"
        assert tokens == ref
        if i % 2 == 0:
            with engine:
                pass
            assert engine.closed
        del engine
        gc.collect()
        after = used_bytes()
        print(f"round {i}: {after / GiB:.2f} GiB in use after close, {before / GiB:.2f} GiB before the first build")
        assert after <= before + GiB, f"round {i}: {(after - before) / GiB:.2f} GiB more in use after close"
