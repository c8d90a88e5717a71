"""`draftgraph serve`'s server: uvicorn on a socket bound first, the app (app.py) and the engine loop, which
builds the engine in its thread while uvicorn already answers: /health says 503 (loading) until the engine is
ready, then 200, so that load balancers and Kubernetes probes see a live process from the start.

SIGTERM or SIGINT: uvicorn stops accepting, lets the requests in flight finish for up to DRAIN_S seconds
(the engine keeps stepping), then cancels the rest (their requests are aborted); the engine loop stops, the
engine is closed, and the process exits 0, within 30 s. An engine that fails to build stops the server, and
`serve` raises its error.
"""

from __future__ import annotations

import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DRAIN_S = 15


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (port 0: a free one, printed once bound)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port} ({e}); pick another --port (0: any free one)") from e
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


@dataclass(frozen=True)
class Server:
    """uvicorn's server over the app, and the engine loop behind it (started by `start_loop`)."""

    http: Any  # uvicorn.Server
    loop: Any  # EngineLoop


def make_server(make_engine: Callable[[], Any], served_name: str, max_queue: int, log_level: str = "warning") -> Server:
    """The app over an engine loop that will build its engine with `make_engine()`; an engine that fails to
    build stops the HTTP server."""
    import uvicorn

    from draftgraph.serve.app import build_app
    from draftgraph.serve.engine_loop import EngineLoop

    if max_queue < 0:
        raise ValueError(f"--max-queue={max_queue} must be >= 0 (requests that may wait beyond the running batch)")
    http: list = []

    def failed(error: BaseException) -> None:
        http[0].should_exit = True

    loop = EngineLoop(make_engine, on_load_failure=failed)
    config = uvicorn.Config(build_app(loop, served_name, max_queue), log_level=log_level,
                            timeout_graceful_shutdown=DRAIN_S, access_log=False)  # fmt: skip
    http.append(uvicorn.Server(config))
    return Server(http[0], loop)


def serve(make_engine: Callable[[], Any], sock: socket.socket, served_name: str, max_queue: int,
          log_level: str = "warning") -> int:  # fmt: skip
    """Serve on `sock` the engine `make_engine()` builds (in the background) until SIGTERM / SIGINT; returns the
    exit code, or raises the engine's build error."""
    server = make_server(make_engine, served_name, max_queue, log_level)
    # uvicorn handles SIGTERM / SIGINT itself and raises them again once it has shut down: this handler then
    # ends the process through the `finally` below, with exit code 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_cleanly)
    host, bound = sock.getsockname()[:2]
    print(f"serving {served_name!r} on http://{host}:{bound} (OpenAI API: /v1/completions, /v1/chat/completions); "
          "GET /health answers 503 until the engine is ready", flush=True)  # fmt: skip
    server.loop.start()
    try:
        server.http.run(sockets=[sock])
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        server.loop.stop()
        if server.loop.engine is not None:
            server.loop.engine.close()
        sock.close()
        print("server stopped", flush=True)
    if server.loop.load_error is not None:
        raise server.loop.load_error
    return 0


def _exit_cleanly(signum, frame) -> None:
    sys.exit(0)
