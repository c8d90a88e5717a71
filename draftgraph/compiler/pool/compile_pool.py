"""Compiling an engine's unique pieces in parallel, in worker processes (issue 16, item 3).

Inductor compiles of one process run one after another (standalone_compile holds process-global state), and
each costs seconds of Python (lowering, code generation) whatever the piece's size. A `CompilePool` starts
one process (`python -m draftgraph.compiler.pool.compile_worker`, not multiprocessing: a user's script is never
re-imported) when the engine build begins, so that it starts while the weights load. It imports torch,
Inductor and the modules defining our custom ops once, then forks `workers` workers, which connect to the
pool's Unix socket (in a private temporary directory) and take jobs there. The piecewise
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
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future

from tqdm import tqdm

from draftgraph import timeline

log = logging.getLogger("draftgraph")


# The workers' niceness (os.nice, inherited by everything they start): below the engine process, whose imports and
# tracing are a start's critical path; the workers still get every core the engine process leaves idle.
NICE = 10


def worker_threads(workers: int) -> int:
    """Inductor's compile threads in each worker (TORCHINDUCTOR_COMPILE_THREADS there): the cores shared out.
    (1 per worker, which spares each its own pool of Triton-compile processes, measured no faster:
    docs/history/benchmarks-2026-11.md.)"""
    return max(1, (os.cpu_count() or 1) // workers)


def draftgraph_modules() -> list[str]:
    """The draftgraph modules a worker imports: those defining the custom ops this process has registered (a
    graph's calls of them resolve only where they are defined; ops/registry.py records where). Not the rest: the
    models' modules import transformers, seconds on every worker's critical path."""
    from draftgraph.ops.registry import DEFINED_IN

    loaded = {m for m in sys.modules if m == "draftgraph" or m.startswith("draftgraph.")}
    return sorted({m for op, m in DEFINED_IN.items() if op.startswith("draftgraph::") and m in loaded})


_stopping: list[int] = []  # killed workers' process ids not yet seen to exit (wait_stopped)


def _pid_alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def wait_stopped(timeout_s: float = 10.0) -> int:
    """Wait, at most timeout_s in all, until every killed compile worker has exited: a worker's CUDA context
    (from its prewarm) leaves the device only then, and runtime/memory.py measures the device after this.
    Returns how many are still running."""
    deadline = time.monotonic() + timeout_s
    while True:
        _stopping[:] = [pid for pid in _stopping if _pid_alive(pid)]
        if not _stopping or time.monotonic() >= deadline:
            return len(_stopping)
        time.sleep(0.02)


def worker_env(device: str, cache_dir: str, threads: int, modules: tuple[str, ...]) -> dict:
    import draftgraph

    root = os.path.dirname(os.path.dirname(draftgraph.__file__))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    env["DRAFTGRAPH_COMPILE_DEVICE"] = device
    env["TORCHINDUCTOR_COMPILE_THREADS"] = str(threads)  # Triton kernel compiles: the cores shared out
    # The modules defining our custom ops, imported once in the workers' parent before it forks
    env["DRAFTGRAPH_COMPILE_MODULES"] = ",".join(modules)
    # torch.cuda.is_available() / device_count() through NVML, not the CUDA runtime: a runtime call in the
    # workers' parent (an import makes one) would forbid CUDA in every child it forks
    env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    if cache_dir:
        env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    return env


class _Worker:
    """One forked worker process, talked to over its connection to the pool's socket (one JSON line each way)."""

    def __init__(self, index: int, pid: int, conn: socket.socket, reader, log_path: str):
        self.index, self.pid, self.conn, self.log_path = index, pid, conn, log_path
        self.reader = reader  # the one reader of this connection (it buffers: a second would lose lines)
        self.writer = conn.makefile("w", encoding="utf-8")
        self.ready_s: float | None = None  # seconds from the pool's start until the worker said it was ready
        self.phases: dict = {}  # the worker's start, phase by phase (its ready message)
        self.went = False  # whether the pool sent its go (CompilePool.release)

    def ask(self, job: dict | None) -> dict:
        """Send a job (None: only read the next reply) and wait for its reply; raises when the worker died."""
        try:
            if job is not None:
                self.writer.write(json.dumps(job) + "\n")
                self.writer.flush()
            line = self.reader.readline()
        except OSError:
            line = ""
        if not line:
            raise RuntimeError(f"compile worker {self.index} (pid {self.pid}) exited; see {self.log_path}")
        return json.loads(line)

    def alive(self) -> bool:
        return _pid_alive(self.pid)

    def close(self) -> None:
        """Stop the process without waiting for it: every answer is in, and an interpreter with Inductor and
        CUDA loaded takes seconds to exit (measured: 11 s for 8 workers when waited for one by one)."""
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)
        _stopping.append(self.pid)
        for f in (self.reader, self.writer, self.conn):
            with contextlib.suppress(OSError):
                f.close()


