"""RunRates: what the fused hybrid's head commits per second over its runs, and what the steps
off its chain committed lately, so that a step proposed where the chain is broken can ask
whether restarting the head pays (fused_hybrid.py).

A head run is the head's steps from a restart to the step that leaves the chain (a trie or
plain step, a prefill, the batch's end): its rate is its tokens over its seconds, the restart
included, pooled over the bucket's last few runs. Off the chain, the last OFF_WINDOW - 1 steps'
tokens and seconds, with the step about to be chosen, give the recent rate; a head run
resets them.

Why runs and not steps: on an H100 (1.5B, the kept EAGLE-3 head, code edits at batch 1) a
restart took ~6 ms for ~4 tokens, a plain step ~1.45 ms for one, so step for step a restart
looks no worse than plain decoding where the trie has nothing to propose; but the trie matched
again a step or two later (12-16 tokens a 2.7-ms step) while the head's chain, once restarted,
held the batch for 2-6 steps of ~4 tokens each. The steps off the chain just before a gap
say whether the trie is in a copying stretch (code edits) or rarely matches (chat, where a
head run commits more than plain steps after one or two of them).
"""
from __future__ import annotations

from collections import deque

from specserve.speculative.adaptive.costs import batch_bucket

HEAD_RUNS = 8      # the head runs a bucket's rate pools
MIN_HEAD_RUNS = 2  # a bucket with fewer measured runs has no rate yet (its restarts are the choice's rule)
OFF_WINDOW = 3     # the steps off the chain a recent rate spans, the one to choose included


class RunRates:
    def __init__(self):
        self._head_runs: dict[int, deque[tuple[int, float]]] = {}   # bucket -> (tokens, seconds) of its last runs
        self._head_run: list | None = None      # [bucket, tokens, seconds] of the run going on
        self._off: deque[tuple[int, float]] = deque(maxlen=OFF_WINDOW - 1)

    def step(self, on_chain: bool, batch_size: int, tokens: int, seconds: float) -> None:
        """A step committed: `on_chain`, a head step (a restart or a chained one); its batch,
        committed tokens and price (step_prices.py: the interval from the commit before)."""
        if on_chain:
            if self._head_run is None:
                self._head_run = [batch_bucket(batch_size), 0, 0.0]
            self._head_run[1] += tokens
            self._head_run[2] += seconds
            self._off.clear()
        else:
            self._end_head_run()
            self._off.append((tokens, seconds))

    def interrupted(self) -> None:
        """A prefill ran (or a step went unpriced): the head's run ends, the recent steps are forgotten."""
        self._end_head_run()
        self._off.clear()

    def head_rate(self, batch_size: int) -> float | None:
        """Tokens a second over this bucket's last head runs, their restarts included; None
        before MIN_HEAD_RUNS were measured."""
        runs = self._head_runs.get(batch_bucket(batch_size))
        if runs is None or len(runs) < MIN_HEAD_RUNS:
            return None
        seconds = sum(s for _, s in runs)
        return sum(t for t, _ in runs) / seconds if seconds > 0 else None

    def off_rate(self, tokens: float, seconds: float) -> float:
        """Tokens a second over the recent steps off the chain and one more expected to commit
        `tokens` in `seconds`."""
        total_tokens = tokens + sum(t for t, _ in self._off)
        total_seconds = seconds + sum(s for _, s in self._off)
        return total_tokens / total_seconds if total_seconds > 0 else 0.0

    def _end_head_run(self) -> None:
        run, self._head_run = self._head_run, None
        if run is not None and run[2] > 0:
            self._head_runs.setdefault(run[0], deque(maxlen=HEAD_RUNS)).append((run[1], run[2]))
