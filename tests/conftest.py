"""Test setup. Without a GPU, Triton kernels run under the interpreter on CPU tensors; the variable
must be set before any kernel is defined, hence here, before the tests import draftgraph."""

import gc
import os
import pathlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":  # a third off each interpreted kernel: tests/triton_interpreter.py
    from tests.triton_interpreter import install

    install()
if os.environ.get("PYTEST_XDIST_WORKER"):  # one of `pytest -n N`'s processes: a core each, not N threads each
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

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


# The heaviest files (a 2-core machine's `--durations=0`, 2026-11-28: their tests' times summed), collected first:
# `-n 2 --dist loadfile` hands files out in collection order, so one that comes last runs alone while the other idles.
HEAVY_FIRST = (
    "test_goldens", "test_draft_loop", "test_piecewise", "test_deepseek", "test_compile_pool", "test_artifacts",
    "test_artifacts_trust", "test_deepseek_v32", "test_tp_deepseek", "test_data_parallel", "test_inspection",
    "test_tensor_parallel", "test_overlap", "test_cli", "test_serve", "test_sampling", "test_adaptive",
    "test_serve_parallel", "test_penalties", "test_fused_all_reduce", "test_launched", "test_prefix_cache",
    "test_kernel_variants_models", "test_split_kv", "test_tp_qwen3_5", "test_imports", "test_sampling_triton",
    "test_engine",
)  # fmt: skip


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest keep their order


def pytest_terminal_summary(terminalreporter):
    config = terminalreporter.config
    if config.pluginmanager.has_plugin("dsession") and not torch.cuda.is_available():
        # Under pytest-xdist (`-n N`) the workers collect, not this process: the same check on the arguments.
        pytest_ignore_collect(pathlib.Path(_GPU_TIER), config)
    if _GPU_TIER_LEFT_OUT:
        terminalreporter.write_line(
            f"GPU tier not collected: tests/gpu needs CUDA ({_GPU_TIER_LEFT_OUT[0]}); the GPU machine runs it"
            " (scripts/gpu_tier.sh)"
        )


@pytest.fixture(scope="module", autouse=True)
def _forget_compiled_code():
    """After each test module (its fixtures gone), Dynamo's caches and the module's engines are let go: a run of
    every test file in one process otherwise keeps every engine's traced graphs, and the heap grows by millions of
    objects that each full garbage collection walks."""
    yield
    torch._dynamo.reset()
    gc.collect()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _no_artifact_cache(monkeypatch):
    """The CLI's artifact cache (draftgraph/cli/artifact_cache.py) off: a test's `generate` compiles what it asks
    for, whatever an earlier test or run left in the cache; the cache's own tests turn it back on."""
    from draftgraph.cli import artifact_cache

    monkeypatch.setattr(artifact_cache, "ENABLED", False)
