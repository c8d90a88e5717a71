"""Text in and out: the tokenizer of a checkpoint, prompt encoding, and incremental detokenization.

transformers is imported only when a tokenizer is loaded. Output text is the generated ids decoded with
special tokens skipped (the prompt excluded). While streaming, `IncrementalDetokenizer` decodes a short
window of recent ids per step and holds text back while it ends in U+FFFD, the mark of a character whose
bytes are split over tokens not all generated yet (byte-level BPE, SentencePiece byte fallback).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("draftgraph")

# Files of which at least one marks a directory as holding a tokenizer transformers can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
HOW_TO_GIVE = (
    "pass compile_model(..., tokenizer=DIR or a transformers tokenizer) (CLI: --tokenizer DIR), "
    "or give prompts as lists of token ids"
)


def has_tokenizer_files(path: str) -> bool:
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES)


def load_tokenizer(path: str):
    """transformers' AutoTokenizer from the local directory `path` (never the hub)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer directory {path!r} does not exist; {HOW_TO_GIVE}")
    if not has_tokenizer_files(path):
        raise FileNotFoundError(
            f"{path!r} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}); save one there with "
            f"tokenizer.save_pretrained({path!r}), or {HOW_TO_GIVE}"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... depending on the file
        raise ValueError(
            f"the tokenizer in {path!r} could not be loaded ({type(e).__name__}: {e}); fix its tokenizer files, "
            "pass another with compile_model(..., tokenizer=...) (CLI: --tokenizer DIR), or tokenizer=False to "
            "work with token ids only"
        ) from e


def resolve_tokenizer(tokenizer: Any, target: Any):
    """The engine's tokenizer: `tokenizer` itself (an object with encode / decode), the one in directory
    `tokenizer`, none when `tokenizer` is False, or (None, the default) the one saved beside the target's
    checkpoint (a directory, or a transformers model's `name_or_path`) when there is one."""
    if tokenizer is False:
        return None
    if isinstance(tokenizer, (str, os.PathLike)):
        return load_tokenizer(os.fspath(tokenizer))
    if tokenizer is not None:
        if not (callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None))):
            raise TypeError(
                f"tokenizer of type {type(tokenizer).__name__} has no encode / decode; pass a transformers "
                "tokenizer, a directory holding one, or None"
            )
        return tokenizer
    path = target if isinstance(target, str) else getattr(getattr(target, "config", None), "_name_or_path", "")
    if path and has_tokenizer_files(path):
        log.info("tokenizer: loaded from %s", path)
        return load_tokenizer(path)
    return None


def encode_prompt(tokenizer, prompt: str | Sequence[int]) -> list[int]:
    """Token ids of a prompt given as text (through the tokenizer, special tokens such as BOS added as the
    tokenizer does by default) or as ids (unchanged)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            shown = prompt if len(prompt) <= 40 else prompt[:40] + "..."
            raise ValueError(f"prompt {shown!r} is text, but this engine has no tokenizer; {HOW_TO_GIVE}")
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, (bytes, dict)):
        raise TypeError(f"a prompt is a str or a list of token ids, not {type(prompt).__name__}")
    return [int(t) for t in prompt]


def decode_text(tokenizer, token_ids: Sequence[int]) -> str:
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)


class IncrementalDetokenizer:
    """One request's text, a piece per step. `push(new_ids)` returns the text that the new ids complete;
    `finish()` returns the rest, so the pieces always add up to `decode_text` of every id pushed.

    Each push decodes only ids[prefix:] against ids[prefix:read] (a window that starts at the last
    emitted boundary), so a step costs the window, not the whole output."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the window decoded for context
        self.read = 0  # ids before this have had their text emitted
        self.sent = 0  # characters emitted so far

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(int(t) for t in new_ids)
        before = decode_text(self.tokenizer, self.ids[self.prefix : self.read])
        now = decode_text(self.tokenizer, self.ids[self.prefix :])
        if len(now) <= len(before) or now.endswith("\ufffd"):
            return ""  # nothing new, or a character still missing some of its bytes
        piece = now[len(before) :]
        self.prefix, self.read = self.read, len(self.ids)
        self.sent += len(piece)
        return piece

    def finish(self) -> str:
        """The text not yet returned: the full decode minus what was sent (held-back bytes included)."""
        full = decode_text(self.tokenizer, self.ids)
        rest = full[self.sent :]
        self.sent = len(full)
        self.prefix = self.read = len(self.ids)
        return rest


class StopStrings:
    """A request's stop-string search over its output text, a token at a time. `push(id)` says whether the
    text now contains a stop string; then `text` is the output text cut before the first one it came to hold
    (the one that ends first; after it with `include`). Each push searches only the text a stop could newly
    end in (its last characters)."""

    def __init__(self, tokenizer, stops: Sequence[str], include: bool):
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stops, self.include = tuple(stops), include
        self.longest = max(len(s) for s in stops)
        self.full = ""  # the text pushed so far (a character split over tokens waits for its last byte)
        self.text: str | None = None  # the cut text, once a stop string is found
        self.stop: str | None = None  # which stop string ended the text

    @property
    def found(self) -> bool:
        return self.text is not None

    def push(self, token_id: int) -> bool:
        piece = self.detok.push([token_id])
        if not piece or self.found:
            return self.found
        start = max(0, len(self.full) - self.longest + 1)  # a stop found now ends in the new piece
        self.full += piece
        hits = [(at, s) for s in self.stops if (at := self.full.find(s, start)) >= 0]
        if not hits:
            return False
        at, self.stop = min(hits, key=lambda h: (h[0] + len(h[1]), h[0]))  # the first to end: text first holds it
        self.text = self.full[: at + len(self.stop) if self.include else at]
        return True

    @staticmethod
    def holdback(stops: Sequence[str]) -> int:
        """Characters a stream holds back while a request may still stop: a stop string's start may be among
        them (the longest stop but one character)."""
        return max((len(s) for s in stops), default=1) - 1
