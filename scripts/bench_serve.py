"""Serving benchmark: N concurrent clients stream completions from `draftgraph serve` over HTTP.

Each client sends requests of fixed prompt and output lengths (random token-id prompts, `ignore_eos`) back to
back until the level's requests are done; the script reports output throughput, time to first token (TTFT),
time per output token (TPOT: after the first, per request), inter-token latency (ITL: between streamed chunks,
one chunk per engine step, so a speculative step's several tokens arrive as one), p50/p90/p99, and the
acceptance the server counted in /metrics over the level.

Against a running server:
    python scripts/bench_serve.py --url http://127.0.0.1:8000 --concurrency 1,8,32,64
Or started here, speculative and then plain (the same flags plus --no-drafter), each server stopped after:
    python scripts/bench_serve.py --serve-args "--target T/ --drafter D/" --compare-plain --concurrency 1,8,32,64
    python scripts/bench_serve.py --serve-args "" --compare-plain   # the built-in pair
The issue's matrix (the realistic-acceptance 1B pair of models/builtin.py, bf16, K = 4, saved to a temporary
directory with save_pretrained; plain against speculative at concurrency 1, 8, 32, 64), on a GPU:
    python scripts/bench_serve.py --acceptance-pair --compare-plain
For reference (not comparable: another model and GPU): vLLM's Model Runner V2 with Llama-3-8B + EAGLE reports
307 tok/s and TPOT 3.18 ms at concurrency 1, 9,815 tok/s and TPOT 5.94 ms at 64 (H200).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], out_len: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    t0 = time.perf_counter()
    arrivals, tokens = [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"]:
                arrivals.append(time.perf_counter())
    e2e = time.perf_counter() - t0
    ttft = arrivals[0] - t0 if arrivals else e2e
    return {
        "ttft": ttft,
        "tpot": (e2e - ttft) / (tokens - 1) if tokens > 1 else 0.0,
        "itl": [b - a for a, b in zip(arrivals, arrivals[1:])],
        "e2e": e2e,
        "tokens": tokens,
    }


def scrape(url: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=60).text):
        for s in fam.samples:
            if not s.labels:
                out[s.name] = s.value
    return out


async def run_level(url: str, model: str, concurrency: int, num_requests: int, prompt_len: int, out_len: int,
                    max_token_id: int, seed: int) -> dict:  # fmt: skip
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, max_token_id) for _ in range(prompt_len)] for _ in range(num_requests)]
    before = scrape(url)
    todo = list(range(num_requests))
    results: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker():
            while todo:
                i = todo.pop()
                results.append(await one_request(client, url, model, prompts[i], out_len))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    after = scrape(url)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    drafts, accepted = delta.get("draftgraph_spec_draft_tokens", 0), delta.get("draftgraph_spec_accepted_tokens", 0)
    verify = delta.get("draftgraph_spec_verify_steps", 0)
    ms = lambda xs, q: 1000 * pct(xs, q)  # noqa: E731
    ttft = [r["ttft"] for r in results]
    tpot = [r["tpot"] for r in results]
    itl = [x for r in results for x in r["itl"]]
    tokens = sum(r["tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "requests": num_requests,
        "wall_s": wall,
        "output_tok_s": tokens / wall,
        **{f"ttft_p{q}_ms": ms(ttft, q) for q in (50, 90, 99)},
        **{f"tpot_p{q}_ms": ms(tpot, q) for q in (50, 90, 99)},
        **{f"itl_p{q}_ms": ms(itl, q) for q in (50, 90, 99)},
        "tpot_mean_ms": 1000 * statistics.fmean(tpot) if tpot else float("nan"),
        "acceptance_rate": accepted / drafts if drafts else 0.0,
        "mean_accepted_length": 1 + accepted / verify if verify else 0.0,
    }


def start_server(serve_args: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "draftgraph", "serve", *serve_args, "--port", "0"]
    print("starting:", shlex.join(cmd), flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        print("  server:", line.rstrip(), flush=True)
        if line.startswith("serving ") and "http://" in line:
            return proc, "http://" + line.split("http://")[1].split()[0]
    raise RuntimeError(f"the server exited with code {proc.wait()} before serving")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_ready(url: str, timeout_s: float = 900.0) -> None:
    """/health answers 503 while the server builds its engine (after binding its port), 200 once ready."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=10).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{url} was not ready after {timeout_s:.0f} s")


