"""Defaults and the checks that run before any weights load or anything compiles (compiler/config.py's
resolve, build/preflight.py, models/weights.py): mode "auto", gpu_memory_utilization's default, the KV
cache against memory, a missing CUDA, corrupt checkpoint files, sampling values, K only with a drafter.
Nothing here compiles; the tiny llama is 3 layers x 2 KV heads x head_dim 16 in float32."""

import json
import logging

import pytest
import torch

import draftgraph as dg
from draftgraph.compiler.config import CUDAGraphMode, resolve
from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.weights import CheckpointError
from tests.copy_drafters import make_drafter
from tests.helpers import tiny_hf_model

# One KV block of the tiny llama: layers x block_size x (K and V: 2 heads x 16) x 4 bytes
TARGET_BLOCK_BYTES = 3 * 16 * (2 * 2 * 16) * 4  # 12288


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_hf_model("llama", vocab_size=96).save_pretrained(path)
    return path


@pytest.fixture
def copy_of(checkpoint, tmp_path):
    """A fresh copy of the checkpoint that a test may break."""
    import shutil

    shutil.copytree(checkpoint, tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.fixture
def no_weights_loaded(monkeypatch):
    """Fail the test if any target weights are read (the checks must come first)."""

    def refuse(path):
        raise AssertionError(f"weights of {path} were loaded before the check")

    monkeypatch.setattr("draftgraph.models.causal_lm.read_checkpoint", refuse)


def test_auto_is_none_on_the_cpu_and_says_why(caplog):
    with caplog.at_level(logging.INFO, logger="draftgraph"):
        rc = resolve(dg.CompileConfig(), 256, True)
    assert dg.CompileConfig().mode == "auto" and dg.CompileConfig().gpu_memory_utilization is None
    assert rc.mode == CUDAGraphMode.NONE and rc.gpu_memory_utilization == 0.0 and not rc.graphs_enabled
    assert "mode auto -> NONE: no CUDA graphs on cpu" in caplog.text
    assert "no CUDA graphs on cpu" in rc.mode_reason


def test_auto_on_cuda_is_full_and_piecewise_with_memory_sizing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # resolve only: nothing touches a device
    rc = resolve(dg.CompileConfig(), 256, True)
    assert rc.mode == CUDAGraphMode.FULL_AND_PIECEWISE and rc.device.type == "cuda" and rc.graphs_enabled
    assert rc.gpu_memory_utilization == 0.9 and rc.attention == "triton"
    # An explicit num_kv_blocks turns the measured sizing off instead of conflicting with it
    assert resolve(dg.CompileConfig(num_kv_blocks=64), 256, True).gpu_memory_utilization == 0.0
    # Explicit values work as before; artifacts decide "auto" for themselves
    explicit = resolve(dg.CompileConfig(mode="NONE", gpu_memory_utilization=0.5), 256, True)
    assert explicit.mode == CUDAGraphMode.NONE and explicit.gpu_memory_utilization == 0.5 and not explicit.mode_reason
    assert resolve(dg.CompileConfig(), 256, True, artifact_mode="PIECEWISE").mode == CUDAGraphMode.PIECEWISE


def test_cuda_without_cuda_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device='cuda' was asked for, but torch.cuda.is_available\(\) is False.*"
                       r"use device='cpu'"):  # fmt: skip
        resolve(dg.CompileConfig(device="cuda"), 256, False)


def test_a_huge_max_model_len_fails_before_loading_naming_the_bytes(copy_of, no_weights_loaded, monkeypatch):
    cfg_file = copy_of / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "max_position_embeddings": 2**30}))
    monkeypatch.setattr("draftgraph.build.preflight.available_ram", lambda: 8 * 2**30)
    # no drafter: K = 0, lookahead 2 -> 16 requests x ceil((2^30 + 2) / 16) blocks
    need = 16 * (2**26 + 1) * TARGET_BLOCK_BYTES
    with pytest.raises(ValueError, match=rf"the KV cache needs 12288.0 GiB \({need} bytes: .* for max_num_seqs=16 "
                       r"requests of max_model_len=1073741824, but the available RAM is 8.0 GiB \(8589934592 bytes\); "
                       r"lower max_model_len"):  # fmt: skip
        dg.compile_model(str(copy_of), None, dg.CompileConfig(max_model_len=2**30))
    # Past the RoPE table is refused too, with the limit
    with pytest.raises(ValueError, match="max_model_len=512 exceeds the target's max_position_embeddings=256"):
        dg.compile_model(
            CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96)), None, dg.CompileConfig(max_model_len=512)
        )


