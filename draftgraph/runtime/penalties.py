"""Logits processing of the target per request: logit_bias, min_tokens, repetition / presence / frequency penalties.

Applied on the device to the target's logits before temperature and top-k / top-p, in vLLM's order: the bias is
added, stop tokens get -inf while fewer than min_tokens tokens are generated, then the repetition penalty (over
prompt and output tokens: a logit > 0 is divided by it, else multiplied: transformers' meaning), then
logit -= frequency_penalty * count + presence_penalty * (count > 0) over output tokens (OpenAI's formula).
Logprobs keep the raw logits (runtime/logprobs.py).

Exact under speculation: verify row i of a request sees drafts 0..i-1 as already generated, so its counts are the
slot's counts plus the drafts before it, and its generated length is the slot's plus i (every row is processed with
the slot's counts, then the K draft columns, the only ones whose counts differ, again with each row's). Nothing
waits for the host: `PenaltyState` keeps per request slot (the last row is scratch for padding rows) the
output token counts [slots, V] int32, a flag byte per vocabulary entry (in the prompt; a stop token), the penalty
values, min_tokens, the generated length and the logit bias (at most MAX_LOGIT_BIAS (id, bias) pairs). A step
records its emitted tokens into them on the device (`record`), so overlapped steps need nothing from the host. The
host writes a slot's row only when its request starts a prefill at position 0 (a new request, or one recomputed
after a preemption: its counts are rebuilt from its output), in `admit`.

Rows whose request asks for none of it keep their raw logits bit for bit (a final where), and a step whose
requests ask for none of it (host-known) runs none of this: the one-graph step's "_penalties" variants.

Only the target's logits are processed: the drafter proposes from its raw logits. Greedy and sampled outputs stay
exact (rejection sampling needs only the q the drafts were drawn from); acceptance may drop where the penalties
change the target's choice.
"""

from __future__ import annotations

import torch

MAX_LOGIT_BIAS = 300  # (id, bias) pairs a request may give: OpenAI's limit; a fixed width of the device table
PROMPT, STOP = 1, 2  # flag bits per vocabulary entry: in the prompt (repetition penalty), a stop token (min_tokens)


