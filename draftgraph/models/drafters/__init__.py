"""Drafters: EAGLE, EAGLE-3, DeepSeek-style MTP and independent draft models."""

from draftgraph.models.drafters.base import KINDS, Drafter
from draftgraph.models.drafters.draft_model import DraftModelDrafter
from draftgraph.models.drafters.eagle import EagleDrafter
from draftgraph.models.drafters.eagle3 import Eagle3Drafter
from draftgraph.models.drafters.loader import detect_kind, load_drafter, truncated_draft_model
from draftgraph.models.drafters.mtp import MTPDrafter

__all__ = [
    "KINDS",
    "Drafter",
    "DraftModelDrafter",
    "EagleDrafter",
    "Eagle3Drafter",
    "MTPDrafter",
    "detect_kind",
    "load_drafter",
    "truncated_draft_model",
]
