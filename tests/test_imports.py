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
