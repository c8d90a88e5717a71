"""`draftgraph serve`'s server: uvicorn on a socket bound here, the app (app.py) and the engine loop.

SIGTERM or SIGINT: uvicorn stops accepting, lets the requests in flight finish for up to DRAIN_S seconds
(the engine keeps stepping), then cancels the rest (their requests are aborted); the engine loop stops, the
engine is closed, and the process exits 0, within 30 s.
"""

from __future__ import annotations

import signal
import socket
import sys

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


def serve(engine, host: str, port: int, served_name: str, max_queue: int, log_level: str = "warning") -> int:
    """Serve `engine` until SIGTERM / SIGINT; returns the exit code."""
    import uvicorn

    from draftgraph.serve.app import build_app
    from draftgraph.serve.engine_loop import EngineLoop

    if max_queue < 0:
        raise ValueError(f"--max-queue={max_queue} must be >= 0 (requests that may wait beyond the running batch)")
    sock = bind(host, port)
    loop = EngineLoop(engine)
    app = build_app(loop, served_name, max_queue)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=DRAIN_S, access_log=False)
    server = uvicorn.Server(config)
    # uvicorn handles SIGTERM / SIGINT itself and raises them again once it has shut down: this handler then
    # ends the process through the `finally` below, with exit code 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_cleanly)
    loop.start()
    bound = sock.getsockname()[1]
    print(f"serving {served_name!r} on http://{host}:{bound} (OpenAI API: /v1/completions, /v1/chat/completions)",
          flush=True)  # fmt: skip
    try:
        server.run(sockets=[sock])
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        loop.stop()
        engine.close()
        sock.close()
        print("server stopped", flush=True)
    return 0


def _exit_cleanly(signum, frame) -> None:
    sys.exit(0)