def bench(url: str, label: str, args) -> list[dict]:
    wait_ready(url)
    model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
    rows = []
    asyncio.run(run_level(url, model, 1, 2, args.prompt_len, 8, args.max_token_id, args.seed))  # warm-up
    for c in args.concurrency:
        n = max(args.num_requests, c * args.requests_per_client)
        row = asyncio.run(run_level(url, model, c, n, args.prompt_len, args.output_len, args.max_token_id, args.seed))
        row["variant"] = label
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


HEADER = ("| variant | concurrency | output tok/s | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms | ITL p50/p90/p99 ms | "
          "acceptance | mean accepted length |\n|---|---|---|---|---|---|---|---|")  # fmt: skip


def format_row(r: dict) -> str:
    trio = lambda k: "/".join(f"{r[f'{k}_p{q}_ms']:.2f}" for q in (50, 90, 99))  # noqa: E731
    return (f"| {r['variant']} | {r['concurrency']} | {r['output_tok_s']:.1f} | {trio('ttft')} | {trio('tpot')} | "
            f"{trio('itl')} | {r['acceptance_rate']:.3f} | {r['mean_accepted_length']:.2f} |")  # fmt: skip


def save_acceptance_pair(out: str) -> list[str]:
    """The realistic-acceptance 1B pair (models/builtin.py LLAMA_1B_ACCEPTANCE: its first 2 layers as the draft
    model, about 2.5 of 4 drafts accepted) saved as bf16 checkpoints under `out`; `draftgraph serve` flags."""
    import torch

    from draftgraph.models.builtin import LLAMA_1B_ACCEPTANCE, builtin_hf_pair

    target, draft = builtin_hf_pair(LLAMA_1B_ACCEPTANCE)
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        path = os.path.join(out, name)
        model.to(torch.bfloat16).save_pretrained(path)
        paths.append(path)
    return ["--target", paths[0], "--drafter", paths[1], "--dtype", "bfloat16", "-k", "4", "--max-num-seqs", "64"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="a running server (default: start one with --serve-args)")
    p.add_argument("--serve-args", default=None, help="flags for `draftgraph serve` when starting one here")
    p.add_argument("--compare-plain", action="store_true", help="also run the server with --no-drafter")
    p.add_argument(
        "--acceptance-pair", action="store_true", help="serve the realistic-acceptance 1B pair (saved to a temp dir)"
    )
    p.add_argument("--concurrency", default="1,8,32,64", help="comma-separated client counts (default 1,8,32,64)")
    p.add_argument("--num-requests", type=int, default=16, help="at least this many requests per level")
    p.add_argument("--requests-per-client", type=int, default=4, help="and at least this many per client")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-token-id", type=int, default=500, help="prompt ids are drawn from [1, this)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write every row here")
    args = p.parse_args()
    args.concurrency = [int(x) for x in args.concurrency.split(",") if x]
    if args.acceptance_pair:
        import tempfile

        tmp = tempfile.mkdtemp(prefix="bench_serve_")
        args.serve_args = shlex.join(save_acceptance_pair(tmp) + shlex.split(args.serve_args or ""))
    if (args.url is None) == (args.serve_args is None):
        p.error("give --url (a running server), --serve-args (start one here) or --acceptance-pair")
    print(HEADER)
    rows = []
    if args.url:
        rows += bench(args.url.rstrip("/"), "server", args)
    else:
        base = shlex.split(args.serve_args)
        for label, extra in [("speculative", [])] + ([("plain", ["--no-drafter"])] if args.compare_plain else []):
            proc, url = start_server(base + extra)
            try:
                rows += bench(url, label, args)
            finally:
                stop_server(proc)
        print(HEADER)
        for r in rows:
            print(format_row(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
