"""draftgraph: speculative decoding under CUDA graphs, compiled with torch.compile passes.

Every public name is imported on first use (PEP 562): `import draftgraph` loads no torch, so that the
`draftgraph` command can start its compile workers before it imports torch itself (cli.py), and a script's
`import draftgraph` costs nothing until it uses something (tests/test_imports.py).
"""

__all__ = [
    "compile_model",
    "CompileConfig",
    "CUDAGraphMode",
    "SamplingParams",
    "RequestOutput",
    "shared_compile_workers",
]
__version__ = "0.1.0"

_WHERE = {
    "compile_model": "draftgraph.api",
    "CompileConfig": "draftgraph.compiler.config",
    "CUDAGraphMode": "draftgraph.compiler.config",
    "SamplingParams": "draftgraph.runtime.request",
    "RequestOutput": "draftgraph.runtime.request",
    "shared_compile_workers": ("draftgraph.compiler.pool.pool_lifetime", "shared_workers"),
}


def __getattr__(name: str):
    if name in _WHERE:
        import importlib

        module, attr = _WHERE[name] if isinstance(_WHERE[name], tuple) else (_WHERE[name], name)
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'draftgraph' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
