"""`draftgraph serve` over several ranks on the CPU (gloo), through the official `openai` client: driver-started
workers (`--dp 2`: a request's abort reaches the replica holding it) and torchrun as two "nodes" on one host
(`--nnodes 2 --nproc-per-node 1 --node-rank r`, the static rendezvous on 127.0.0.1, so node 0 holds rank 0;
`--tp 2`: rank 0 serves HTTP and leads, rank 1 follows its calls). One server start each. The oracle is the
one-process engine of tests/test_serve.py on the same checkpoints: greedy speculative decoding is lossless, so
every served text equals it."""

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.test_serve import MAX, NAME, PROMPTS, ROOT, STARTUP_S, K, Server, ckpts, engine, metrics, reference

__all__ = ["ckpts", "engine", "reference"]  # module fixtures shared with test_serve.py

FLAGS = ["--drafter-kind", "draft_model", "-k", str(K), "--mode", "NONE", "--device", "cpu", "--max-num-seqs", "8",
         "--max-num-batched-tokens", "128", "--max-model-len", "128", "--host", "127.0.0.1", "--port", "0",
         "--served-model-name", NAME]  # fmt: skip


def _env() -> dict:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(v, None)
    return env


def _start(cmd: list[str]) -> Server:
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    srv = Server(proc)
    assert srv.ready.wait(STARTUP_S) and srv.url, f"the server did not start:\n{srv.output()}"
    srv.url = f"http://{srv.url}"
    deadline = time.monotonic() + STARTUP_S  # /health: 503 while the ranks build, then 200
    while httpx.get(f"{srv.url}/health").status_code != 200:
        assert srv.proc.poll() is None and time.monotonic() < deadline, f"never ready:\n{srv.output()}"
        time.sleep(0.2)
    return srv


def _stop(*procs: subprocess.Popen) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


def _serves_like_one_process(srv: Server, ckpts, reference) -> None:
    """Greedy completions equal the one-process engine; a client that leaves mid-stream frees its blocks on
    every replica (its request aborted in the engine, not run to its 100 tokens)."""
    tok = ckpts[2]
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
    got = client.completions.create(model=NAME, prompt=PROMPTS, max_tokens=MAX, temperature=0)
    assert [c.token_ids for c in got.choices] == reference
    assert [c.text for c in got.choices] == [tok.decode(r, skip_special_tokens=True) for r in reference]
    stream = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=MAX, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == tok.decode(reference[2])
    before = metrics(srv)
    assert before["draftgraph_kv_blocks_used"] == 0 and before["draftgraph_kv_blocks_free"] > 0
    body = {"model": NAME, "prompt": PROMPTS[1], "max_tokens": 100, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # held: the connection stays open until the block ends
        assert next(line for line in lines if line).startswith("data: ")  # generating
        during = metrics(srv)
    assert during["draftgraph_kv_blocks_used"] > 0 and during["draftgraph_requests_running"] == 1
    deadline = time.monotonic() + 60
    while (m := metrics(srv))["draftgraph_kv_blocks_used"] != 0 or m["draftgraph_requests_in_flight"] != 0:
        assert time.monotonic() < deadline, f"the disconnected request still holds blocks: {m}"
        time.sleep(0.1)
    assert m["draftgraph_requests_aborted_total"] == before["draftgraph_requests_aborted_total"] + 1
    assert m["draftgraph_engine_generated_tokens"] - before["draftgraph_engine_generated_tokens"] < 100
    assert m["draftgraph_kv_blocks_free"] == before["draftgraph_kv_blocks_free"]
    assert m["draftgraph_requests_running"] == 0 and m["draftgraph_requests_waiting"] == 0


def test_serve_data_parallel_workers(ckpts, reference):
    target, drafter, _ = ckpts
    srv = _start([sys.executable, "-m", "draftgraph", "serve", "--target", target, "--drafter", drafter, "--dp", "2",
                  *FLAGS])  # fmt: skip
    try:
        _serves_like_one_process(srv, ckpts, reference)
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=60) == 0, srv.output()
        assert "server stopped" in srv.output()
    finally:
        _stop(srv.proc)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("nodes", [2])
def test_serve_on_two_torchrun_nodes(ckpts, reference, nodes):
    target, drafter, _ = ckpts
    endpoint = f"127.0.0.1:{_free_port()}"

    def node(rank: int) -> list[str]:
        run = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--nproc-per-node", "1",
               "--node-rank", str(rank), "--rdzv-endpoint", endpoint, "--local-addr", "127.0.0.1"]  # fmt: skip
        return [*run, "-m", "draftgraph", "serve", "--target", target, "--drafter", drafter, "--tp", str(nodes), *FLAGS]

    follower = subprocess.Popen(node(1), cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)  # fmt: skip
    srv = None
    try:
        srv = _start(node(0))
        _serves_like_one_process(srv, ckpts, reference)
        # SIGTERM to rank 0 (torchrun's agent itself exits 1 on a signal, whatever its ranks do): rank 0 drains,
        # tells rank 1 to stop, and both nodes exit 0.
        with open(f"/proc/{srv.proc.pid}/task/{srv.proc.pid}/children") as f:
            (rank0,) = (int(pid) for pid in f.read().split())
        os.kill(rank0, signal.SIGTERM)
        assert srv.proc.wait(timeout=60) == 0, srv.output()
        assert follower.wait(timeout=60) == 0, follower.stdout.read()
        assert "server stopped" in srv.output() and srv.output().count("serving ") == 1
    finally:
        _stop(follower, *([srv.proc] if srv else []))
