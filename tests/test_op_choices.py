"""OpChoices (ops/choices.py): the kernel choices resolved once into ResolvedConfig.ops and logged, passed to every
layer a model builds, recorded per field in an artifact's manifest (a mismatch named, then recompiled, or refused
when strict), and read from no environment variable in models/, ops/ or runtime/."""

import ast
import logging
import re
from pathlib import Path

import pytest
import torch

import draftgraph as dg
from draftgraph.artifacts.store import ArtifactError, build_artifacts, config_fields
from draftgraph.build.engine import load_target
from draftgraph.compiler.config import CompileConfig, resolve
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.drafters.loader import load_drafter
from draftgraph.models.layers import RMSNorm
from draftgraph.models.linear import Linear
from draftgraph.ops.choices import MODEL_FIELDS, OpChoices
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_deepseek_model, tiny_hf_model

OFF = OpChoices(gemv=False, rope_kv_write=False)
PACKAGE = Path(__file__).resolve().parents[1] / "draftgraph"


def test_resolve_records_and_logs_the_choices(caplog):
    with caplog.at_level(logging.INFO, logger="draftgraph"):
        rc = resolve(CompileConfig(ops=OFF), None, False)
    assert rc.ops == OFF and not rc.ops.gemv and rc.ops.norm_kernel
    assert resolve(CompileConfig(), None, False).ops == OpChoices()  # None = every kernel (all ten on)
    defaults = OpChoices().fields()
    assert len(OpChoices.names()) == 10
    assert all(defaults.values())  # every kernel measured a winner (docs/performance.md)
    assert OpChoices().describe() == "all draftgraph kernels (on CUDA)"
    assert OpChoices(gemv=False, fuse_all_reduce=False).describe() == "torch ops instead of gemv, fuse_all_reduce"
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels:"))
    assert "torch ops instead of gemv, rope_kv_write" in line and "gemv=0" in line and "norm_kernel=1" in line
    fields = config_fields(rc)  # the manifest's view: one entry per choice
    assert fields["ops.gemv"] == "False" and fields["ops.race_sampler"] == "True" and "ops" not in fields


def test_bad_choices_name_the_fix():
    with pytest.raises(TypeError, match=r"ops='gemv=0' must be an OpChoices or None.*OpChoices.parse"):
        CompileConfig(ops="gemv=0")
    with pytest.raises(TypeError, match=r"OpChoices.gemv=1 must be True or False"):
        OpChoices(gemv=1)
    assert OpChoices.parse("gemv=0, rope_kv_write=off") == OFF and OpChoices.parse("") == OpChoices()
    with pytest.raises(ValueError, match=r"ops entry 'gemm=0' is not NAME=0 or NAME=1 with NAME one of \['gemv'"):
        OpChoices.parse("gemm=0")


def _modules_with_ops(module: torch.nn.Module) -> list:
    return [m for m in module.modules() if hasattr(m, "ops")]


@pytest.mark.parametrize("family", ["llama", "deepseek", "qwen3_5"])
def test_every_layer_is_built_with_the_choices(family):
    """Every module that reads a choice (norms, linears, attention, MLP, layers, the model, the drafter heads)
    holds the OpChoices the model was built with: none fell back to the defaults on the way down."""
    from draftgraph.models.builtin import builtin_drafter
    from draftgraph.models.builtin_qwen3_5 import builtin_qwen3_5_hf

    hf = {"llama": lambda: tiny_hf_model("llama", vocab_size=96), "deepseek": tiny_deepseek_model,
          "qwen3_5": lambda: builtin_qwen3_5_hf(0)}[family]()  # fmt: skip
    target = CausalLM.from_hf(hf, ops=OFF)
    if family == "llama":
        drafters = [make_drafter(k, target) for k in ("eagle", "eagle3", "draft_model")]
    else:  # the MTP heads (DeepSeek's MLA + MoE block, Qwen3.5's hybrid block)
        drafters = [builtin_drafter("mtp", target)]
    for model in [target, *drafters]:
        holders = _modules_with_ops(model)
        # at least the model, its norms and its linears: norms and linears are where the kernels are picked
        assert any(isinstance(m, RMSNorm) for m in holders) and any(isinstance(m, Linear) for m in holders)
        assert all(m.ops is OFF for m in holders), [type(m).__name__ for m in holders if m.ops is not OFF]


