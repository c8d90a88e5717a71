"""draftgraph: speculative decoding under CUDA graphs, compiled with torch.compile passes."""

from draftgraph.api import compile_model
from draftgraph.compiler.config import CompileConfig, CUDAGraphMode
from draftgraph.runtime.request import RequestOutput, SamplingParams

__all__ = ["compile_model", "CompileConfig", "CUDAGraphMode", "SamplingParams", "RequestOutput"]
__version__ = "0.1.0"
