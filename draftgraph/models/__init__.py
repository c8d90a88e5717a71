"""Target models and drafters over the flat token layout, with the paged attention op."""

from draftgraph.models.config import ModelConfig, RopeConfig
from draftgraph.models.llama import CausalLM

__all__ = ["ModelConfig", "RopeConfig", "CausalLM"]
