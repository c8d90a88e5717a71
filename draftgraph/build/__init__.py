"""Assembling an engine: from a `BuildRequest` (request.py: compile_model's arguments) to a ready `Engine`.

`preflight.py` checks what it can before any weight loads (checkpoint files, the KV cache against memory);
`engine.py` loads the target and drafter, builds the compiled functions (compiler/build.py) or loads them
from artifacts (artifacts/store.py), and constructs the Engine, which sizes its KV cache, warms up and
captures. It sits above runtime/ and artifacts/ and below api.py and workers/, which both call
`build_engine`: the one path to an engine, whether one process builds it or each rank builds its own.
"""
