"""Held-out accept length of an EAGLE head: greedy chain drafting simulated against the
target's greedy answers, without running the engine.

In the training-time test every row is the root of a chain fed the target's tokens, which
are the draft's own tokens for as long as the chain is right; so the leading run of steps
whose argmax equals the target's next token is exactly what a verify step would accept.
Decoding is then replayed: after prefill the chain is rooted at the first answer token;
a verify step commits the accepted drafts plus the target's bonus token, and the next
chain is rooted at the last of them. Accept length = committed tokens / verify steps, the
engine's `spec_accept_length`.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from specserve.speculative.heads.eagle_head import EagleHead
from specserve.training.eagle_ttt import ConversationBatch, unroll


@dataclass
class AcceptStats:
    committed_tokens: int = 0
    verify_steps: int = 0

    @property
    def accept_length(self) -> float:
        return self.committed_tokens / max(self.verify_steps, 1)

    def add(self, other: AcceptStats) -> None:
        self.committed_tokens += other.committed_tokens
        self.verify_steps += other.verify_steps


@torch.no_grad()
def accept_length(head: EagleHead, batches: Iterable[ConversationBatch], draft_steps: int,
                  autocast_dtype: torch.dtype | None = None) -> AcceptStats:
    stats = AcceptStats()
    for batch in batches:
        device_type = batch.tokens.device.type
        with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            runs = accepted_runs(head, batch, draft_steps)
        stats.add(replay_decoding(runs.cpu(), batch.lengths.tolist(), batch.prompt_lens.tolist()))
    return stats


def accepted_runs(head: EagleHead, batch: ConversationBatch, draft_steps: int) -> torch.Tensor:
    """(B, T): drafts a verify step would accept from a chain rooted after row t."""
    rows = batch.learning_rows(draft_steps)   # elsewhere no step drafts an answer token: 0 accepted
    alive = torch.ones(rows.shape, dtype=torch.bool, device=rows.device)
    run = torch.zeros(rows.shape, dtype=torch.long, device=rows.device)
    for step, output in enumerate(unroll(head, batch, draft_steps, rows)):
        draft = head.to_target_ids(head.logits(output).argmax(-1))
        target = batch.shifted_tokens(2 + step).flatten()[rows]
        alive &= batch.predicts_answer(step).flatten()[rows] & (draft == target)
        run += alive
    return torch.zeros(batch.shape, dtype=torch.long, device=rows.device).view(-1).index_copy(0, rows, run).view(batch.shape)


def replay_decoding(runs: torch.Tensor, lengths: list[int], prompt_lens: list[int]) -> AcceptStats:
    stats = AcceptStats()
    for row, (length, prompt_len) in enumerate(zip(lengths, prompt_lens)):
        root = prompt_len   # prefill produced this token; the chain's row is the one before it
        while root < length - 1:
            # the accepted drafts and the bonus token; a chain right to the answer's end has no bonus
            committed = min(int(runs[row, root - 1]) + 1, length - 1 - root)
            stats.verify_steps += 1
            stats.committed_tokens += committed
            root += committed
    return stats
