"""The n-gram (prompt lookup) drafter kind: `compile_model(target, drafter="ngram")`, `--drafter ngram`.

It has no model: no weights, no KV cache, no forward. Each step looks up the last n tokens of a request's own
prompt and output (n from `CompileConfig.ngram_max` down to `ngram_min`, checked by compiler/config.py) earlier
in that history and proposes the K tokens that followed the latest occurrence (drafters/ngram_match.py), on the
device inside the step (runtime/ngram_state.py keeps the per-slot history). Its proposals are deterministic: the
draft distribution q is one-hot at each proposed token, which runtime/rejection.py applies when it is given no q
(accept with min(1, p(x)), recover from p with x removed), so sampling keeps the target's distribution.
"""

from __future__ import annotations

from typing import Any

NGRAM = "ngram"  # the drafter argument (and drafter_kind) that selects it


def is_ngram(drafter: Any, kind: str | None) -> bool:
    """Whether compile_model's `drafter` / `drafter_kind` select the n-gram drafter; a contradictory pair is refused."""
    named = isinstance(drafter, str) and drafter == NGRAM
    if kind == NGRAM and not named:
        raise ValueError(
            f"drafter_kind='ngram' needs drafter='ngram' (it has no checkpoint), not {type(drafter).__name__} "
            f"{drafter!r}; pass drafter='ngram' (CLI: --drafter ngram), or another drafter_kind for this drafter"
        )
    if named and kind not in (None, NGRAM):
        raise ValueError(
            f"drafter='ngram' with drafter_kind={kind!r}: the n-gram drafter is its own kind; drop drafter_kind or "
            "set it to 'ngram'"
        )
    return named
