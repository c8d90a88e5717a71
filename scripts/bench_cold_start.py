"""A new user's start, variant against variant, whole process: `draftgraph -v generate --device cuda` (the
built-in pair, or --args for another job) timed from the shell, command to exit, in fresh processes:
- cold: empty Inductor and Triton caches (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR);
- warm (--warm): the same command again on the caches the cold run filled;
- artifacts (--artifacts): `draftgraph build --out DIR` (not timed as a start), then `generate --artifacts DIR`
  on empty caches (--build-args: build's flags, the model's as generate gets them).
Each run's start-up timeline (`-v` prints it: draftgraph/timeline.py, seconds since the process started) gives
the phases; the table shows the whole process (wall clock around the command), the first token and the engine's
"ready", medians over `--repeats` (variants interleaved so that drift hits every variant alike), the most
processes and the highest one-minute load seen. Each run starts once the host is back to the process count of the
script's start, or their count stays put for 3 s (at most 30 s): what the run before left running is printed, not
timed into the next. The printed tokens and acceptance of every run are compared:
a start-up change must not change them.

Python's bytecode (--bytecode): a user's `pip install` byte-compiles every package, but some machines (this project's
GPU machines: no .pyc shipped, PYTHONDONTWRITEBYTECODE=1) compile every import from source in every process, about
5 s of a start. `--bytecode installed` (the default) first runs the command once, untimed, writing bytecode into a
PYTHONPYCACHEPREFIX under the run's temporary directory, which every timed run then reads, as after a pip install;
`--bytecode as-is` leaves the machine's setting.

--pair acceptance: the realistic-acceptance 1B pair (models/builtin.py LLAMA_1B_ACCEPTANCE: Llama-3.2-1B's shape,
bf16, a draft model of its first 2 layers) saved once as two checkpoints (not timed), then every run loads them as a
user's would: `--target T --drafter D -k 4 --max-num-seqs 32 --num-prompts 32` (issue 44's 1B pair, batches to 32).
--pair 8b: Llama-3.1-8B's shape (scripts/bench_8b.py, bf16, random weights), plain decoding, saved once as a checkpoint;
`--args "--tp 2"` starts it over two GPUs (issue 44's 8B-shaped model at TP 2).

Usage: python scripts/bench_cold_start.py --variant base: [--variant w0::--compile-workers 0] [--warm]
       [--artifacts] [--repeats 2] [--args "--max-tokens 16"] [--timeline] [--pair acceptance]
       python scripts/bench_cold_start.py --pair 8b --load   (only the weights' read onto the GPU, in-process)
A variant is NAME:ENV=V,ENV=V:EXTRA CLI ARGS (either part may be empty).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

TIMELINE_ROW = re.compile(r"^\s+([\d.]+) s\s+\+\s*[\d.]+ s\s+([^:\n]+)", re.M)


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


def fresh_caches(root: str) -> dict:
    """Empty Inductor and Triton cache directories under `root` (a new pair each call)."""
    return {
        "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="inductor-", dir=root),
        "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="triton-", dir=root),
    }


def settle(baseline: int, limit_s: float = 30.0, still_s: float = 3.0) -> str:
    """Wait until the host runs no more processes than at the script's start (what an earlier run left, such as
    compile subprocesses that end once they see their parent gone), or their count has not moved for `still_s`
    (processes that stay: on a 2 x H200 host 9 stayed from the first CUDA run on), at most `limit_s`; says what it
    waited for, so that a start is timed on a quiet host and what a start leaves behind is shown."""
    t0 = time.perf_counter()
    first = last = process_count()
    moved = t0
    while last > baseline and time.perf_counter() - t0 < limit_s and time.perf_counter() - moved < still_s:
        time.sleep(0.1)
        now = process_count()
        if now != last:
            last, moved = now, time.perf_counter()
    waited = time.perf_counter() - t0
    return f"{max(first - baseline, 0)} processes above the baseline, {max(last - baseline, 0)} after {waited:.1f} s"


def run_once(cmd: list[str], env: dict, timeout: float) -> dict:
    """One process, timed from the shell; its timeline phases, tokens and log lines."""
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
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        out, err, rc = text, "", "timeout"
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    phases = {}
    for t, phase in TIMELINE_ROW.findall(err):
        phases.setdefault(phase.strip(), float(t))  # the first mark of a phase
    tokens = "\n".join(re.findall(r"^request \d+: .*$", out, re.M) + re.findall(r"^  \d: .*$", out, re.M))
    compiled = re.search(r"compiled \d+ pieces .*? in [\d.]+ s(?: \([^)]*\))?", out)
    return {
        "rc": rc,
        "wall": wall,
        "phases": phases,
        "tokens": tokens,
        "timeline": err[err.find("start-up timeline") :] if "start-up timeline" in err else "",
        "compiled": compiled.group(0) if compiled else "",
        "pool": (re.search(r"compile workers: .*", err) or re.search(r"$^", "")).group(0),
        "procs": peak["procs"],
        "load": peak["load"],
        "tail": "" if rc == 0 else (err + out)[-2500:],
        "stdout": out,
    }


def save_acceptance_pair(root: str) -> list[str]:
    """The 1B acceptance pair as two checkpoints under `root` (target; its first layers as a draft model, the same
    tensors), and the generate flags that load them."""
    import torch

    from draftgraph.models.builtin import LLAMA_1B_ACCEPTANCE, builtin_hf_target

    spec = LLAMA_1B_ACCEPTANCE
    hf = builtin_hf_target(spec, device="cuda" if torch.cuda.is_available() else "cpu", dtype=torch.bfloat16)
    target, drafter = os.path.join(root, "target"), os.path.join(root, "drafter")
    hf.save_pretrained(target)
    hf.model.layers = hf.model.layers[: spec.draft_layers]  # the draft model: the first layers, shared tensors
    hf.config.num_hidden_layers = spec.draft_layers
    if getattr(hf.config, "layer_types", None):
        hf.config.layer_types = hf.config.layer_types[: spec.draft_layers]
    hf.save_pretrained(drafter)
    del hf
    flags = ["--target", target, "--drafter", drafter, "-k", "4", "--max-num-seqs", "32", "--num-prompts", "32"]
    return flags + ["--dtype", "bfloat16"]


def save_8b(root: str) -> list[str]:
    """Llama-3.1-8B's shape (scripts/bench_8b.py: bf16, seeded random weights) saved once as a checkpoint under
    `root` (config.json and one safetensors file), and the generate flags that load it (plain decoding, 8 prompts)."""
    import json

    import torch
    from safetensors.torch import save_file

    from scripts.bench_8b import LLAMA_3_1_8B, target_state

    path = os.path.join(root, "llama-8b")
    os.makedirs(path)
    state = {k: v.cpu().contiguous() for k, v in target_state(LLAMA_3_1_8B, torch.device("cuda")).items()}
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    config = dict(LLAMA_3_1_8B, architectures=["LlamaForCausalLM"], torch_dtype="bfloat16")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return ["--target", path, "--dtype", "bfloat16", "--max-num-seqs", "8", "--num-prompts", "8"]


def load_bench(path: str, runs: int = 3) -> None:
    """--load: the target checkpoint at `path` (bf16) read onto the GPU in this process, each way timed `runs` times
    after one untimed read (the page cache warm): safetensors' `load_file` then `.to("cuda")` per tensor (what a
    plain loader does) against draftgraph's reader (`CausalLM.from_pretrained`: models/mapped_read.py), the whole
    model and tensor-parallel rank 0's share at TP 2 (a share is read without a process group). Median seconds and
    GB/s of the bytes placed on the device."""
    import torch
    from safetensors.torch import load_file

    from draftgraph.models.causal_lm import CausalLM
    from draftgraph.models.weights import weight_files
    from draftgraph.ops.collectives.op import ParallelGroup

    if not torch.cuda.is_available():
        raise SystemExit("--load reads onto a CUDA device; none is here")

    def naive():
        return {k: v.to("cuda") for f in weight_files(path) for k, v in load_file(f).items()}

    def ours(tp):
        return lambda: CausalLM.from_pretrained(path, dtype=torch.bfloat16, device="cuda", tp=tp)

    ways = {
        "safetensors load_file, then .to(cuda)": naive,
        "draftgraph reader, whole model": ours(ParallelGroup.single()),
        "draftgraph reader, TP 2 rank 0's share": ours(ParallelGroup(0, 2, "unused")),
    }
    print(f"\nreading {path} onto {torch.cuda.get_device_name()} (median of {runs} after one untimed read)")
    print("way | seconds | GB on the device | GB/s\n---|---:|---:|---:")
    for name, fn in ways.items():
        times, nbytes = [], 0
        for i in range(runs + 1):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn()
            torch.cuda.synchronize()
            if i:
                times.append(time.perf_counter() - t0)
            tensors = out.values() if isinstance(out, dict) else [*out.parameters(), *out.buffers()]
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            del out, tensors
            torch.cuda.empty_cache()
        sec = statistics.median(times)
        print(f"{name} | {sec:.3f} | {nbytes / 1e9:.2f} | {nbytes / sec / 1e9:.1f}", flush=True)


# --profile: the command under cProfile; the CLI ends with os._exit after its exit handlers, so the stats are printed
# by an exit handler registered first (handlers run last-in, first-out: this one after the CLI's own).
PROFILED = """
import atexit, cProfile, pstats, runpy, sys
profile = cProfile.Profile()
def report():
    profile.disable()
    print("== cProfile of the whole process, by cumulative time")
    pstats.Stats(profile, stream=sys.stdout).sort_stats("cumulative").print_stats(50)
    print("== by own time")
    pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(25)
