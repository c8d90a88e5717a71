"""Where the `draftgraph` command's time goes before the engine build starts: each import and step of
`draftgraph generate` up to compile_model, timed in fresh interpreters (`-X importtime` for the imports).

Usage: python scripts/time_cli_start.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import subprocess
import sys

STEPS = r"""
import time
t = time.perf_counter()
marks = []
def mark(name):
    global t
    now = time.perf_counter(); marks.append((name, now - t)); t = now
import torch; mark("import torch")
torch.cuda.is_available(); mark("torch.cuda.is_available()")
import torch._dynamo; mark("import torch._dynamo")
import torch._inductor.compile_fx; mark("import torch._inductor.compile_fx")
import transformers; mark("import transformers")
from draftgraph.cli.commands import cmd_generate; mark("import draftgraph.cli")
import draftgraph.artifacts.store, draftgraph.workers.launched; mark("import artifacts, workers.launched")
from draftgraph.models.builtin import BuiltinSpec, builtin_pair; mark("import models.builtin")
builtin_pair(BuiltinSpec()); mark("builtin_pair()")
import draftgraph.api; mark("import draftgraph.api")
print("; ".join(f"{n} {s:.2f} s" for n, s in marks))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    for r in range(args.repeats):
        out = subprocess.run([sys.executable, "-c", STEPS], capture_output=True, text=True)
        print(f"[{r + 1}] {out.stdout.strip() or out.stderr[-2000:]}", flush=True)
    # the largest imports by cumulative time, from one more fresh interpreter
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", STEPS], capture_output=True, text=True)
    rows = []
    for line in out.stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            head, cum_us, name = line.split("|", 2)  # "import time: SELF | CUMULATIVE | NAME"
            if cum_us.strip().isdigit():
                rows.append((int(cum_us), int(head.split(":", 1)[1]), name.rstrip()))
    print("largest imports (cumulative, self) in microseconds:")
    for cum, self_us, name in sorted(rows, reverse=True)[:45]:
        print(f"  {cum / 1e6:7.2f} s {self_us / 1e6:7.2f} s  {name}")


if __name__ == "__main__":
    main()
