"""Eager reference runs of the GPU tier in a process beside pytest's.

A test that compares a compiled engine against a long eager run (the soak's 2,000 steps of mode NONE: Python
launching every kernel) spends most of its time in that reference, on one CPU core, while the tier's other
tests keep pytest's own thread busy tracing and compiling. A test marked `@pytest.mark.side_reference.with_args(fn)`
has `fn()` (a module-level function returning JSON-able data) started in a separate Python process as soon as
the session's tests are collected (tests/gpu/conftest.py); the test asks the `side_reference` fixture for it
and waits only for what is left. The reference is the same code on the same device, only run earlier and
elsewhere; where no side process runs (an xdist worker, `DRAFTGRAPH_SIDE_REFERENCES=0`), the fixture calls
`fn()` in the test itself.

    python -m tests.gpu.side_process MODULE:FUNCTION OUT.json   (what the side process runs)
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

NICE = 10  # the side processes' niceness, added to pytest's


def qualname(fn) -> str:
    return f"{fn.__module__}:{fn.__qualname__}"


class SideRun:
    """One reference function running in its own Python process; `result()` waits for it and reads its JSON."""

    def __init__(self, name: str, workdir: str):
        self.name = name
        self.out = Path(workdir) / (name.replace(":", ".") + ".json")
        self.log = Path(workdir) / (name.replace(":", ".") + ".log")
        self.started_at = time.time()
        self.wall_s: float | None = None
        self.reported = False  # its time written to the tier's test times (tests/gpu/conftest.py)
        root = str(Path(__file__).resolve().parents[2])  # the repository root: `tests` importable
        path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.gpu.side_process", name, str(self.out)],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=root,
                env={**os.environ, "PYTHONPATH": path},
            )

    def wait(self, timeout: float = 600.0) -> int:
        rc = self.proc.wait(timeout)
        if self.wall_s is None:  # from its start to its result's file (the process may have ended long ago)
            done = self.out.stat().st_mtime if self.out.exists() else time.time()
            self.wall_s = done - self.started_at
        return rc

    def result(self, timeout: float = 600.0):
        rc = self.wait(timeout)
        if rc != 0 or not self.out.exists():
            tail = self.log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"side reference {self.name} exited with {rc}; its output ends:\n{tail}")
        return json.loads(self.out.read_text())

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def start(names: list[str]) -> dict[str, SideRun]:
    workdir = tempfile.mkdtemp(prefix="draftgraph-side-")
    return {name: SideRun(name, workdir) for name in dict.fromkeys(names)}


def main(argv: list[str]) -> int:
    if len(argv) != 2 or ":" not in argv[0]:
        print("usage: python -m tests.gpu.side_process MODULE:FUNCTION OUT.json", file=sys.stderr)
        return 2
    # Below pytest's priority: a reference has tens of seconds of slack before its test asks for it, the tests'
    # tracing and compiles have none (seven references starting with the first test slowed it by 7 s on an H100).
    os.nice(NICE)
    module, fn = argv[0].split(":", 1)
    data = getattr(importlib.import_module(module), fn)()
    tmp = argv[1] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, argv[1])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
