"""GPU tier: artifacts built on CUDA (Inductor code with Triton kernels) load with no trace and no Inductor
compile, capture their graphs, and give the tokens of the engine that built them."""

import json

import pytest
import torch
from triton.runtime.cache import get_cache_manager

import draftgraph as dg
from draftgraph.artifacts.store import CACHE, build_artifacts
from draftgraph.models.causal_lm import CausalLM
from draftgraph.ops.kernel_variants import compiled_variants
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model
from tests.test_engine import ragged

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind,capture", [("eagle3", "eager"), ("draft_model", "lazy")])
def test_build_and_load_on_cuda(tmp_path, monkeypatch, kind, capture):
    target = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96), device="cuda", attn_impl="triton")
    drafter = make_drafter(kind, target)
    out = tmp_path / "art"
    base = dict(
        mode="FULL_AND_PIECEWISE",
        num_speculative_tokens=3,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        device="cuda",
        gpu_memory_utilization=0.0,  # a KV cache of max_num_seqs requests, not sized from memory
        capture_sizes=(1, 4, 16, 64, 72),  # 72: a draft model's first step over a full 64-token batch
        progress=False,
        check_addresses=True,
    )
    # The build's Inductor cache (the session's) lives outside the artifact: a CUDA artifact bundles its kernels.
    # (No cache_dir of its own: the build then takes the session's shared compile workers.)
    built = dg.compile_model(target, drafter, dg.CompileConfig(**base))
    prompts, params, arrivals = ragged(16)
    ref = [o.token_ids for o in built.generate(prompts, params, arrivals)]
    build_artifacts(built, str(out))
    assert not (out / CACHE).exists()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "empty_cache"))  # nothing to find there
    # draftgraph's own kernels come with the artifact (artifacts/triton_bundle.py): a fresh Triton cache gets them
    index = json.loads((out / "triton" / "index.json").read_text())
    bundled = {k["kernel"] for k in index["kernels"].values()}
    # the RoPE kernel (it writes k and v into the caches: the default with the Triton attention on CUDA)
    assert "draftgraph.ops.rope.triton_rope._rope_qkv_kernel" in bundled
    assert bundled == set(compiled_variants())  # every kernel this process compiled or loaded
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "empty_triton_cache"))
    cfg = dg.CompileConfig(capture=capture, **base)
    eng = dg.compile_model(target, drafter, cfg, artifacts=str(out), strict_artifacts=True)
    print(eng.warm_up_report)
    c = eng.compiled.counters
    assert not c.traces and c.inductor_compiles == 0
    assert c.kernels_restored >= len(index["kernels"])  # and the launchers built with them
    for h, info in index["kernels"].items():  # found where Triton's JIT looks first
        assert get_cache_manager(h).get_group(info["metadata"]) is not None
    assert (c.graphs_captured == 0) if capture == "lazy" else (c.graphs_captured > 0)
    assert [o.token_ids for o in eng.generate(prompts, params, arrivals)] == ref
    if capture == "lazy":  # the steps captured what they needed, and only that
        assert 0 < c.graphs_captured < built.compiled.counters.graphs_captured
        assert eng.stats()["compile"]["graph_memory_bytes"] > 0
    hits = eng.stats()["dispatch"]
    assert any(k.startswith("step/") for k in hits) and eng.stats()["fallbacks"] == 0
    assert sum(v for k, v in c.graph_replays.items() if k.startswith("step/")) > 0  # whole steps as one graph
    torch.cuda.synchronize()
