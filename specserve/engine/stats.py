"""Periodic engine log line: throughput, queue, KV usage and, when speculating, accept length;
and the engine-wide speculative counters (SpecCounters) that /metrics reports.

The token rate is over the time the engine was busy: the gap before a step that follows an
idle spell (no running or waiting request) is left out, with that step's tokens, so a
stream that ran at 14 tok/s is reported as 14 tok/s and not diluted by the seconds the
engine waited for it. The line goes through logging, which the entry points route through
tqdm (specserve.cli.setup_logging), so it never lands inside a progress bar.
"""
from __future__ import annotations

import logging
import time

logger = logging.getLogger("specserve")


class StepLogger:
    def __init__(self, interval_s: float, speculative: bool):
        self.interval_s = interval_s
        self.speculative = speculative
        self.total_tokens = 0
        self.total_steps = 0
        self._step_tokens = 0        # committed since the previous step ended
        self._busy_tokens = 0        # this window's tokens from steps that followed a busy engine
        self._busy_s = 0.0           # and their time
        self._last_step_end = time.perf_counter()
        self._was_busy = False       # whether work was left when the previous step ended
        self._window_start = self._last_step_end

    def count_tokens(self, n: int) -> None:
        self.total_tokens += n
        self._step_tokens += n

    def maybe_log(self, scheduler) -> None:
        """Called once at the end of every step."""
        self.total_steps += 1
        now = time.perf_counter()
        if self._was_busy:
            self._busy_s += now - self._last_step_end
            self._busy_tokens += self._step_tokens
        self._step_tokens = 0
        self._last_step_end = now
        self._was_busy = scheduler.has_work()
        if now - self._window_start < self.interval_s or self._busy_s <= 0:
            return
        logger.info(self._line(scheduler))
        self._busy_tokens, self._busy_s = 0, 0.0
        self._window_start = now

    def _line(self, scheduler) -> str:
        pool = scheduler.pool
        used = 1.0 - pool.slots.available() / pool.size
        line = (f"generation: {self._busy_tokens / self._busy_s:.1f} tok/s, running {len(scheduler.running)}, "
                f"queued {len(scheduler.waiting)}, KV usage {used:.1%}")
        if self.speculative:
            accept = [r.spec.accept_length for r in scheduler.running if r.spec.verify_steps]
            if accept:
                line += f", accept length {sum(accept) / len(accept):.2f}"
        return line


class SpecCounters:
    """Speculative totals of the whole engine, counted as each step commits (Engine.load()
    reports them, so /metrics moves while long requests run, not only when they finish):
    decode steps of each request and the tokens they committed, bonus included (the sums of
    the requests' SpecStats), and the drafts verified: request steps that had one, their
    draft tokens and the draft tokens accepted (acceptance rate = accepted / draft tokens)."""

    __slots__ = ("verify_steps", "accepted_tokens", "drafts", "draft_tokens", "accepted_draft_tokens")

    def __init__(self):
        self.verify_steps = self.accepted_tokens = 0
        self.drafts = self.draft_tokens = self.accepted_draft_tokens = 0

    def count_commit(self, num_reqs: int, committed_tokens: int) -> None:
        """A decode or verify step's commit: `num_reqs` requests committed `committed_tokens`."""
        self.verify_steps += num_reqs
        self.accepted_tokens += committed_tokens

    def count_verified(self, num_nodes, accept_lens) -> None:
        """A verified step: num_nodes (bs,) tree nodes of each request, its root included;
        accept_lens (bs,) nodes each kept, its root included."""
        drafted = [n - 1 for n in num_nodes.tolist()]
        self.drafts += sum(1 for n in drafted if n > 0)
        self.draft_tokens += sum(drafted)
        self.accepted_draft_tokens += sum(accept_lens.tolist()) - len(drafted)

    def as_dict(self) -> dict:
        return {"spec_verify_steps": self.verify_steps, "spec_accepted_tokens": self.accepted_tokens,
                "spec_drafts": self.drafts, "spec_draft_tokens": self.draft_tokens,
                "spec_accepted_draft_tokens": self.accepted_draft_tokens}
