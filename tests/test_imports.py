"""`import draftgraph` stays light: transformers, Triton and torch._dynamo (about 1 s of the 4 s it once
took) load only when something uses them. Checked in a fresh interpreter, since this one has them all."""

import os
import subprocess
import sys

import pytest

import draftgraph as dg

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("transformers", "triton", "torch._dynamo", "torch._inductor")


def test_import_loads_no_heavy_module():
    code = f"import draftgraph, sys; print([m for m in {HEAVY!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", f"import draftgraph loaded {done.stdout.strip()}"


def test_the_command_line_starts_before_torch():
    """The `draftgraph` command parses its arguments and starts its compile workers before it imports torch
    (cli.py: _prestart_workers): importing draftgraph and the CLI's module loads no torch."""
    code = "import draftgraph, draftgraph.cli, sys; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_compile_model_resolves_on_first_use():
    from draftgraph.api import compile_model

    assert dg.compile_model is compile_model
    from draftgraph import compile_model as again

    assert again is compile_model
    assert dg.CompileConfig.__module__ == "draftgraph.compiler.config" and "SamplingParams" in dir(dg)
    with pytest.raises(AttributeError, match="'compile_modle'"):
        dg.compile_modle  # noqa: B018


def test_an_engine_that_compiles_nothing_imports_no_compiler(tmp_path):
    """Mode NONE (the CPU default) traces and compiles nothing, so its process never imports Dynamo, Inductor or
    sympy (a second of a CPU start): a whole engine (target and drafter built from a checkpoint on the meta
    device) built and stepped in a fresh interpreter. The same engine in PIECEWISE mode does import Dynamo (the
    check can fail; its pieces run eagerly: Inductor's compiles would add 30 s to no purpose here)."""
    from draftgraph.models.builtin import BuiltinSpec, builtin_hf_target

    builtin_hf_target(BuiltinSpec(num_layers=3)).save_pretrained(str(tmp_path))
    heavy = ("torch._dynamo", "torch._inductor", "sympy", "transformers")
    code = f"""
import sys
import draftgraph as dg
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.drafters.loader import truncated_draft_model
target = CausalLM.from_pretrained(sys.argv[2])
config = dg.CompileConfig(mode=sys.argv[1], device="cpu", max_num_seqs=2, max_num_batched_tokens=64, progress=False,
                          compile_backend="eager")
engine = dg.compile_model(target, truncated_draft_model(target, 2), config)
out = engine.generate([[1, 2, 3]], dg.SamplingParams(max_tokens=5, ignore_eos=True))
assert len(out[0].token_ids) == 5
print([m for m in {heavy!r} if m in sys.modules])
"""
    seen = {}
    for mode in ("NONE", "PIECEWISE"):
        args = [sys.executable, "-c", code, mode, str(tmp_path)]
        done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-3000:]
        seen[mode] = done.stdout.strip().splitlines()[-1]
    assert seen["NONE"] == "[]", f"an engine of mode NONE imported {seen['NONE']}"
    assert "'torch._dynamo'" in seen["PIECEWISE"]
