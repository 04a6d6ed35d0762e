"""StepPrices: what the fused hybrid's three kinds of step cost, measured per batch bucket, so
that the choice between the trie's drafts and the head's (source_choice.py) weighs tokens by
what the step that commits them costs.

The kinds, by how the step's drafts were proposed (fused_hybrid.py):
- CHAINED: the head's fused step, queued before the step before it was read;
- RESTART: the head's fused step proposed after a read (after trie steps, plain steps or a
  change of the batch): the head first catches up on the rows it did not draft from;
- TRIE: a step with trie drafts, which the engine verifies on its own;
- PLAIN: the fused hybrid's roots alone, where neither source pays (fused_hybrid.py): a plain
  step launched ahead at batch 1, a verify of the roots above it.
A step proposed as none of these (the adaptive policy's plain steps) is not priced.
They differ most where it matters: on an H100 (1.5B, EAGLE-3 chains of 3, code edits) a chained
step took ~2.0 ms at batch 1 and 5-6 ms at 64, a trie step of 16 nodes 2.7 and 12-14.6 ms, and
the restart after it 3.9-5.7 and 14-16 ms; so at 64 a batch's trie drafts that committed twice the
head's tokens (the rule without prices) lost to the chain they broke.

A kind's first step at a bucket is often its slowest by far (a kernel compiled for its shape, a
graph captured, cold caches), and a price that high keeps its kind from running again, so from
ever being priced again: on an H100 (1.5B, sampled code edits at batch 8) the first trie step
took 272 ms and the second 10; priced at their median, a trie step and its restart came to ~36
chained steps, and no trie draft broke the head's chain for the rest of the run (head steps of
~24 tokens where trie steps committed ~85). So a kind is priced from its second step at a
bucket on, at the cheaper of its first two, then at the median of its last PRICE_WINDOW.

A step's price is the time from the commit of the step before to its own commit, no prompt
prefilled in between: with steps launched ahead, that is what the step adds to a run (its own
GPU time where the host hides behind it, the host's where it does not). Requests that end
leave the batch without a step of their own, so those intervals count (at 64 a batch that
drains changes at nearly every step). Each step is known by its first request and the position
of its root, noted when the step is proposed and found again at its commit; a proposal that
never ran (a look that decided on a plain step) is dropped once its request has moved past it.
"""
from __future__ import annotations

import statistics

from specserve.speculative.adaptive.costs import RecentMedians, batch_bucket

CHAINED, RESTART, TRIE, PLAIN = "chained", "restart", "trie", "plain"
PRICE_WINDOW = 5   # the median of the last few steps of a kind: one stall is one step
FIRST_PRICED = 2   # a kind is priced from its this-many-th step at a bucket on (the module docstring)
# Where restarts are not priced yet (they are the rarest kind): a restart costs this many
# chained steps (H100 above: 2-2.8x at batch 1, ~2.5x at 64)
RESTART_PRIOR = 2.0


class StepPrices:
    def __init__(self):
        self._seconds = RecentMedians(PRICE_WINDOW)
        self._price: dict[tuple[str, int], float] = {}   # (kind, bucket) -> seconds, from FIRST_PRICED steps on
        self._proposed: dict[str, list[tuple[int, str]]] = {}   # rid -> (root position, kind), in order
        self._last_commit: float | None = None   # None: nothing since a prefill (or ever) to price from

    def proposed(self, rid: str, root: int, kind: str) -> None:
        """A step proposed for a batch whose first request is `rid`, rooted at position `root`."""
        self._proposed.setdefault(rid, []).append((root, kind))

    def committed(self, rids: list[str], root: int, now: float) -> tuple[str | None, float] | None:
        """A step of `rids` rooted at `root` (its first request's) committed at `now`. Returns
        its kind (None: proposed as none) and its time, None where a prefill came between (or
        the batch is empty)."""
        if not rids:
            return None
        kind, timed = self._kind_at(rids[0], root), None
        if self._last_commit is not None:
            timed = kind, now - self._last_commit
            if kind is not None:
                self._add((kind, batch_bucket(len(rids))), timed[1])
        self._last_commit = now
        return timed

    def _add(self, key: tuple[str, int], seconds: float) -> None:
        self._seconds.add(key, seconds)
        recent = self._seconds.values(key)
        if len(recent) > FIRST_PRICED:
            self._price[key] = statistics.median(recent)
        elif len(recent) == FIRST_PRICED:
            self._price[key] = min(recent)

    def prefilled(self) -> None:
        """A prefill ran: the next commit's interval holds it, and prices nothing."""
        self._last_commit = None

    def _kind_at(self, rid: str, root: int) -> str | None:
        steps = self._proposed.get(rid)
        while steps and steps[0][0] < root:   # proposed, never run
            steps.pop(0)
        if steps and steps[0][0] == root:
            return steps.pop(0)[1]
        return None

    def price(self, kind: str, batch_size: int) -> float | None:
        """Seconds a step of `kind` costs at this batch's bucket; None before FIRST_PRICED were measured."""
        return self._price.get((kind, batch_bucket(batch_size)))

    def break_excess(self, batch_size: int) -> float | None:
        """Where the head's steps are chained: what a trie step and the restart after it cost
        beyond two chained steps, in chained steps. None where the trie or the chain is not
        priced at this bucket."""
        chained, trie = self.price(CHAINED, batch_size), self.price(TRIE, batch_size)
        if chained is None or trie is None:
            return None
        restart = self.price(RESTART, batch_size) or RESTART_PRIOR * chained
        return max(trie + restart - 2 * chained, 0.0) / chained

    def stay_excess(self, batch_size: int) -> float | None:
        """Where the chain is broken already (the head's next step is a restart, now or once
        the trie's steps end): what a trie step costs beyond a chained step, in chained steps."""
        chained, trie = self.price(CHAINED, batch_size), self.price(TRIE, batch_size)
        if chained is None or trie is None:
            return None
        return max(trie - chained, 0.0) / chained

    def release(self, rid: str) -> None:
        self._proposed.pop(rid, None)
