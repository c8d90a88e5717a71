"""Compiling an engine's unique pieces in parallel, in worker processes (issue 16, item 3).

Inductor compiles of one process run one after another (standalone_compile holds process-global state), and
each costs seconds of Python (lowering, code generation) whatever the piece's size. A `CompilePool` starts
`workers` processes (`python -m draftgraph.compiler.compile_worker`, not multiprocessing: a user's script
is never re-imported) when the engine build begins, so they start while the weights load. The piecewise
backend hands each unique piece to the pool (its FX graph and its inputs as data, piece_inputs.py) and goes
on tracing; the workers compile pieces concurrently and save each as an Inductor artifact, which the engine
loads at the piece's first compiled run.

Until the compile phase ends (`wait_all`), a piece whose compile is still running runs its FX graph eagerly:
warm-up's dummy steps (whose outputs nobody reads) then do not wait, and tracing of the next function
overlaps the compiles. From `wait_all` on, every call runs the compiled code; CUDA graphs are captured only
after it. A piece a worker fails to compile is compiled in the tracing process instead, with a warning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future

from tqdm import tqdm

log = logging.getLogger("draftgraph")


def auto_workers(device_type: str, local_ranks: int = 1) -> int:
    """Worker processes when `CompileConfig.compile_workers` is None: on CUDA half the cores (at most 8),
    shared by the ranks of this machine; on the CPU none (Inductor's C++ compiles use the cores already)."""
    if device_type != "cuda":
        return 0
    return max(1, min(8, (os.cpu_count() or 2) // 2 // max(1, local_ranks)))


def start_pool(rc, cache_dir: str = "", progress: bool = True) -> CompilePool | None:
    """The engine's compile pool, started now (None when `rc.compile_workers` is 0)."""
    if not rc.compile_workers:
        return None
    device = rc.device
    if device.type == "cuda" and device.index is None:
        import torch

        device = torch.device("cuda", torch.cuda.current_device())
    pool = CompilePool(rc.compile_workers, str(device), progress, cache_dir)
    log.info("started %d compile worker processes (compile_workers)", rc.compile_workers)
    return pool


def draftgraph_modules() -> list[str]:
    """The draftgraph modules this process has imported (a worker imports them: custom ops register where
    they are defined)."""
    return sorted(m for m in sys.modules if m == "draftgraph" or m.startswith("draftgraph."))


_stopping: list = []  # killed workers' processes not yet seen to exit (wait_stopped)


def wait_stopped(timeout_s: float = 10.0) -> int:
    """Wait, at most timeout_s in all, until every killed compile worker has exited: a worker's CUDA context
    (from its prewarm) leaves the device only then, and runtime/memory.py measures the device after this.
    Returns how many are still running."""
    deadline = time.monotonic() + timeout_s
    for proc in list(_stopping):
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    _stopping[:] = [p for p in _stopping if p.poll() is None]
    return len(_stopping)


class _Worker:
    def __init__(self, index: int, device: str, log_path: str, cache_dir: str = "", threads: int = 1,
                 modules: tuple[str, ...] = ()):  # fmt: skip
        import draftgraph

        root = os.path.dirname(os.path.dirname(draftgraph.__file__))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        env["DRAFTGRAPH_COMPILE_DEVICE"] = device
        env["TORCHINDUCTOR_COMPILE_THREADS"] = str(threads)  # Triton kernel compiles: the cores shared out
        # The draftgraph modules loaded here now (models, ops, and what they import: transformers among them)
        # are imported by the worker right after its prewarm, not at its first job, which is on the critical path
        env["DRAFTGRAPH_COMPILE_MODULES"] = ",".join(modules)
        if cache_dir:
            env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
        self.log = open(log_path, "w")  # noqa: SIM115 - open while the process lives
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "draftgraph.compiler.compile_worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env, text=True, bufsize=1,
        )  # fmt: skip
        self.index, self.log_path = index, log_path

    def ask(self, job: dict | None) -> dict:
        """Send a job (None: only read the next reply) and wait for its reply; raises when the worker died."""
        if job is not None:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"compile worker {self.index} exited (code {self.proc.poll()}); see {self.log_path}")
        return json.loads(line)

    def close(self) -> None:
        """Stop the process without waiting for it: every answer is in, and an interpreter with Inductor and
        CUDA loaded takes seconds to exit (measured: 11 s for 8 workers when waited for one by one)."""
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        self.proc.kill()
        _stopping[:] = [p for p in _stopping if p.poll() is None] + [self.proc]
        threading.Thread(target=self.proc.wait, daemon=True).start()  # reaped in the background
        self.log.close()


class CompilePool:
    def __init__(self, workers: int, device: str, progress: bool = True, cache_dir: str = ""):
        if workers < 1:
            raise ValueError(f"a compile pool needs at least 1 worker, got {workers}")
        self.dir = tempfile.mkdtemp(prefix="draftgraph-compile-")
        threads = max(1, (os.cpu_count() or 1) // workers)
        modules = tuple(draftgraph_modules())
        self.workers = [
            _Worker(i, device, os.path.join(self.dir, f"worker{i}.log"), cache_dir, threads, modules)
            for i in range(workers)
        ]
        self.jobs: queue.Queue = queue.Queue()
        self.pending: list[PendingPiece] = []
        self.warming = True  # until wait_all: unfinished pieces run their FX graph eagerly
        self.failures = 0
        self.timeout_s = 600.0  # the longest wait for one piece's compile before compiling it in this process
        self.progress = progress
        self._bar = None
        self._next = 0
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._serve, args=(w,), daemon=True) for w in self.workers]
        for t in self.threads:
            t.start()

    def _serve(self, worker: _Worker) -> None:
        try:
            ready = worker.ask(None)
            if "error" in ready:
                log.info("compile worker %d: %s", worker.index, ready["error"])
            log.debug("compile worker %d ready: prewarm %.1f s, imports %.1f s", worker.index,
                      ready.get("seconds", 0.0), ready.get("import_seconds", 0.0))  # fmt: skip
        except RuntimeError as e:
            log.warning("%s", e)
            return self._drain(e)
        while (item := self.jobs.get()) is not None:
            job, future = item
            try:
                reply = worker.ask(job)
            except RuntimeError as e:
                future.set_exception(e)
                return self._drain(e)
            if reply["ok"]:
                future.set_result(reply["seconds"])
            else:
                future.set_exception(RuntimeError(f"{reply['error']} (worker log: {worker.log_path})"))
            with self._lock:
                if self._bar is not None:
                    self._bar.update(1)

    def _all_dead(self) -> bool:
        return all(w.proc.poll() is not None for w in self.workers)

    def _drain(self, error: Exception) -> None:
        """A dead worker: when no worker is left alive, fail what is queued (it compiles in-process)."""
        if self._all_dead():
            while True:
                try:
                    item = self.jobs.get_nowait()
                except queue.Empty:
                    return
                if item is not None:
                    item[1].set_exception(error)

    def submit(self, name: str, gm, encoded_graph: dict, encoded_inputs: dict, options, fallback) -> PendingPiece:
        """Queue one piece's compile; `fallback()` compiles it in this process if the worker cannot."""
        with self._lock:
            self._next += 1
            out = os.path.join(self.dir, f"piece{self._next}.bin")
        # The worker imports every draftgraph module this process has: a graph's custom ops are registered
        # where they are defined (ops/, and a few in runtime/, e.g. the sampling probabilities).
        modules = draftgraph_modules()
        job = {"id": self._next, "graph": encoded_graph, "inputs": encoded_inputs, "out": out,
               "options": [list(kv) for kv in options], "modules": modules}  # fmt: skip
        future: Future = Future()
        piece = PendingPiece(self, name, gm, future, out, fallback)
        self.pending.append(piece)
        if self._all_dead():  # none left to take it: compile in-process
            future.set_exception(RuntimeError("no compile worker is running (see the worker logs)"))
        else:
            self.jobs.put((job, future))
        return piece

    def wait_all(self) -> float:
        """End of the compile phase: wait for every queued compile and load it; returns the seconds waited."""
        t0 = time.perf_counter()
        left = [p for p in self.pending if not p.future.done()]
        with self._lock:
            self._bar = tqdm(total=len(self.pending), initial=len(self.pending) - len(left), leave=False,
                             desc=f"compiling pieces in {len(self.workers)} processes", unit="piece",
                             disable=not self.progress or not left)  # fmt: skip
        for p in self.pending:
            p.load()
        self.warming = False
        with self._lock:
            self._bar.close()
            self._bar = None
        return time.perf_counter() - t0

    def close(self) -> None:
        for _ in self.workers:
            self.jobs.put(None)
        for w in self.workers:
            w.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class PendingPiece:
    """A piece's compiled code from a pool worker, called like the compiled code itself."""

    def __init__(self, pool: CompilePool, name: str, gm, future: Future, path: str, fallback):
        self.pool, self.name, self.gm, self.future, self.path = pool, name, gm, future, path
        self.fallback, self.fn, self.seconds = fallback, None, None
        self.artifact = None  # what `save` writes when the compile fell back to this process
        self.data = b""  # the worker's artifact file, read at load

    def load(self):
        if self.fn is None:
            try:
                self.seconds = self.future.result(timeout=self.pool.timeout_s)  # a stuck worker: compile here
                from torch._inductor import CompiledArtifact

                self.fn = CompiledArtifact.load(path=self.path, format="binary")
                with open(self.path, "rb") as f:  # kept: the pool's directory goes when the pool closes
                    self.data = f.read()
            except Exception as e:
                log.warning("piece %s: the compile worker failed (%s); compiling it in this process", self.name, e)
                self.pool.failures += 1
                t0 = time.perf_counter()
                self.artifact = self.fn = self.fallback()
                self.seconds = time.perf_counter() - t0
        return self.fn

    def __call__(self, *args):
        if self.fn is None and self.pool.warming and not self.future.done():
            return self.gm(*args)  # warm-up while the worker compiles: outputs nobody reads
        return self.load()(*args)

    def save(self, path: str, format: str = "binary") -> None:
        """Write the compiled artifact (artifacts.py stores pieces with it)."""
        self.load()
        if self.artifact is not None:
            self.artifact.save(path=path, format=format)
        else:
            with open(path, "wb") as f:
                f.write(self.data)
