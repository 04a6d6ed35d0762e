"""TrieCalibration: per request, how much of what its trie drafts' class expected they commit,
where the trie would have been chosen for them.

The trie's expectations are per evidence class (the length of the matched suffix), measured over
every request the engine serves. A class of long matches is measured mostly where such matches
are common (code edits, repeated text) and seldom on chat, so on a chat request it promises what
code commits, and it is exactly when it promises most that the choice takes it. On an H100 (1.5B,
the hybrid, chat at batch 8 after code in the same engine) the trie steps the choice took committed
165 tokens where their classes expected 230, each followed by the head's restart: the hybrid ran
0.91-0.93x of EAGLE-3 alone. At batch 1 on code they committed what was expected (465 against 470).

So each request's contending trie proposals (class expectation above the head's for the
request: the ones the choice would take) are walked as every shadow is, and the request's factor
is what they committed over what their classes expected (moving averages of both); the choice
scales the class's expectation by it. A request starts at 1 (the classes as measured), and one
walk moves it a step of ACCEPT_EMA.
"""
from __future__ import annotations

from specserve.speculative.adaptive.acceptance import ACCEPT_EMA, Shadow, committed_at

# how far a request's factor may move the classes' expectations: a few unlucky walks must not
# shut the trie out for good (the factor keeps moving while the trie's counterfactuals are walked)
MIN_FACTOR, MAX_FACTOR = 0.25, 2.0


class TrieCalibration:
    def __init__(self, max_nodes: int):
        self.max_nodes = max_nodes
        self._pending: dict[str, list[tuple[Shadow, float]]] = {}   # rid -> (shadow, class expectation)
        self._sums: dict[str, tuple[float, float]] = {}             # rid -> (committed, expected) moving averages

    def note(self, rid: str, shadow: Shadow, expected: float) -> None:
        """A contending proposal's shadow (acceptance.py's, walked by the choice's evidence) and
        what its class expected it to commit."""
        self._pending.setdefault(rid, []).append((shadow, expected))

    def update(self, rids: list[str]) -> None:
        """After the evidence walked these requests' shadows: the ended ones move their factors."""
        pending = self._pending
        for rid in filter(pending.__contains__, rids):
            waiting = []
            for shadow, expected in pending[rid]:
                if shadow.ended:
                    self._move(rid, committed_at(shadow.path, self.max_nodes), expected)
                else:
                    waiting.append((shadow, expected))
            if waiting:
                pending[rid] = waiting
            else:
                del pending[rid]

    def _move(self, rid: str, committed: float, expected: float) -> None:
        # a request starts from its class's promise kept (factor 1), which each walk moves by
        # ACCEPT_EMA: started from its first walk, one miss of a code request at batch 1 (3 of
        # 12 tokens) set the factor to 0.25, and its head steps ran until the average recovered
        committed_sum, expected_sum = self._sums.get(rid, (expected, expected))
        self._sums[rid] = (committed_sum + ACCEPT_EMA * (committed - committed_sum),
                           expected_sum + ACCEPT_EMA * (expected - expected_sum))

    def factor(self, rid: str) -> float:
        sums = self._sums.get(rid)
        if sums is None:
            return 1.0
        return min(MAX_FACTOR, max(MIN_FACTOR, sums[0] / sums[1]))

    def release(self, rid: str) -> None:
        self._pending.pop(rid, None)
        self._sums.pop(rid, None)
