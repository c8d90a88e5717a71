"""KV cache sizing from measured memory (compiler/memory.py): the arithmetic, and the errors for bad input.
The measurement itself needs CUDA: tests/gpu/test_memory_cuda.py."""

import pytest

import draftgraph as dg
from draftgraph.compiler.config import resolve
from draftgraph.compiler.memory import plan_blocks

MIB = 2**20


def test_blocks_are_what_the_budget_leaves():
    plan = plan_blocks(
        device_total=1000 * MIB,
        utilization=0.9,
        outside=100 * MIB,
        peak_without_kv=300 * MIB,
        graph_memory=50 * MIB,
        bytes_per_block=2 * MIB,
        min_blocks=10,
    )
    assert plan.num_blocks == (900 - 100 - 300 - 50) // 2 == 225
    text = plan.describe()
    assert "225 blocks (450 MiB)" in text and "50 CUDA graphs" in text and "300 weights" in text


def test_too_little_memory_names_the_numbers_and_the_fixes():
    with pytest.raises(ValueError, match=r"leaves room for 4 KV blocks, but one request of max_model_len needs 10"):
        plan_blocks(1000 * MIB, 0.5, 100 * MIB, 300 * MIB, 92 * MIB, 2 * MIB, 10)


def test_config_errors():
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=1.5 must lie in \(0, 1\)"):
        dg.CompileConfig(gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="both size the KV cache; set one of them"):
        dg.CompileConfig(gpu_memory_utilization=0.5, num_kv_blocks=100)
    with pytest.raises(ValueError, match="but the device is cpu; set num_kv_blocks"):
        resolve(dg.CompileConfig(gpu_memory_utilization=0.5, device="cpu"), 256, True)
