"""A new user's cold start, variant against variant: `draftgraph generate --device cuda` (the built-in pair, or
--args for another job) in a fresh process with empty Inductor and Triton caches, for each variant in turn,
`--repeats` times, interleaved so that drift hits every variant alike. Reports each variant's median time to
a ready engine (the CLI's "engine ready in" line), the compile workers' timeline (when they were ready, when
the last piece was done, how long the engine waited: `-v` logs it), and the most processes and the highest
one-minute load seen while it ran (compile workers that start pools of their own show up there).

Usage: python scripts/bench_cold_start.py --variant base: --variant t1:DRAFTGRAPH_WORKER_COMPILE_THREADS=1
       [--variant w4::--compile-workers 4] [--repeats 2] [--args "--max-tokens 16"]
A variant is NAME:ENV=V,ENV=V:EXTRA CLI ARGS (either part may be empty).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time


def parse_variant(text: str) -> tuple[str, dict, list[str]]:
    parts = text.split(":", 2)
    if len(parts) < 2 or not parts[0]:
        raise SystemExit(f"--variant {text!r}: expected NAME:ENV=V,...[:EXTRA ARGS] (e.g. base: or t1:X=1)")
    name, env_text = parts[0], parts[1]
    env = {}
    for kv in filter(None, env_text.split(",")):
        k, sep, v = kv.partition("=")
        if not sep:
            raise SystemExit(f"--variant {text!r}: {kv!r} is not ENV=VALUE")
        env[k] = v
    return name, env, shlex.split(parts[2]) if len(parts) > 2 else []


def process_count() -> int:
    return sum(1 for d in os.listdir("/proc") if d.isdigit())


def run_once(env_extra: dict, extra: list[str], base_args: list[str], timeout: float) -> dict:
    env = dict(os.environ, **env_extra)
    env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="cold-inductor-")
    env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="cold-triton-")
    cmd = [sys.executable, "-m", "draftgraph", "-v", "generate", "--device", "cuda", *base_args, *extra]
    peak = {"procs": 0, "load": 0.0}
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak["procs"] = max(peak["procs"], process_count())
            peak["load"] = max(peak["load"], os.getloadavg()[0])
            stop.wait(0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        # the log first: its "compiled" line is the compiling warm-up's (the printed report may be the one
        # after KV-cache sizing, which compiles nothing)
        out, rc = proc.stderr + proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        out, rc = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), "timeout"
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    ready = re.search(r"engine ready in ([\d.]+) s", out)
    since = re.search(r"\(([\d.]+) s since the command started\)", out)
    pool = re.search(r"compile workers: .*", out)
    compiled = re.search(r"compiled \d+ pieces .*? in [\d.]+ s(?: \([^)]*\))?", out)
    captured = re.findall(r"captured \d+ CUDA graphs in [\d.]+ s", out)  # twice where the KV sizing recaptures
    sized = re.search(r"KV cache sized after capture: .*", out)
    return {
        "rc": rc,
        "ready": float(ready.group(1)) if ready else None,
        "wall": wall,
        "since_start": float(since.group(1)) if since else None,
        "pool": pool.group(0) if pool else "",
        "compiled": compiled.group(0) if compiled else "",
        "captured": "; ".join(captured),
        "sized": sized.group(0)[:300] if sized else "",
        "procs": peak["procs"],
        "load": peak["load"],
        "tail": "" if ready else out[-1500:],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", default=[], help="NAME:ENV=V,...[:EXTRA ARGS]")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--args", default="--max-tokens 16", help="CLI arguments every variant gets")
    ap.add_argument("--timeout", type=float, default=200.0)
    args = ap.parse_args()
    variants = [parse_variant(v) for v in args.variant or ["base:"]]
    base_args = shlex.split(args.args)
    results: dict[str, list[dict]] = {name: [] for name, _, _ in variants}
    for r in range(args.repeats):
        for name, env, extra in variants:
            res = run_once(env, extra, base_args, args.timeout)
            results[name].append(res)
            ready = "FAILED" if res["ready"] is None else f"{res['ready']:.1f} s"
            since = "" if res["since_start"] is None else f"{res['since_start']:.1f} s since the command started, "
            print(f"[{r + 1}/{args.repeats}] {name}: ready {ready} ({since}process {res['wall']:.1f} s, "
                  f"rc {res['rc']}), "
                  f"peak {res['procs']} processes, load {res['load']:.1f}", flush=True)  # fmt: skip
            for key in ("compiled", "captured", "sized", "pool"):
                if res[key]:
                    print(f"    {res[key]}", flush=True)
            if res["tail"]:
                print("    " + res["tail"].replace("\n", "\n    "), flush=True)
    print("\nvariant | median ready (s) | runs | since the command started (s) | peak processes")
    print("---|---:|---|---|---:")
    base = None
    for name, _, _ in variants:
        ready = [x["ready"] for x in results[name] if x["ready"] is not None]
        med = statistics.median(ready) if ready else None
        base = base if base is not None else med
        ratio = f" ({med / base:.2f}x)" if med and base else ""
        runs = ", ".join(f"{x:.1f}" for x in ready) or "failed"
        procs = max(x["procs"] for x in results[name])
        since = ", ".join(f"{x['since_start']:.1f}" for x in results[name] if x["since_start"] is not None) or "-"
        print(f"{name} | {'-' if med is None else f'{med:.1f}'}{ratio} | {runs} | {since} | {procs}")


if __name__ == "__main__":
    main()
