"""`draftgraph serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over an engine stepping in a
background thread. server.py (uvicorn, signals), app.py (the endpoints), engine_loop.py (the engine thread,
continuous batching), protocol.py (request bodies, errors), metrics.py (Prometheus). FastAPI, uvicorn and
prometheus-client are the `serve` extra (`pip install -e ".[serve]"`); nothing here is imported by
`import draftgraph`."""
