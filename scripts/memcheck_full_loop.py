"""FULL-graph replays of the fused draft loop (greedy and sampled, a hidden-state drafter and a draft model,
padded request counts), small enough to run under compute-sanitizer:

    python scripts/memcheck_full_loop.py                     # fills the Inductor cache
    compute-sanitizer --tool memcheck python scripts/memcheck_full_loop.py

Exits non-zero when a fused loop graph did not replay; the sanitizer's ERROR SUMMARY is the verdict.
"""

from __future__ import annotations

import torch

import draftgraph as dg
from draftgraph.models.llama import CausalLM
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model


def main() -> int:
    target = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96), device="cuda", attn_impl="triton")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (int(n),), generator=g).tolist() for n in (5, 9, 3)]
    greedy = dg.SamplingParams(max_tokens=10, ignore_eos=True)
    sampled = dg.SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    bad = 0
    for kind in ("eagle", "draft_model"):
        cfg = dg.CompileConfig(
            mode="FULL",
            num_speculative_tokens=3,
            max_num_seqs=4,
            max_num_batched_tokens=32,
            max_model_len=64,
            device="cuda",
            gpu_memory_utilization=0.0,  # a KV cache of max_num_seqs requests, not sized from memory
            capture_sizes=(1,),
            full_capture_sizes=(1, 2, 4),
            progress=False,
            fuse_draft_loop=True,
        )
        eng = dg.compile_model(target, make_drafter(kind, target), cfg)
        eng.generate(prompts, [greedy, sampled, greedy])  # 3 requests: padded to 4; sampled and greedy loops
        eng.generate(prompts[:1], greedy)  # one request: b1
        torch.cuda.synchronize()
        replays = {k: v for k, v in eng.compiled.counters.graph_replays.items() if "/loop/" in k}
        print(f"{kind}: fused loop replays {replays}")
        bad += not any(k.endswith("/sample") for k in replays) or not any(k.endswith("/greedy") for k in replays)
    return int(bad > 0)


if __name__ == "__main__":
    raise SystemExit(main())