atexit.register(report)
sys.argv = ["draftgraph", *sys.argv[1:]]
profile.enable()
runpy.run_module("draftgraph", run_name="__main__", alter_sys=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", default=[], help="NAME:ENV=V,...[:EXTRA ARGS]")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--args", default="", help="CLI arguments every variant's generate gets")
    ap.add_argument("--warm", action="store_true", help="also run each variant again on the caches its cold run filled")
    ap.add_argument(
        "--artifacts", action="store_true", help="also build artifacts, then generate from them (empty caches)"
    )
    ap.add_argument("--build-args", default="", help="`draftgraph build` arguments for --artifacts (its model flags)")
    ap.add_argument("--timeline", action="store_true", help="print every run's start-up timeline")
    ap.add_argument("--timeout", type=float, default=200.0)
    ap.add_argument(
        "--bytecode", choices=["installed", "as-is"], default="installed",
        help="installed: bytecode written once by an untimed run, as a pip install leaves it; as-is: the machine's",
    )  # fmt: skip
    ap.add_argument(
        "--pair", choices=["builtin", "acceptance", "8b"], default="builtin",
        help="builtin: generate's own pair (no flags); acceptance: the 1B pair from checkpoints saved once; 8b: "
        "Llama-3.1-8B's shape alone (plain decoding) from a checkpoint saved once (with --args '--tp 2' on 2 GPUs)",
    )  # fmt: skip
    ap.add_argument("--profile", default="", help="starts run under cProfile, printed: cold, warm and/or artifacts")
    ap.add_argument(
        "--load", action="store_true",
        help="with --pair acceptance or 8b: only time reading the target checkpoint onto the GPU in this process",
    )  # fmt: skip
    args = ap.parse_args()
    variants = [parse_variant(v) for v in args.variant or ["base:"]]
    base_args = shlex.split(args.args)
    kinds = ["cold"] + (["warm"] if args.warm else []) + (["artifacts"] if args.artifacts else [])
    results: dict[tuple[str, str], list[dict]] = {(n, k): [] for n, _, _ in variants for k in kinds}
    generate = [sys.executable, "-m", "draftgraph", "-v", "generate", "--device", "cuda", *base_args]
    root = tempfile.mkdtemp(prefix="bench-cold-start-")
    baseline = process_count() + 2  # (this script's own helpers: a margin of two)
    try:
        if args.pair == "acceptance":
            t0 = time.perf_counter()
            pair = save_acceptance_pair(root)
            generate += pair
            args.build_args = " ".join([*pair[:6], "--max-num-seqs", "32", "--dtype", "bfloat16", args.build_args])
            print(f"the 1B acceptance pair saved in {time.perf_counter() - t0:.1f} s (not a start)", flush=True)
        elif args.pair == "8b":
            t0 = time.perf_counter()
            flags = save_8b(root)
            generate += flags
            args.build_args = " ".join([*flags[:4], args.build_args])
            print(f"the 8B-shaped checkpoint saved in {time.perf_counter() - t0:.1f} s (not a start)", flush=True)
        if args.load:
            if args.pair == "builtin":
                raise SystemExit("--load reads a saved checkpoint: give --pair acceptance or --pair 8b")
            load_bench(generate[generate.index("--target") + 1], max(3, args.repeats))
            return
        bytecode = {}
        if args.bytecode == "installed":
            bytecode = {"PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": os.path.join(root, "pycache")}
            env = dict(os.environ, **bytecode, **fresh_caches(root))
            res = run_once(generate + variants[0][2], env, args.timeout)
            print(f"bytecode written by an untimed run ({res['wall']:.1f} s, rc {res['rc']})", flush=True)
        for r in range(args.repeats):
            for name, env_extra, extra in variants:
                env = dict(os.environ, **bytecode, **env_extra, **fresh_caches(root))
                for kind in kinds:
                    cmd, run_env = generate + extra, env  # warm: the caches the cold run filled
                    if kind == "artifacts":
                        out = os.path.join(tempfile.mkdtemp(dir=root), "artifacts")
                        build = [sys.executable, "-m", "draftgraph", "build", "--device", "cuda", "--out", out,
                                 *shlex.split(args.build_args)]  # fmt: skip
                        t0 = time.perf_counter()
                        b = subprocess.run(build, env=dict(env, **fresh_caches(root)), capture_output=True, text=True)
                        print(f"[{r + 1}/{args.repeats}] {name} build: {time.perf_counter() - t0:.1f} s", flush=True)
                        if b.returncode:
                            print(f"build failed:\n{(b.stderr + b.stdout)[-2500:]}")
                        cmd, run_env = cmd + ["--artifacts", out], dict(env, **fresh_caches(root))
                    if kind in args.profile.split(","):
                        cmd = [sys.executable, "-c", PROFILED, *cmd[3:]]  # the same argv after `-m draftgraph`
                    settled = settle(baseline)  # what the run before left running ends first
                    res = run_once(cmd, run_env, args.timeout)
                    res["settled"] = settled
                    if kind in args.profile.split(","):
                        print(res["stdout"][res["stdout"].find("== cProfile") :], flush=True)
                    results[(name, kind)].append(res)
                    p = {k: f"{v:.1f} s" for k, v in res["phases"].items()}
                    print(
                        f"[{r + 1}/{args.repeats}] {name} {kind}: whole process {res['wall']:.1f} s, first token "
                        f"{p.get('first token', '-')}, engine ready {p.get('engine ready', '-')} (rc {res['rc']}), "
                        f"peak {res['procs']} processes, load {res['load']:.1f}; before it {settled}",
                        flush=True,
                    )
                    for key in ("compiled", "pool"):
                        if res[key]:
                            print(f"    {res[key][:400]}", flush=True)
                    if args.timeline and res["timeline"]:
                        print("    " + res["timeline"].strip().replace("\n", "\n    "), flush=True)
                    if res["tail"]:
                        print("    " + res["tail"].replace("\n", "\n    "), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\nvariant | start | whole process (s) | first token (s) | engine ready (s) | runs (whole process) | tokens")
    print("---|---|---:|---:|---:|---|---")
    reference = None
    for (name, kind), runs in results.items():
        ok = [x for x in runs if x["rc"] == 0]

        def med(key, ok=ok):
            vals = [x["phases"][key] for x in ok if key in x["phases"]]
            return f"{statistics.median(vals):.1f}" if vals else "-"

        whole = f"{statistics.median(x['wall'] for x in ok):.1f}" if ok else "failed"
        reference = reference if reference is not None else (ok[0]["tokens"] if ok else None)
        same = all(x["tokens"] == reference for x in ok) if ok else False
        runs_text = ", ".join(f"{x['wall']:.1f}" for x in runs)
        print(f"{name} | {kind} | {whole} | {med('first token')} | {med('engine ready')} | {runs_text} | "
              f"{'equal' if same else 'DIFFER'}")  # fmt: skip
    if reference:
        print("\ntokens of the first run (requests and acceptance histogram):\n" + reference)


if __name__ == "__main__":
    main()