def test_a_model_built_with_other_choices_is_refused():
    target = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96))  # the defaults
    with pytest.raises(ValueError, match=r"the target was built with ops gemv=True, rope_kv_write=True, but the conf"):
        load_target(target, "cpu", None, "reference", ops=OFF)
    # runtime-only choices (the race sampler, Inductor's addmm) leave the model as it is
    assert load_target(target, "cpu", None, "reference", ops=OpChoices(race_sampler=False)) is target
    assert set(MODEL_FIELDS) < set(OpChoices.names())
    with pytest.raises(ValueError, match=r"the drafter was built with ops gemv=False"):
        load_drafter(make_drafter("eagle", CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96), ops=OFF)), target)


def _cfg(ops=None):
    return dg.CompileConfig(mode="PIECEWISE", max_num_seqs=4, max_num_batched_tokens=32, capture_sizes=(1, 4, 16),
                            compile_backend="eager", progress=False, ops=ops)  # fmt: skip


def test_an_artifact_built_with_one_choice_is_named_and_recompiled_under_another(tmp_path, caplog):
    """Built with the defaults, loaded under gemv=False: the mismatch is named field by field (`config: ops.gemv
    True != False`), the engine compiles instead (its own trace), or stops with strict_artifacts; under the
    choices it was built with it loads without a trace."""
    hf = tiny_hf_model("llama", vocab_size=96)
    out = str(tmp_path / "a")
    build_artifacts(dg.compile_model(hf, None, _cfg()), out)
    with pytest.raises(ArtifactError, match=re.escape("config: ops.gemv True != False (built for != running)")):
        dg.compile_model(hf, None, _cfg(OFF), artifacts=out, strict_artifacts=True)
    with caplog.at_level(logging.WARNING, logger="draftgraph"):
        eng = dg.compile_model(hf, None, _cfg(OFF), artifacts=out)
    assert (
        "artifacts not used" in eng.warm_up_report and "config: ops.rope_kv_write True != False" in eng.warm_up_report
    )
    assert any("ops.gemv True != False" in r.getMessage() for r in caplog.records)
    assert eng.compiled.counters.traces  # compiled instead: the target's trace ran (1 forward function)
    same = dg.compile_model(hf, None, _cfg(), artifacts=out, strict_artifacts=True)
    assert not same.compiled.counters.traces and "no trace, no Inductor compile" in same.warm_up_report


def _env_reads(path: Path) -> list[str]:
    """`os.environ` / `os.getenv` / `envs.` uses and `draftgraph.envs` imports in one module."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if (node.value.id, node.attr) in (("os", "environ"), ("os", "getenv"), ("os", "putenv")):
                found.append(f"{path}:{node.lineno} os.{node.attr}")
            elif node.value.id == "envs":
                found.append(f"{path}:{node.lineno} envs.{node.attr}")
        elif isinstance(node, ast.ImportFrom) and (
            node.module == "draftgraph.envs"
            or (node.module == "draftgraph" and any(a.name == "envs" for a in node.names))
        ):
            found.append(f"{path}:{node.lineno} imports draftgraph.envs")
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module == "os"
            and any(a.name in ("environ", "getenv") for a in node.names)
        ):
            found.append(f"{path}:{node.lineno} from os import environ/getenv")
    return found


def test_models_ops_and_runtime_read_no_environment():
    files = [p for stage in ("models", "ops", "runtime") for p in sorted((PACKAGE / stage).rglob("*.py"))]
    assert len(files) > 50  # the three stages' modules were found
    bad = [hit for p in files for hit in _env_reads(p)]
    assert not bad, "kernel and runtime choices come from ResolvedConfig, not the environment:\n" + "\n".join(bad)
    assert _env_reads(PACKAGE / "envs.py")  # the scan sees an env read where there is one
