"""Ranks started by torchrun (`python -m torch.distributed.run`, on the CPU with gloo): the CLI and a script
calling compile_model on every rank make each process one rank instead of starting workers; rank 0 prints,
every rank returns rank 0's answers, and they equal one process's. A launch whose size is not tp x dp, or a
partial launch environment, is refused by name in-process (no launch needed)."""

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

import draftgraph as dg
from draftgraph.workers.launched import launch_env, uses_launch
from tests.helpers import tiny_hf_model

TIMEOUT_S = 240  # a launch of two ranks: imports, rendezvous, a tiny model each
CLI = ["generate", "--device", "cpu", "--num-prompts", "3", "--prompt-len", "8", "--max-tokens", "8", "-k", "2"]
PROMPTS = [[1, 5, 9, 3], [7, 7], [11, 12, 13, 14, 15, 16, 17]]
PARAMS = dg.SamplingParams(max_tokens=8, ignore_eos=True)


def torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(v, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r


def config(**over) -> dg.CompileConfig:
    fields = dict(device="cpu", num_speculative_tokens=2, max_num_seqs=4, max_num_batched_tokens=64)
    return dg.CompileConfig(**{**fields, "max_model_len": 128, **over})


def test_torchrun_cli_equals_one_process(capsys):
    from draftgraph.cli import main

    assert main(CLI) == 0
    want = [line for line in capsys.readouterr().out.splitlines() if line.startswith("request ")]
    r = torchrun("-m", "draftgraph", *CLI, "--tp", "2")
    got = [line for line in r.stdout.splitlines() if line.startswith("request ")]
    assert len(want) == 3 and got == want  # rank 0's lines only: rank 1 prints nothing
    assert len(re.findall(r"^config: ", r.stdout, re.M)) == 1 and "tensor_parallel_size=2" in r.stdout


SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import draftgraph as dg
    target, drafter, out = sys.argv[1:4]
    config = dg.CompileConfig(device="cpu", num_speculative_tokens=2, max_num_seqs=4, max_num_batched_tokens=64,
                              max_model_len=128, tensor_parallel_size=2)
    prompts = [[1, 5, 9, 3], [7, 7], [11, 12, 13, 14, 15, 16, 17]]
    params = dg.SamplingParams(max_tokens=8, ignore_eos=True)
    with dg.compile_model(target, drafter, config) as engine:
        got = {"type": type(engine).__name__, "rank": engine.rank, "local": type(engine.engine).__name__,
               "generate": [o.token_ids for o in engine.generate(prompts, params)],
               "steps": engine.stats()["steps"]}
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        while engine.has_unfinished():
            done.update({o.request_id: o.token_ids for o in engine.step()})
        got["step"] = [done[i] for i in ids]
    with open(os.path.join(out, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(got, f)
    """
)


def test_compile_model_on_every_rank_of_a_torchrun_launch(tmp_path):
    target, drafter = str(tmp_path / "target"), str(tmp_path / "drafter")
    shape = dict(num_attention_heads=8, num_key_value_heads=4)
    tiny_hf_model("llama", **shape).save_pretrained(target)
    tiny_hf_model("llama", seed=1, num_hidden_layers=1, **shape).save_pretrained(drafter)
    one = dg.compile_model(target, drafter, config())
    want = [o.token_ids for o in one.generate(PROMPTS, PARAMS)]
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    torchrun(str(script), target, drafter, str(tmp_path))
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (got["type"], got["rank"], got["local"]) == ("LaunchedEngine", rank, "Engine")
        assert got["generate"] == want and got["step"] == want  # every rank returns rank 0's outputs
        assert got["steps"] == one.stats()["steps"]


def test_a_launch_that_is_not_tp_x_dp_is_refused(monkeypatch):
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(v, raising=False)
    assert launch_env() is None and uses_launch(config(tensor_parallel_size=2)) is None  # no launch: workers
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="RANK, WORLD_SIZE set in the environment but not LOCAL_RANK"):
        launch_env()
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert uses_launch(config(tensor_parallel_size=2)).rank == 1
    assert uses_launch(config(data_parallel_size=2)).world_size == 2
    with pytest.raises(ValueError, match=r"WORLD_SIZE=2.*tensor_parallel_size=4 x data_parallel_size=1 needs 4"):
        uses_launch(config(tensor_parallel_size=4))
    with pytest.raises(ValueError, match=r"WORLD_SIZE=2.*tensor_parallel_size=1 x data_parallel_size=1 needs 1"):
        dg.compile_model("no-such-checkpoint", config=config())  # before anything is read
    from draftgraph.cli import main

    assert main([*CLI, "--tp", "4"]) == 2  # the CLI says so before any model is built
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="RANK must be in"):
        launch_env()
