"""draftgraph: speculative decoding under CUDA graphs, compiled with torch.compile passes.

`compile_model` is imported on first use (PEP 562): it brings in torch._dynamo (about 1 s), and
`import draftgraph` should cost little beyond `import torch` (tests/test_imports.py).
"""

from draftgraph.compiler.config import CompileConfig, CUDAGraphMode
from draftgraph.runtime.request import RequestOutput, SamplingParams

__all__ = ["compile_model", "CompileConfig", "CUDAGraphMode", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "compile_model":
        from draftgraph.api import compile_model

        return compile_model
    raise AttributeError(f"module 'draftgraph' has no attribute {name!r}")
