"""How far one step may write a request's KV: the one worst case the scheduler allocates blocks for.

Target and drafter share each request's block table (runtime/step.py), so a step needs blocks for the
furthest position either model writes. For a request with `c` cached positions that feeds `n` rows this
step (a prompt chunk's tokens, or a decode's last token + K drafts), the rows sit at positions c..c+n-1:

* the target (step.py) writes exactly those rows;
* without sampling (a prompt chunk that does not finish the prompt, or no drafter) that is all;
* when the request samples, the drafter's first step (proposer.py) runs over the same rows, plus one row
  at c+n for an independent draft model (the new token, fed as its own row); its first draft is read at
  row p <= c+n-1 (+1 for a draft model: the decode's accepted count picks the row on the device, so the
  host allocates for all K accepted), and the K-1 later steps (drafting.py's `draft_loop`) write
  positions p+1 .. p+K-1.

So a sampling step writes up to position c+n-1 + extra_row + K-1, which covers the first step's rows.
Slots past what a request keeps are overwritten before they are read (rollback by length), but they
must lie in blocks the request owns: the later draft steps derive slots from the block table on the
device, and an entry past the owned blocks would point at another request's block.
"""

from __future__ import annotations

from dataclasses import dataclass

from draftgraph.models.drafters.base import Drafter


@dataclass(frozen=True)
class StepWrites:
    """KV positions one step may write per request, for `k` drafts per step."""

    k: int  # drafts per step; 0: no drafter runs
    extra_row: int  # 1 for an independent draft model (its first step has a row past the target's), else 0

    @classmethod
    def of(cls, drafter: Drafter | None, k: int) -> StepWrites:
        if drafter is None or not k:
            return cls(0, 0)
        return cls(k, int(drafter.target_hidden == "none"))

    @property
    def decode_rows(self) -> int:
        """Rows a decoding request feeds the target: its last token and the K drafts."""
        return self.k + 1

    def slots(self, num_cached: int, num_rows: int, samples: bool) -> int:
        """KV slots (positions 0 .. slots-1) a request needs for a step feeding `num_rows` rows after
        `num_cached` cached positions; `samples`: the step emits a token for it (so drafts it)."""
        end = num_cached + num_rows
        if not samples or not self.k:
            return end
        return end + self.extra_row + self.k - 1

    def lifetime_slots(self, prompt_len: int, max_tokens: int) -> int:
        """The most slots a request of this prompt and max_tokens ever needs at once: its last decode
        (at most max_tokens - 1 tokens emitted, the last of them not yet cached), or its prefill. A
        recomputation after preemption prefills fewer rows than that decode feeds and caches."""
        need = self.slots(0, prompt_len, samples=True)
        if max_tokens >= 2:
            need = max(need, self.slots(prompt_len + max_tokens - 2, self.decode_rows, samples=True))
        return need
