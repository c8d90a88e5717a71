"""Small builders shared by tests: tiny transformers configs and a paged forward over one request."""

from __future__ import annotations

import os

import torch
import transformers

from draftgraph.runtime.attn_metadata import MetadataBuilder, RequestSlice
from draftgraph.runtime.kv_cache import BlockAllocator, BlockTable, KVCacheSpec, PagedKVCache

FAMILIES = {
    "llama": transformers.LlamaConfig,
    "qwen2": transformers.Qwen2Config,
    "qwen3": transformers.Qwen3Config,
    "mistral": transformers.MistralConfig,
}
HF_CLASSES = {
    "llama": transformers.LlamaForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
    "mistral": transformers.MistralForCausalLM,
}


def tiny_deepseek_config(**overrides):
    """A small DeepSeek-V3: q LoRA, yarn RoPE with mscale, 8 experts in 4 groups (2 picked, 2 active),
    a shared expert, a first dense layer."""
    kw = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=112,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    )
    kw.update(overrides)
    return transformers.DeepseekV3Config(**kw)


def tiny_deepseek_model(seed: int = 0, **overrides):
    """transformers' DeepseekV3ForCausalLM with random weights (router bias and norms randomized too)."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(tiny_deepseek_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    return model


def tiny_hf_config(family: str = "llama", **overrides):
    kw = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    if family == "qwen3":
        kw["head_dim"] = 16
    kw.update(overrides)
    return FAMILIES[family](**kw)


def tiny_hf_model(family: str = "llama", seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = HF_CLASSES[family](tiny_hf_config(family, **overrides)).eval()
    with torch.no_grad():  # random biases and norm weights, so a wrong mapping cannot hide behind ones/zeros
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


class PagedRunner:
    """Drive a flat-layout model through the paged cache, one batch of RequestSlices at a time."""

    def __init__(
        self,
        cfg,
        num_blocks=64,
        block_size=4,
        max_tokens=512,
        max_reqs=16,
        num_layers=None,
        device="cpu",
        max_blocks_per_req=None,
    ):
        self.spec = KVCacheSpec(
            num_layers or cfg.num_layers,
            num_blocks,
            block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.dtype,
            getattr(cfg, "kv_entry_shapes", ()),
        )
        self.cache = PagedKVCache(self.spec, device)
        self.alloc = BlockAllocator(num_blocks)
        self.builder = MetadataBuilder(max_tokens, max_reqs, max_blocks_per_req or num_blocks, block_size, device)
        self.tables: dict[int, BlockTable] = {}
        self.cached: dict[int, int] = {}

    def batch(self, parts: list[tuple[int, int]]):
        """parts: (request id, new tokens). Returns (meta, positions) and advances the cached lengths."""
        slices = []
        for rid, n in parts:
            table = self.tables.setdefault(rid, BlockTable(self.alloc, self.spec.block_size))
            done = self.cached.get(rid, 0)
            table.ensure_capacity(done + n)
            slices.append(RequestSlice(table.blocks, done, n))
            self.cached[rid] = done + n
        return self.builder.build(slices)


def full_engine_tokens(target, ops=None) -> list[list[int]]:
    """A CUDA engine over `target` (FULL_AND_PIECEWISE, up to 8 requests, `ops` its OpChoices): the greedy
    tokens of one request alone (24 new) then of a ragged batch of 8 (tests/test_engine.py `ragged`), request by
    request; no step fell back to eager. The engine is closed."""
    import draftgraph as dg
    from tests.test_engine import ragged

    cfg = dg.CompileConfig(mode="FULL_AND_PIECEWISE", max_num_seqs=8, max_num_batched_tokens=64, device="cuda",
                           gpu_memory_utilization=0.0, progress=False, check_addresses=True, ops=ops)  # fmt: skip
    eng = dg.compile_model(target, None, cfg)
    try:
        one = eng.generate([[5, 6, 7]], dg.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
        many = eng.generate(*ragged(8))
        assert not any(k.startswith("step/") for k in eng.stats()["fallbacks_by_key"])
    finally:
        eng.close()
    return [o.token_ids for o in one + many]


def cuda_path_prefill_then_decode(model, ids, monkeypatch):
    """A flat-layout model's CUDA path run on the CPU (tensors claim `is_cuda`; the Triton kernels interpreted): a
    prefill of ids[:-1] then a decode step of the last id through a fresh paged cache; returns (the decode step's
    hidden states, copies of every layer's caches)."""
    import torch

    runner = PagedRunner(model.cfg)
    n = len(ids) - 1
    with torch.no_grad(), monkeypatch.context() as m:
        m.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        meta, pos = runner.batch([(0, n)])
        model(ids[:n], pos, meta, runner.cache.layers)
        meta, pos = runner.batch([(0, 1)])
        hidden, _ = model(ids[n:], pos, meta, runner.cache.layers)
    return hidden, [t.clone() for layer in runner.cache.layers for t in layer]


def compile_for_sm90(kernel, signature: dict, constexprs: dict) -> list[str]:
    """Compile a Triton kernel for an H100 (sm_90) without a GPU: the interpreter runs code Triton's compiler
    refuses (a name typed differently in each branch of an if, ...). Runs in a fresh Python without
    TRITON_INTERPRET (under it, triton.language's own helpers are interpreted functions the compiler cannot
    take). `signature`: the non-constexpr arguments' types ("*bf16", "i64", ...); every other argument is a
    constexpr from `constexprs`. Returns the stages compiled ("ttir", ... "cubin"). Skips the calling test
    (with the reason) where this Triton has no CUDA backend or no ptxas, checked before compiling; any error
    of the compile itself fails the test with the compiler's message. Several kernels: `compile_many_for_sm90`
    (one process for all: its start and imports cost more than most compiles)."""
    return compile_many_for_sm90([(kernel, signature, constexprs)])[0].stages()


class Sm90Compile:
    """One kernel's result from `compile_many_for_sm90`: `stages()` returns the stages compiled, or fails the
    calling test with the compiler's message (each test fails for its own kernel only); `ptx`, the PTX."""

    def __init__(self, name: str, stages: list[str] | None, error: str | None, ptx: str = ""):
        self.name, self._stages, self.error, self.ptx = name, stages, error, ptx

    def stages(self) -> list[str]:
        if self.error is not None:
            raise AssertionError(f"{self.name} does not compile for sm_90:\n{self.error[-3000:]}")
        return self._stages


def assert_pdl_order(ptx: str, level: int, weight_first: bool = False) -> None:
    """A kernel's sm_90 PTX at programmatic-dependent-launch `level` (ops/triton_pdl.py): no griddepcontrol at 0;
    else the wait (griddepcontrol.wait) before the first global load, unless `weight_first` (a GEMV at level 2
    or 3: a load of weight before it), and the release (griddepcontrol.launch_dependents) before the wait at
    level 3 only."""
    if not level:
        assert "griddepcontrol" not in ptx
        return
    wait, release, load = (ptx.index(f) for f in ("griddepcontrol.wait", "launch_dependents", "ld.global"))
    assert (wait < load) == (not weight_first or level == 1)
    assert (release < wait) == (level == 3)


def compile_many_for_sm90(jobs: list[tuple]) -> list[Sm90Compile]:
    """`compile_for_sm90` for several (kernel, signature, constexprs) in one fresh Python (a module-scoped
    fixture compiles a file's kernels once; each test checks its own). Skips the caller where sm_90 cannot be
    compiled here; a kernel that does not compile is reported in its own result, the others still compile."""
    import json
    import subprocess
    import sys

    import pytest

    specs, names = [], []
    for kernel, signature, constexprs in jobs:
        fn = getattr(kernel, "fn", kernel)
        fn = getattr(fn, "fn", fn)  # JITFunction -> Python function
        specs.append([fn.__module__, fn.__name__, signature, constexprs])
        names.append(fn.__name__)
    code = """
import json, sys, importlib, traceback
import triton
from triton.backends import backends
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
target = GPUTarget("cuda", 90, 32)
if not any(b.compiler.supports_target(target) for b in backends.values()):
    print(json.dumps({"skip": f"Triton {triton.__version__} has no CUDA backend (backends: {sorted(backends)})"}))
    sys.exit(0)
try:
    ptxas = triton.knobs.nvidia.ptxas.path  # the sm_90 assembler the CUDA backend calls
except RuntimeError as e:
    print(json.dumps({"skip": f"Triton {triton.__version__} finds no ptxas: {e}"}))
    sys.exit(0)
results = []
for module, name, signature, constexprs in json.loads(sys.argv[1]):
    try:
        kernel = getattr(importlib.import_module(module), name)
        sig = {arg: signature.get(arg, "constexpr") for arg in kernel.arg_names}
        compiled = triton.compile(ASTSource(kernel, sig, constexprs), target=target)
        results.append({"stages": sorted(compiled.asm), "ptx": compiled.asm.get("ptx", "")})
    except Exception:
        results.append({"error": traceback.format_exc()})
print(json.dumps(results))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", code, json.dumps(specs)], env=env, capture_output=True, text=True,
                         timeout=300 * len(jobs))  # fmt: skip
    if out.returncode != 0:
        raise AssertionError(f"{', '.join(names)}: the sm_90 compile process failed:\n{out.stderr[-3000:]}")
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if isinstance(got, dict):
        pytest.skip(f"cannot compile {', '.join(names)} for sm_90 here: {got['skip']}")
    return [Sm90Compile(name, r.get("stages"), r.get("error"), r.get("ptx", "")) for name, r in zip(names, got)]


def join_forked(procs, seconds: float, what: str) -> None:
    """Join forked rank processes, each for up to `seconds` (a bound on a hang, not a speed check); ranks still
    running then are killed and fail the test, named, with `what` (what a hang there means); every rank exits 0."""
    for p in procs:
        p.join(seconds)
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in alive:
        procs[r].kill()
    assert not alive, f"ranks {alive} still running after {seconds:.0f} s: {what}"
    assert [p.exitcode for p in procs] == [0] * len(procs)


def join_spawned(ctx, seconds: int, what: str) -> None:
    """Join torch.multiprocessing's started ranks (`start_processes(..., join=False)`) a second at a time, so a
    rank's exception is raised here as soon as it ends; ranks still running after `seconds` are killed and fail
    the test, named, with `what`."""
    for _ in range(int(seconds)):
        if ctx.join(timeout=1.0):
            return
    alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
    for r in alive:
        ctx.processes[r].kill()
    assert not alive, f"ranks {alive} still running after {seconds:.0f} s: {what}"


def within(seconds: float, what: str, fn, *args, **kwargs):
    """fn(*args, **kwargs) in a daemon thread: its result, or its exception raised here (so `pytest.raises`
    sees it). Still running after `seconds` fails the test naming `what` instead of hanging it: a generous
    bound on a hang, not a speed check (speed belongs in scripts/bench_*.py)."""
    import threading

    import pytest

    done = threading.Event()
    box: dict = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name=f"within: {what}", daemon=True).start()
    if not done.wait(seconds):
        pytest.fail(f"{what}: still running after {seconds:.0f} s (hung)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def nothing_starts(monkeypatch) -> list[str]:
    """Make loading models, building an engine and starting worker processes record their name (and raise)
    instead: a check that must fail before anything starts then asserts the returned list stays empty."""
    import draftgraph as dg
    from draftgraph.models import builtin
    from draftgraph.workers import driver

    started: list[str] = []

    def refuse(name):
        def call(*args, **kwargs):
            started.append(name)
            raise AssertionError(f"{name} ran, but the settings should have been refused before it")

        return call

    for owner, name in ((dg, "compile_model"), (builtin, "builtin_pair"), (builtin, "builtin_hf_pair"),
                        (driver, "start_workers")):  # fmt: skip
        monkeypatch.setattr(owner, name, refuse(f"{owner.__name__}.{name}"))
    return started


def hf_greedy(hf, prompts: list[list[int]], max_tokens: int | list[int]) -> list[list[int]]:
    """transformers' greedy `generate()`, one prompt at a time, exactly `max_tokens` new tokens each (or per prompt;
    no eos; an explicit attention mask, since generate would mask token 0 as padding): the oracle we did not write."""
    hf.generation_config.eos_token_id, hf.generation_config.pad_token_id = None, 0
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    outs = []
    for prompt, max_tokens in zip(prompts, lengths, strict=True):
        ids = torch.tensor([prompt], device=hf.device)
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=max_tokens, min_new_tokens=max_tokens)  # fmt: skip
        outs.append(out[0, len(prompt) :].tolist())
    return outs


def kill_rank_1_between_steps(engine, prompt, params, seconds: float) -> None:
    """Rank 1 of a two-rank engine killed between steps of a running request: the next step raises WorkerError
    naming it (exit code -9) and rank 0's process ends too, each within `seconds` (a bound on a hang); no child
    process is left."""
    import multiprocessing
    import os
    import signal

    import pytest

    from draftgraph.workers.ranked import WorkerError

    engine.add_request(prompt, params)
    engine.step()
    os.kill(engine.pids[1], signal.SIGKILL)
    with pytest.raises(WorkerError, match=r"worker rank 1 of 2 failed during step: .*exited with code -9"):
        within(seconds, "engine.step() after rank 1 was killed", engine.step)
    engine.procs[0].join(seconds)
    assert not engine.procs[0].is_alive(), f"rank 0 still runs {seconds} s after rank 1 was killed"
    assert not multiprocessing.active_children()