def test_the_drafter_counts_and_nothing_compiles_first(monkeypatch):
    target = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96))
    blocks = 1000
    # Room for the target's cache alone, not for the drafter's beside it
    monkeypatch.setattr("draftgraph.build.preflight.available_ram", lambda: blocks * TARGET_BLOCK_BYTES + 1)

    def refuse(*args, **kwargs):
        raise AssertionError("compiled before the memory check")

    monkeypatch.setattr("draftgraph.build.engine.build_compiled", refuse)
    config = dg.CompileConfig(mode="PIECEWISE", compile_backend="eager", num_kv_blocks=blocks)
    # EAGLE's one layer adds 16 x (2 x 2 x 16) x 4 = 4096 bytes per block
    with pytest.raises(ValueError, match=r"16384000 bytes: 1000 blocks x 16384 bytes per block of 16 tokens, target "
                       r"\+ drafter\) for num_kv_blocks=1000, .* at most 750"):  # fmt: skip
        dg.compile_model(target, make_drafter("eagle", target), config)


def test_a_truncated_safetensors_file_is_named(copy_of, no_weights_loaded):
    weights = copy_of / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=rf"{weights} is not a readable safetensors file .*truncated or corrupt"):
        dg.compile_model(str(copy_of))


def test_a_broken_config_json_is_named(copy_of, no_weights_loaded):
    cfg_file = copy_of / "config.json"
    good = json.loads(cfg_file.read_text())
    cfg_file.write_text('{"hidden_size": 64,')
    with pytest.raises(CheckpointError, match=rf"{cfg_file} is not valid JSON \(.* at line 1"):
        dg.compile_model(str(copy_of))
    cfg_file.write_text(json.dumps({k: v for k, v in good.items() if k != "hidden_size"}))
    with pytest.raises(CheckpointError, match=rf"{cfg_file} has no 'hidden_size'"):
        dg.compile_model(str(copy_of))
    cfg_file.write_text(json.dumps({**good, "num_hidden_layers": "three"}))
    with pytest.raises(CheckpointError, match=r"num_hidden_layers='three' must be a positive integer"):
        dg.compile_model(str(copy_of))


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(temperature=-0.5), r"temperature=-0.5 must be >= 0"),
        (dict(temperature=float("nan")), r"temperature=nan must be >= 0"),
        (dict(top_p=0.0), r"top_p=0.0 must lie in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p=1.5 must lie in \(0, 1\]"),
        (dict(top_k=-2), r"top_k=-2 must be >= 1 .* or 0 \(or -1\) for off"),
        (dict(max_tokens=0), r"max_tokens=0 must be at least 1"),
    ],
)
def test_sampling_values_are_checked_when_built(bad, message):
    with pytest.raises(ValueError, match=message):
        dg.SamplingParams(**bad)


def test_k_is_checked_only_with_a_drafter():
    target = CausalLM.from_hf(tiny_hf_model("llama", vocab_size=96))
    eng = dg.compile_model(target, None, dg.CompileConfig(max_num_seqs=256))  # 256 x (1 + 3) > 512: no matter
    assert eng.k == 0 and eng.config.max_num_seqs == 256
    assert [o.token_ids for o in eng.generate([[1, 2, 3]], dg.SamplingParams(max_tokens=3, ignore_eos=True))][0]
    with pytest.raises(ValueError, match=r"max_num_batched_tokens=512 cannot hold a full decode batch: "
                       r"max_num_seqs x \(1 \+ K\) = 256 x 4 = 1024"):  # fmt: skip
        resolve(dg.CompileConfig(max_num_seqs=256), 256, True)
    with pytest.raises(ValueError, match=r"num_speculative_tokens=9 must lie in \[0, 8\]"):
        resolve(dg.CompileConfig(num_speculative_tokens=9), 256, True)
    assert resolve(dg.CompileConfig(num_speculative_tokens=9), 256, False).num_speculative_tokens == 0


def test_auto_takes_the_mode_of_the_artifacts(tmp_path):
    from draftgraph.build.preflight import artifact_mode

    (tmp_path / "manifest.json").write_text(json.dumps({"mode": "PIECEWISE"}))
    assert artifact_mode(str(tmp_path)) == "PIECEWISE"
    # unreadable: `draftgraph build`'s default, and loading says what is wrong with the directory
    assert artifact_mode(str(tmp_path / "missing")) == "FULL_AND_PIECEWISE"
