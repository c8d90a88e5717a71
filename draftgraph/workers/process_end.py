"""Ending a process once its work is done, without the interpreter's teardown (issue 44): the `draftgraph`
command's process (cli/commands.py `finish`) and each worker rank's (workers/worker.py, told to stop).

`run_exit_handlers()` runs the exit handlers that clean up (compile pools and their worker processes, worker
ranks, private caches, weakref.finalize'd objects, logging's flush, any other library's) except Inductor's wait
for its compile subprocesses to shut down (seconds: 10 s on an H100 where they were still starting; they end
themselves when their parent is gone); loaded artifacts' private directories are handed to a process of their
own to remove. `exit_now(rc)` flushes the standard streams and ends the process with `os._exit`: no freeing of
every object and of the CUDA context one by one (the kernel reclaims it all at once), no process-group teardown
(a rank's NCCL communicator destroy waits on its peers; the driver's stop reaches every rank at once).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from typing import NoReturn


def run_exit_handlers() -> None:
    """The process's exit handlers now, less Inductor's wait for its compile subprocesses."""
    inductor = sys.modules.get("torch._inductor.async_compile")
    if inductor is not None and hasattr(inductor, "shutdown_compile_workers"):
        atexit.unregister(inductor.shutdown_compile_workers)
    private = sys.modules.get("draftgraph.artifacts.private_cache")
    if private is not None:  # loaded artifacts' private directories: removed by a process that outlives this one
        private.remove_detached()
    atexit._run_exitfuncs()


def exit_now(rc: int) -> NoReturn:
    """Flush the standard streams and end the process with status `rc`, skipping the interpreter's teardown."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(rc)
