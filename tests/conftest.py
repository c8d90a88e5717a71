"""Test setup. Without a GPU, Triton kernels run under the interpreter on CPU tensors; the variable
must be set before any kernel is defined, hence here, before the tests import draftgraph."""

import os
import pathlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_GPU_TIER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu")
_GPU_TIER_LEFT_OUT: list[str] = []  # the reason, once the tier was left out of this run's collection


def pytest_ignore_collect(collection_path, config):
    """The GPU tier (tests/gpu/) needs CUDA; on CPU-only machines (CI) it is not collected, and the run's summary
    says so in one line (pytest_terminal_summary)."""
    if str(collection_path) != _GPU_TIER or torch.cuda.is_available():
        return None
    asked = [(config.invocation_params.dir / a.split("::")[0]).resolve() for a in config.args]
    if not _GPU_TIER_LEFT_OUT and any(pathlib.Path(_GPU_TIER).is_relative_to(a) for a in asked):  # its parent asked
        why = "torch built without CUDA" if torch.version.cuda is None else "no CUDA device visible"
        _GPU_TIER_LEFT_OUT.append(f"{why}, torch {torch.__version__}")
    return True


def pytest_terminal_summary(terminalreporter):
    if _GPU_TIER_LEFT_OUT:
        terminalreporter.write_line(
            f"GPU tier not collected: tests/gpu needs CUDA ({_GPU_TIER_LEFT_OUT[0]}); the GPU machine runs it"
            " (scripts/gpu_tier.sh)"
        )


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
