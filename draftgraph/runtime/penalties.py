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

The processing itself is ops/logits/penalties.py: on CUDA two Triton launches, one read and one write of the logits
(OpChoices.logits_kernels; the torch ops elsewhere). Rows whose request asks for none of it keep their raw logits bit
for bit, and a step whose requests ask for none of it (host-known) runs none of this: the one-graph step's
"_penalties" variants.

The drafter's proposals get the same processing (`process_draft`, from runtime/drafting.py's loop): draft j is
chosen from the drafter's logits processed after the slot's output (this step's emitted tokens already recorded)
and drafts 0..j-1, exactly as the next verify's row j will process the target's, so a drafter that agrees with the
target keeps agreeing under penalties. Sampled drafts are drawn from, and their q kept as, the processed
distribution: rejection sampling stays exact. A drafter over a reduced vocabulary (EAGLE-3's d2t) is processed in
the target's: its logits at their target ids, -inf elsewhere (runtime/drafting.py Chooser.processed). Not processed
(raw logits: exact, acceptance may drop where the penalties change the target's choice): the fused draft loop
(fuse_draft_loop=True, used only when the one-graph step is off: one traced graph per variant, which has no
penalties variant).
"""

from __future__ import annotations

import torch

from draftgraph.ops.logits.penalties import MAX_LOGIT_BIAS, PROMPT, STOP, PenaltyTables, process_logits

__all__ = ["MAX_LOGIT_BIAS", "PROMPT", "STOP", "PenaltyState"]


class PenaltyState:
    """Per request slot device buffers of the logits processing (`max_num_seqs` slots plus a scratch row)."""

    def __init__(self, max_num_seqs: int, vocab_size: int, device, kernel: bool = True):
        self.rows, self.scratch, self.vocab_size, self.device = max_num_seqs + 1, max_num_seqs, vocab_size, device
        self.kernel = kernel  # OpChoices.logits_kernels: the Triton kernels on CUDA (ops/logits/triton_penalties.py)
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
        self.tables = PenaltyTables(
            self.counts, self.flags, self.repetition, self.presence, self.frequency, self.min_tokens,
            self.generated, self.bias_ids, self.bias_vals, self.active,
        )  # fmt: skip
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
        slot), where row i of a request comes after drafts[:, :i] (drafts [B, R - 1], None when R = 1):
        ops/logits/penalties.py (the Triton kernels on CUDA unless OpChoices.logits_kernels is off)."""
        return process_logits(logits, slots, drafts, self.tables, self.kernel)

    def process_draft(self, logits: torch.Tensor, slots: torch.Tensor, prior: list[torch.Tensor]) -> torch.Tensor:
        """The drafter's logits [B, V] of a draft step (over the target's vocabulary) processed as the next verify's
        row j = len(prior) will be: after the slot's output and the drafts `prior` ([B] each) proposed before it."""
        drafts = torch.stack(prior, dim=1) if prior else None
        return process_logits(logits[:, None], slots, drafts, self.tables, self.kernel, len(prior))[:, 0]

    def record(self, slots: torch.Tensor, tokens: torch.Tensor, num_emitted: torch.Tensor) -> None:
        """Count the tokens a step emitted: tokens [B, R] of requests in slots [B], the first num_emitted [B] of
        each row (padding rows: the scratch slot). In place, on the device."""
        b, r = tokens.shape
        keep = torch.arange(r, device=tokens.device)[None, :] < num_emitted[:, None]  # [B, R]
        flat = (slots[:, None] * self.vocab_size + tokens.long()).reshape(-1)  # into counts viewed flat
        self.counts.view(-1).index_add_(0, flat, keep.reshape(-1).int())  # atomic adds: padding rows share scratch
        self.generated.index_add_(0, slots, num_emitted.long())
