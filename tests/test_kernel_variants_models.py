"""Every Triton kernel the model families launch, at batch shapes that differ in what Triton specialises on
(1 token / request, 16, and a count that is neither): no kernel may compile a variant per batch size class
(tests/test_kernel_variants.py has the reason and the per-launcher checks of the sampling, argmax and split-KV
kernels). Here every launch through `draftgraph.ops.launch.launch` is recorded, whichever module makes it, while
the tiny DeepSeek-V3 (MLA in both forms, grouped MoE), DeepSeek-V3.2 (indexer, sparse MLA), Llama (paged attention)
forwards and Qwen3.5's Gated DeltaNet op run under Triton's interpreter (on the GPU, natively).

The derived check compares each launch with the same launch (the same kernel's n-th launch of the step: the same
call site, since the code path is the batch's alike) of the other steps: an int argument whose value class
(== 1, divisible by 16, other) changes with the batch is marked `do_not_specialize`; a constexpr that changes with
the batch is listed in ALLOWED with its bound. (Call sites of one kernel may differ from each other: the latent
and the RoPE-key cache writes, the MoE's two matmuls.)"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from collections import defaultdict

import pytest
import torch

import draftgraph.ops
import draftgraph.ops.launch as launch_module
from draftgraph.models.causal_lm import CausalLM
from tests.helpers import PagedRunner, tiny_deepseek_model, tiny_hf_model
from tests.test_kernel_variants import _spec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (kernel, constexpr): why it may vary with the batch, and how many values it can take
ALLOWED = {
    ("_recurrent_kernel", "BV"): "value columns per program, halved while the grid leaves SMs idle: 32, 16, 8",
    ("_recurrent_kernel", "NV"): "head_v_dim / BV: three values with BV",
    ("_recurrent_kernel", "CH"): "conv channels per program: three values with NV",
    ("_recurrent_kernel", "CH_PAD"): "CH's power of two: three values with CH",
    # split-KV's and the MLA latent kernel's merges (on CUDA, where the rule splits by SM count)
    ("_merge_kernel", "S_PAD"): "the split count's power of two (the rule gives powers of two up to 64)",
}

# batch shapes: (request, new tokens) per step, after a prefill of every request; token counts 1, 16, 3, 8
DECODES = ([(0, 1)], [(r, 1) for r in range(16)], [(r, 1) for r in range(3)], [(0, 4), (1, 4)])


class _Launches:
    """Records each launch's arguments by name, per kernel, for every module that launches through `launch`."""

    def __init__(self, monkeypatch):
        self.steps: list[dict[str, list[dict]]] = []  # per step: kernel -> its launches' arguments, in order
        self.kernels: dict[str, object] = {}
        original = launch_module.launch

        def recording(kernel, grid):
            run = original(kernel, grid)
            names = _spec(kernel)[0]
            name = kernel.fn.__name__

            def call(*args, **kwargs):
                self.kernels[name] = kernel
                self.steps[-1][name].append({**dict(zip(names, args)), **kwargs})
                return run(*args, **kwargs)

            return call

        # Every launching module imported first: one imported later would bind `launch` as it is then.
        for info in pkgutil.walk_packages(draftgraph.ops.__path__, "draftgraph.ops."):
            importlib.import_module(info.name)
        importlib.import_module("draftgraph.ops.sampling.triton_probs")
        for module in list(sys.modules.values()):
            ours = getattr(module, "__name__", "").startswith("draftgraph.") and module is not launch_module
            if ours and getattr(module, "launch", None) is original:
                monkeypatch.setattr(module, "launch", recording)

    def step(self) -> None:
        """Launches from here on belong to a new step (a forward at another batch shape)."""
        self.steps.append(defaultdict(list))

    def check(self, expect: set[str]) -> None:
        assert expect <= set(self.kernels), f"never launched: {sorted(expect - set(self.kernels))}"
        problems = set()
        sites = defaultdict(list)  # (kernel, n-th launch of a step) -> that launch's arguments in every step
        for step in self.steps:
            for name, calls in step.items():
                for i, c in enumerate(calls):
                    sites[name, i].append(c)
        for (name, _), calls in sorted(sites.items()):
            names, const, not_specialised = _spec(self.kernels[name])
            for arg in names:
                values = [c[arg] for c in calls if arg in c]
                if len({repr(v) for v in values}) < 2 or (name, arg) in ALLOWED:
                    continue
                if arg in const:
                    problems.add(f"{name}: constexpr {arg} takes {sorted({repr(v) for v in values})}")
                elif (
                    all(type(v) is int for v in values)
                    and len({(v == 1, v % 16 == 0) for v in values}) > 1
                    and arg not in not_specialised
                ):
                    problems.add(f"{name}: int {arg} takes {sorted(set(values))}: do_not_specialize it")
        assert not problems, "a compiled variant per batch size class:\n" + "\n".join(sorted(problems))


