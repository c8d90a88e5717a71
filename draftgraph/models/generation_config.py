"""End-of-sequence ids from where checkpoints keep them: config.json and generation_config.json.

transformers' generate reads eos ids from generation_config.json; many checkpoints list several there
(Llama 3: `[128001, 128008, 128009]`) and only one, or none, in config.json. A target's stop set is the
union of both, in the order first seen.
"""

from __future__ import annotations

import json
import os
from typing import Any

GENERATION_CONFIG = "generation_config.json"


def eos_ids(value: Any, where: str) -> tuple[int, ...]:
    """An `eos_token_id` entry (None, an int, or a list of ints) as a tuple; anything else is refused."""
    if value is None:
        return ()
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in items):
        raise ValueError(
            f"eos_token_id={value!r} in {where} is not a token id or a list of them; "
            "write an int >= 0, a list of such ints, or null"
        )
    return tuple(items)


def checkpoint_generation_eos(path: str) -> tuple[int, ...]:
    """The eos ids of `path`/generation_config.json, or () when the file is absent."""
    file = os.path.join(path, GENERATION_CONFIG)
    if not os.path.exists(file):
        return ()
    try:
        with open(file) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e}); fix or delete the file") from e
    if not isinstance(data, dict):
        raise ValueError(f"{file} holds a {type(data).__name__}, not a JSON object; fix or delete the file")
    return eos_ids(data.get("eos_token_id"), file)


def model_generation_eos(hf_model: Any) -> tuple[int, ...]:
    """The eos ids of a transformers model object's `generation_config` (() when it has none)."""
    gen = getattr(hf_model, "generation_config", None)
    return eos_ids(getattr(gen, "eos_token_id", None), "the model's generation_config")


def merge_eos(*groups: tuple[int, ...]) -> tuple[int, ...]:
    """The union of several eos id tuples, first occurrence first."""
    return tuple(dict.fromkeys(t for g in groups for t in g))