class PenaltyState:
    """Per request slot device buffers of the logits processing (`max_num_seqs` slots plus a scratch row)."""

    def __init__(self, max_num_seqs: int, vocab_size: int, device):
        self.rows, self.scratch, self.vocab_size, self.device = max_num_seqs + 1, max_num_seqs, vocab_size, device
        self.allocated = False  # the buffers come with the first request that asks for logits processing

    def _allocate(self) -> None:
        """The buffers, once (about 5 bytes per vocabulary entry per slot: an engine whose requests never ask for
        penalties holds none of it). Graphs read them in place: never reallocated."""
        rows, dev = self.rows, torch.device(self.device)
        self.counts = torch.zeros(rows, self.vocab_size, dtype=torch.int32, device=dev)  # output tokens
        self.flags = torch.zeros(rows, self.vocab_size, dtype=torch.uint8, device=dev)  # PROMPT | STOP bits
        self.repetition = torch.ones(rows, dtype=torch.float32, device=dev)
        self.presence = torch.zeros(rows, dtype=torch.float32, device=dev)
        self.frequency = torch.zeros(rows, dtype=torch.float32, device=dev)
        self.min_tokens = torch.zeros(rows, dtype=torch.long, device=dev)
        self.generated = torch.zeros(rows, dtype=torch.long, device=dev)
        self.bias_ids = torch.zeros(rows, MAX_LOGIT_BIAS, dtype=torch.long, device=dev)
        self.bias_vals = torch.zeros(rows, MAX_LOGIT_BIAS, dtype=torch.float32, device=dev)
        self.active = torch.zeros(rows, dtype=torch.bool, device=dev)
        self.allocated = True

    # ---- the host side ------------------------------------------------------------------------------

    def admit(self, reqs) -> None:
        """Write the slot rows of requests starting a prefill at position 0 (new, or recomputed after a preemption:
        counts from their output so far). Requests without logits processing only mark their slot inactive."""
        if not self.allocated and any(r.params.uses_logits_processing for r in reqs):
            self._allocate()
        for r in reqs:
            s, p = r.slot, r.params
            if not p.uses_logits_processing:
                if self.allocated:
                    self.active[s] = False
                continue
            v = self.vocab_size
            counts = torch.bincount(torch.tensor(r.output, dtype=torch.long), minlength=v)[:v].int()
            flags = torch.zeros(v, dtype=torch.uint8)
            flags[torch.tensor(r.prompt, dtype=torch.long)] |= PROMPT
            if r.stop_ids:
                flags[torch.tensor(sorted(r.stop_ids), dtype=torch.long)] |= STOP
            ids = torch.zeros(MAX_LOGIT_BIAS, dtype=torch.long)
            vals = torch.zeros(MAX_LOGIT_BIAS, dtype=torch.float32)
            if p.logit_bias:
                ids[: len(p.logit_bias)] = torch.tensor([t for t, _ in p.logit_bias])
                vals[: len(p.logit_bias)] = torch.tensor([b for _, b in p.logit_bias])
            self.counts[s] = counts.to(self.device, non_blocking=True)
            self.flags[s] = flags.to(self.device, non_blocking=True)
            self.bias_ids[s] = ids.to(self.device, non_blocking=True)
            self.bias_vals[s] = vals.to(self.device, non_blocking=True)
            self.repetition[s], self.presence[s] = p.repetition_penalty, p.presence_penalty
            self.frequency[s], self.min_tokens[s] = p.frequency_penalty, p.min_tokens
            self.generated[s] = len(r.output)
            self.active[s] = True

    # ---- the device side ----------------------------------------------------------------------------

    def process(self, logits: torch.Tensor, slots: torch.Tensor, drafts: torch.Tensor | None) -> torch.Tensor:
        """Processed logits [B, R, V] for logits [B, R, V] of requests in slots [B] (padding rows: the scratch
        slot), where row i of a request comes after drafts[:, :i] (drafts [B, R - 1], None when R = 1).

        Every row is processed with the slot's counts ([B, 1, V], broadcast); then the only entries whose count
        differs between a request's rows, the K draft columns, are processed again with row i's counts there
        (the slot's plus the drafts before i equal to that column) and written over: [B, R, K] values, not a
        [B, R, V] count tensor per step."""
        b, r, v = logits.shape
        counts, flags = self.counts[slots], self.flags[slots]  # [B, V]
        bias = torch.zeros(b, v, dtype=torch.float32, device=logits.device)
        bias.scatter_add_(-1, self.bias_ids[slots], self.bias_vals[slots])  # absent pairs add 0 to token 0
        generated = self.generated[slots][:, None] + torch.arange(r, device=logits.device)[None, :]  # [B, R]
        too_early = (generated < self.min_tokens[slots][:, None])[..., None]  # [B, R, 1]
        rep, freq, pres = (t[slots][:, None, None] for t in (self.repetition, self.frequency, self.presence))
        x = _processed(logits.float(), counts[:, None], flags[:, None], bias[:, None], too_early, rep, freq, pres)
        if drafts is not None and r > 1:  # row i also counts drafts 0..i-1: only their columns change
            k = r - 1
            cols = drafts[:, :k].long()  # [B, K]
            at = cols[:, None, :].expand(b, r, k)  # [B, R, K]: row i, draft column j
            same = cols[:, :, None] == cols[:, None, :]  # [B, K (j'), K (j)]: draft j' is the token of column j
            ar = torch.arange(r, device=logits.device)
            before = (torch.arange(k, device=logits.device)[None, :] < ar[:, None])[None, :, :, None]  # j' < i
            extra = (before & same[:, None]).sum(2, dtype=torch.int32)  # [B, R, K]
            fixed = _processed(
                logits.gather(-1, at).float(), counts.gather(-1, cols)[:, None, :] + extra,
                flags.gather(-1, cols)[:, None, :], bias.gather(-1, cols)[:, None, :], too_early, rep, freq, pres,
            )  # fmt: skip
            x = x.scatter(-1, at, fixed)  # a column drafted twice gets the same value from both
        return torch.where(self.active[slots][:, None, None], x.to(logits.dtype), logits)

    def record(self, slots: torch.Tensor, tokens: torch.Tensor, num_emitted: torch.Tensor) -> None:
        """Count the tokens a step emitted: tokens [B, R] of requests in slots [B], the first num_emitted [B] of
        each row (padding rows: the scratch slot). In place, on the device."""
        b, r = tokens.shape
        keep = torch.arange(r, device=tokens.device)[None, :] < num_emitted[:, None]  # [B, R]
        flat = (slots[:, None] * self.vocab_size + tokens.long()).reshape(-1)  # into counts viewed flat
        self.counts.view(-1).index_add_(0, flat, keep.reshape(-1).int())  # atomic adds: padding rows share scratch
        self.generated.index_add_(0, slots, num_emitted.long())


def _processed(x, counts, flags, bias, too_early, rep, freq, pres):
    """The processing of module docstring's order on logits x (float32) with counts, flags and bias broadcast to
    it: bias; -inf on stop tokens while too early; repetition over seen tokens; frequency and presence."""
    x = (x + bias).masked_fill(too_early & ((flags & STOP) != 0), float("-inf"))
    seen = (counts > 0) | ((flags & PROMPT) != 0)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return x - freq * counts - pres * (counts > 0)