def _run_steps(model, steps, rec):
    runner = PagedRunner(model.cfg, block_size=4, device=DEVICE, max_reqs=32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parts in steps:
            rec.step()
            meta, pos = runner.batch(parts)
            ids = torch.randint(0, 96, (meta.num_tokens,), generator=g).to(DEVICE)
            hidden, _ = model(ids, pos, meta, runner.cache.layers)
            assert torch.isfinite(hidden).all()


def _steps(prompt: int = 1):
    """A first token of each of 16 requests (a 16-token step itself), then DECODES: the shapes under test."""
    return [[(r, prompt) for r in range(16)], *DECODES]


@pytest.mark.parametrize("form", ["absorbed", "decompressed"])
def test_deepseek_v3_kernels(monkeypatch, form):
    from draftgraph.models.deepseek import set_mla_form

    model = CausalLM.from_hf(tiny_deepseek_model().to(DEVICE), attn_impl="triton")
    set_mla_form(model, form)
    rec = _Launches(monkeypatch)
    _run_steps(model, _steps(), rec)
    attention = {"_latent_kernel"} if form == "absorbed" else {"_mla_decompressed_kernel"}
    rec.check({"_grouped_gemm_kernel", "_write_rows_kernel"} | attention)


def test_deepseek_v32_kernels(monkeypatch):
    from tests.test_deepseek_v32 import tiny_v32_model

    model = CausalLM.from_hf(tiny_v32_model().to(DEVICE), attn_impl="triton")
    rec = _Launches(monkeypatch)
    _run_steps(model, _steps(), rec)
    rec.check({"_score_kernel", "_select_kernel", "_latent_kernel", "_write_rows_kernel"})


def test_llama_kernels(monkeypatch):
    model = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96), device=DEVICE, attn_impl="triton")
    rec = _Launches(monkeypatch)
    _run_steps(model, _steps(), rec)
    rec.check({"_write_kv_kernel", "_paged_attention_kernel"})  # split-KV: tests/test_kernel_variants.py


def test_gated_delta_net_kernels(monkeypatch):
    """Qwen3.5's op on its own (its state rings are not the paged cache): decodes of 1, 16 and 3 requests,
    then 2 verify runs of 4 tokens."""
    from draftgraph.ops.linear_attention.triton_gdn import gated_delta_net_triton
    from tests.test_linear_attention_triton import DK, DV, HV, RING, C, W, batch

    rows_total = 18
    g = torch.Generator().manual_seed(0)
    conv = torch.randn(rows_total, RING + W - 2, C, generator=g).to(DEVICE)
    ssm = (torch.randn(rows_total, RING, HV, DK, DV, generator=g) * 0.3).to(DEVICE)
    w = (torch.randn(C, W, generator=g) * 0.5).to(DEVICE)
    rec = _Launches(monkeypatch)
    for parts in DECODES:
        rec.step()
        runs = [(5, n) for _, n in parts]
        t = sum(n for _, n in runs)
        x = torch.randn(t, C, generator=g).to(DEVICE)
        decay, beta = (-torch.rand(t, HV, generator=g)).to(DEVICE), torch.rand(t, HV, generator=g).to(DEVICE)
        rows = torch.arange(len(runs), device=DEVICE)
        out = gated_delta_net_triton(x, decay, beta, w, conv, ssm, rows, *batch(runs, t), chunk_fn=None)
        assert torch.isfinite(out).all()
    rec.check({"_conv_kernel", "_recurrent_kernel"})
