"""Target models and drafters over the flat token layout, with the paged attention op."""

from draftgraph.models.causal_lm import CausalLM
from draftgraph.models.config import ModelConfig, RopeConfig

__all__ = ["ModelConfig", "RopeConfig", "CausalLM"]