class CompilePool:
    """`workers` compile processes, forked from one parent process that imported torch, Inductor and the
    modules defining our custom ops once (before any CUDA call, so the children may use CUDA): eight processes
    importing all that side by side took 20 s to be ready on 16 cores (docs/history/benchmarks-2026-11.md,
    2026-11-23)."""

    def __init__(
        self,
        workers: int,
        device: str,
        progress: bool = True,
        cache_dir: str = "",
        modules: tuple | None = None,
        held: bool = False,
    ):
        """`held`: the workers wait after forking (no CUDA start, no prewarm) until `release()`; else they start
        at once."""
        if workers < 1:
            raise ValueError(f"a compile pool needs at least 1 worker, got {workers}")
        self.t0 = time.perf_counter()
        self.n, self.device, self.cache_dir = workers, device, cache_dir
        self.taken_s: float | None = None  # seconds from the pool's start until a build took it (prestart)
        self.dir = tempfile.mkdtemp(prefix="draftgraph-compile-")  # private (0700): the socket lives here
        threads = worker_threads(workers)
        address = os.path.join(self.dir, "workers.sock")
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(address)
        self.server.listen(workers)
        self.server.settimeout(0.2)
        # the modules defining our ops, imported once before the forks (a prestarted pool knows none yet:
        # each job names them, and a worker imports what it lacks)
        env = worker_env(device, cache_dir, threads, tuple(draftgraph_modules()) if modules is None else modules)
        env["DRAFTGRAPH_COMPILE_ADDRESS"] = address
        env["DRAFTGRAPH_COMPILE_FORKS"] = str(workers)
        env["DRAFTGRAPH_COMPILE_NICE"] = str(NICE)
        self.log_path = os.path.join(self.dir, "workers.log")
        self.log = open(self.log_path, "w")  # noqa: SIM115 - open while the processes live
        self.parent = subprocess.Popen(
            [sys.executable, "-m", "draftgraph.compiler.pool.compile_worker"],
            stdin=subprocess.DEVNULL, stdout=self.log, stderr=self.log, env=env, start_new_session=True,
        )  # fmt: skip
        self.workers: list[_Worker] = []  # as they connect
        self.jobs: queue.Queue = queue.Queue()
        self.pending: list[PendingPiece] = []
        self.warming = True  # until wait_all: unfinished pieces run their FX graph eagerly
        self.failures = 0
        self.threads_per_worker = threads
        self.waited_s = 0.0
        self.timeout_s = 600.0  # the longest wait for one piece's compile before compiling it in this process
        self.progress = progress
        self.closed = False
        self.accepting = True  # until every worker connected, or the parent process is gone
        self.released = not held  # whether the workers may start (each gets its go once: _go)
        self._bar = None
        self._next = 0
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        """Take the forked workers' connections as they come; each gets a thread that feeds it jobs."""
        gone_at = None
        try:
            while len(self.workers) < self.n and not self.closed:
                try:
                    conn, _ = self.server.accept()
                except TimeoutError:
                    if self.parent.poll() is not None:  # no more forks; a child's connection may still be queued
                        gone_at = gone_at or time.monotonic()
                        if time.monotonic() - gone_at > 1.0:
                            break
                    continue
                except OSError:  # closed
                    break
                conn.settimeout(None)
                reader = conn.makefile("r", encoding="utf-8")
                try:
                    hello = json.loads(reader.readline())
                except (OSError, ValueError):
                    conn.close()
                    continue
                worker = _Worker(hello["index"], hello["pid"], conn, reader, self.log_path)
                with self._lock:
                    self.workers.append(worker)
                    if self.closed:  # closed while this one connected
                        worker.close()
                        break
                    if self.released:
                        self._go(worker)
                threading.Thread(target=self._serve, args=(worker,), daemon=True).start()
        finally:
            self.accepting = False
            if not self.closed and self._all_dead():
                why = RuntimeError(f"no compile worker started; their log ends:\n{self.log_tail()}")
                log.warning("%s", why)
                self._drain(why)

    def release(self) -> None:
        """Let the workers start (CUDA, prewarm): those connected now, and the rest as they connect. A pool
        started `held` (prestart: before the engine process imports torch) is released once those imports are
        done, so that eight workers' CUDA starts and first compiles (each with Inductor's compile subprocesses,
        which import torch again) do not compete with them; a no-op when released already."""
        with self._lock:
            self.released = True
            for w in self.workers:
                self._go(w)

    def _go(self, worker: _Worker) -> None:
        """Send `worker` its go, once (under self._lock)."""
        if worker.went:
            return
        worker.went = True
        try:
            worker.writer.write("{}\n")
            worker.writer.flush()
        except OSError:  # it died: its serving thread reports that
            pass

    def log_tail(self, lines: int = 15) -> str:
        """The last lines the workers wrote (their errors), for messages: the log goes with the pool."""
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def _serve(self, worker: _Worker) -> None:
        try:
            ready = worker.ask(None)
            worker.ready_s = time.perf_counter() - self.t0
            worker.phases = ready.get("phases", {})
            if "error" in ready:
                log.info("compile worker %d: %s", worker.index, ready["error"])
            log.debug("compile worker %d ready after %.1f s: %s", worker.index, worker.ready_s, worker.phases)
            with self._lock:
                if sum(w.ready_s is not None for w in self.workers) == self.n:
                    timeline.mark("compile workers ready", f"{self.n} processes")
        except RuntimeError as e:
            log.warning("%s; the log ends:\n%s", e, self.log_tail())
            return self._drain(e)
        while (item := self.jobs.get()) is not None:
            job, future = item
            try:
                reply = worker.ask(job)
            except RuntimeError as e:
                future.set_exception(e)
                return self._drain(e)
            future.done_s = time.perf_counter() - self.t0
            if reply["ok"]:
                future.set_result(reply["seconds"])
            else:
                future.set_exception(RuntimeError(f"{reply['error']} (worker log: {worker.log_path})"))
            with self._lock:
                if self._bar is not None:
                    self._bar.update(1)

    def begin(self, progress: bool) -> None:
        """A build takes this pool (started earlier: prestarted, or shared and used by earlier builds): its
        pieces, failures and waits are counted from here; held workers start now at the latest."""
        self.release()
        with self._lock:
            self.pending, self.failures, self.waited_s = [], 0, 0.0
            self.warming, self.progress = True, progress
            self.taken_s = time.perf_counter() - self.t0

    def drop_queued(self) -> None:
        """Fail every job no worker has taken yet (a build that ended early, e.g. by an error, leaves the
        shared pool to the next one); a job a worker is on finishes, and nobody reads it."""
        self._fail_queued(RuntimeError("the build that queued this compile is gone"))

    def _fail_queued(self, error: Exception) -> None:
        """Fail every job still in the queue with `error`."""
        while True:
            try:
                item = self.jobs.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[1].set_exception(error)

    def usable(self) -> bool:
        """Not closed, and some worker runs or may still start."""
        return not self.closed and not self._all_dead()

    def _all_dead(self) -> bool:
        """No worker runs, and none can still connect."""
        if self.accepting and self.parent.poll() is None:
            return False
        return not any(w.alive() for w in self.workers)

    def _drain(self, error: Exception) -> None:
        """A dead worker: when no worker is left alive, fail what is queued (it compiles in-process)."""
        if self._all_dead():
            self._fail_queued(error)

    def submit(self, name: str, gm, encoded_graph: dict, encoded_inputs: dict, options, fallback) -> PendingPiece:
        """Queue one piece's compile; `fallback()` compiles it in this process if the worker cannot."""
        with self._lock:
            self._next += 1
            out = os.path.join(self.dir, f"piece{self._next}.bin")
        # The worker imports every draftgraph module this process has: a graph's custom ops are registered
        # where they are defined (ops/, and a few in runtime/, e.g. the sampling probabilities).
        modules = draftgraph_modules()
        from draftgraph.ops.collectives.op import group_sizes

        # group_sizes: the collectives' fakes shape their outputs by them; a worker has no process group
        job = {"id": self._next, "graph": encoded_graph, "inputs": encoded_inputs, "out": out,
               "options": [list(kv) for kv in options], "modules": modules, "group_sizes": group_sizes()}  # fmt: skip
        future: Future = Future()
        future.submitted_s = time.perf_counter() - self.t0
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
                             desc=f"compiling pieces in {self.n} processes", unit="piece",
                             disable=not self.progress or not left)  # fmt: skip
        for p in self.pending:
            p.load()
        self.warming = False
        with self._lock:
            self._bar.close()
            self._bar = None
        self.waited_s = time.perf_counter() - t0
        log.info("%s", self.timeline_text())
        return self.waited_s

    def timeline(self) -> dict:
        """When the workers were ready and the pieces compiled, in seconds from the pool's start (stats'
        `compile.compile_pool`): what a cold start waited for."""
        ready = [w.ready_s for w in self.workers if w.ready_s is not None]
        futures = [p.future for p in self.pending]
        seconds = [p.seconds for p in self.pending if p.seconds is not None]
        done = [f.done_s for f in futures if hasattr(f, "done_s")]
        return {
            "workers": self.n,
            "connected": len(self.workers),
            "phases_s": {
                k: round(statistics.median(w.phases[k] for w in self.workers if k in w.phases), 2)
                for k in sorted({k for w in self.workers for k in w.phases})
            },  # medians over workers
            "threads_per_worker": self.threads_per_worker,
            "ready_s": [round(min(ready), 2), round(max(ready), 2)] if ready else None,
            "pieces": len(self.pending),
            "first_submitted_s": round(min(f.submitted_s for f in futures), 2) if futures else None,
            "last_done_s": round(max(done), 2) if done else None,
            "piece_seconds": [round(min(seconds), 2), round(max(seconds), 2), round(sum(seconds), 2)]
            if seconds
            else None,
            "waited_s": round(self.waited_s, 2),
            "taken_s": None if self.taken_s is None else round(self.taken_s, 2),
        }

    def timeline_text(self) -> str:
        t = self.timeline()
        ready = "none ready" if t["ready_s"] is None else "ready after {:.1f}-{:.1f} s".format(*t["ready_s"])
        text = f"compile workers: {t['workers']} ({t['threads_per_worker']} Triton threads each), {ready}"
        if t["taken_s"] is not None:
            text += f" (started {t['taken_s']:.1f} s before the engine build took them)"
        if t["phases_s"]:
            text += " (" + ", ".join(f"{k} {v:.1f} s" for k, v in t["phases_s"].items()) + ")"
        if t["piece_seconds"] is not None:
            lo, hi, total = t["piece_seconds"]
            text += f"; {t['pieces']} pieces of {lo:.1f}-{hi:.1f} s ({total:.1f} s in all)"
        if t["first_submitted_s"] is not None and t["last_done_s"] is not None:
            text += f", first sent at {t['first_submitted_s']:.1f} s, last done at {t['last_done_s']:.1f} s"
        return text + f"; the engine waited {t['waited_s']:.1f} s for them"

    def close(self) -> None:
        with self._lock:
            self.closed = True
            workers = list(self.workers)
        for _ in range(self.n):
            self.jobs.put(None)
        for w in workers:
            w.close()
        with contextlib.suppress(OSError):  # the parent, and any child not yet connected: one process group
            os.killpg(self.parent.pid, signal.SIGKILL)
        threading.Thread(target=self.parent.wait, daemon=True).start()  # reaped in the background
        _stopping.append(self.parent.pid)
        self.server.close()
        self.log.close()
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

                from draftgraph.compiler.inductor_options import loading_in_process

                with loading_in_process():
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
