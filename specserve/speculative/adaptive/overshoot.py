"""ChoiceOvershoot: how much a bucket's drafting choices overshot, the rate a choice expected
over the rate its step realized, over the bucket's last few drafting steps (the policy
raises its switch margin by it: policy.py, OPTIMISM_WINDOW).

Tokens and time are read apart. The tokens a drafting step commits vary far more than its
cost: where drafts copy text, most verify steps commit one or two tokens and one in several
commits ten or more. A median of per-step ratios then reads a model whose mean is right as
optimistic: a batch-1 JSON edit on a busy 2-core CPU (SmolLM2-135M, a 16-node chain) read
1.6-2.6, which doubled the switch margin, kept the run plain after its first episode and
made NGRAM 0.76-0.92x plain where drafting every step made 1.14x. So the token part is the
ratio of the window's sums, expected over committed; the cost part is the median of each
step's time over the price its choice used (a stall is one step, and the median drops it).

An episode that won by the switch margin clears its bucket's record (`clear`): the choice ends
an episode when its own estimate falls below plain's, after a run of steps that committed less
than it expected, so the window an episode ends with reads as overshoot whatever the model's
mean; and the episode's switch paid. Kept, it raised the margin of the next switch by up to
MAX_OPTIMISM (H200, 1.5B, an EAGLE-3 chain of 3 at batch 1, code-types: the timed run's first
probe expected 1.28x at the right prices, 2.2 ms against 1.24 ms a step, and stayed plain under
the record its warm-up left, where drafting every step made 1.53x; a replay of such a bucket,
lab/policy_sim_b1.py, drafts 0.66 -> 0.79 of its steps without the record).
"""
from __future__ import annotations

from collections import deque

from specserve.speculative.adaptive.costs import RecentMedians


class ChoiceOvershoot:
    def __init__(self, window: int):
        self.window = window
        self._tokens: dict[int, deque] = {}        # bucket -> (expected, committed) of its last steps
        self._costs = RecentMedians(window)         # bucket -> the median of seconds / price

    def add(self, bucket: int, expected_tokens: float, price: float, tokens: int, seconds: float) -> float:
        """A drafting step of the bucket whose choice expected `expected_tokens` in `price`
        seconds, and that committed `tokens` in `seconds`; returns the bucket's overshoot now."""
        recent = self._tokens.setdefault(bucket, deque(maxlen=self.window))
        recent.append((expected_tokens, tokens))
        cost_overshoot = self._costs.add(bucket, seconds / price)
        expected = sum(e for e, _ in recent)
        committed = max(sum(t for _, t in recent), 1)
        return expected / committed * cost_overshoot

    def clear(self, bucket: int) -> None:
        """Forgets the bucket's steps (an episode that won ended: see the module docstring)."""
        self._tokens.pop(bucket, None)
        self._costs.clear(bucket)
