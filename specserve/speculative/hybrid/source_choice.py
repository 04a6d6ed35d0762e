"""SourceChoice: for each request's step, whether its draft comes from the n-gram trie or the
EAGLE head, by which is expected to commit more.

The evidence is measured, as the adaptive policy's is (adaptive/acceptance.py: a proposal's
"shadow" is walked down the tokens the request commits next, which in greedy decoding do not
depend on the drafts, so what any proposal would have committed is known):

- the trie: per evidence class, the length of the matched suffix (NgramDrafter's keys: a
  one-token match rarely pays, a long one often does; a class not measured yet borrows the
  measure of the longest shorter match). The trie proposes for every request
  of every drafting step whichever source is chosen (microseconds), so its classes learn from
  every step, and the counts behind a match show in the class's measured acceptance (the
  trie does not report them per proposal);
- the head: per request (a head is good on some text and poor on other), from the steps it
  drafted for the request, or the head's estimate over all requests before the request has one;
- a class's expectation, for a request, is scaled by what that request's contending trie drafts
  (those whose class expected more than the head) committed against it (trie_calibration.py): a
  class measured on code promises a chat request what code commits.

A request drafts from the trie where it matched, its class (or a shorter match's) has been
measured, and the class expects more tokens than the head does for the request; otherwise from the head (the source
the user loaded). The head's estimate of a request moves only while the head drafts for it,
so a request the trie has drafted for HEAD_RECHECK_STEPS steps in a row takes the head once.

The adaptive policy prices both: `policy_keys` gives it the trie's evidence classes, and
for the head's drafts none, so that it measures them per request.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from specserve.speculative.adaptive.acceptance import AcceptanceEvidence
from specserve.speculative.hybrid.trie_calibration import TrieCalibration
from specserve.verify.tree import TreeProposal

NGRAM, HEAD = "ngram", "head"
# a request drafted by the trie this many steps in a row takes the head's drafts once, so
# that its head estimate follows the text
HEAD_RECHECK_STEPS = 16
# Where the head's steps are fused (fused_hybrid.py: each fused step drafts the next chain and
# the next step is queued before this one is read), a step of trie drafts breaks the chain: it
# is verified on its own (its other requests take their pending drafts or their roots alone),
# and the head's next fused step first catches up on the rows it skipped (an eager forward and
# a host sync). So the batch's trie drafts must be expected to commit more than the head's by
# what their steps cost beyond the head's (step_prices.py, measured per batch bucket): where the
# chain runs, a trie step and the restart after it against a chained step; where it is broken
# already, a trie step against the chained steps the restart leads back to. BREAK_GAIN scales
# that excess (1: tokens weighed exactly by the measured prices). Before the prices are measured,
# the trie's drafts must commit UNPRICED_EXCESS times the batch's head tokens more: at batch 1 on
# an H100 (1.5B, EAGLE-3 chains of 3) a chained step took ~2.0 ms, the trie's verify step ~2.2
# and a restarted head step ~4, so a trie step and its restart cost about two chained steps.
# Without the rule, a batch of 8 on chat whose requests each preferred the trie now and then
# never got back to fused steps (5.7-13.9 ms a step where fused ones took ~2.6 ms).
BREAK_GAIN = 1.0
UNPRICED_EXCESS = 1.0


class SourceChoice:
    def __init__(self, max_nodes: int, head_depth: int):
        """max_nodes: the largest draft a step verifies (the root included): both sources'
        proposals are compared whole. head_depth: the head's drafts' depth (its steps), which
        bounds what they commit: the head's estimate starts there, every draft accepted, and
        comes down as its drafts are measured."""
        self.max_nodes = max_nodes
        self.head_most = head_depth + 1
        self.ngram = AcceptanceEvidence([max_nodes])   # per match-length class
        self.head = AcceptanceEvidence([max_nodes])    # per request
        self.calibration = TrieCalibration(max_nodes)  # per request: what its classes' promises are worth
        self._trie_streak: dict[str, int] = {}         # rid -> steps the trie drafted in a row
        # an instrument's (bench/policy_trace.py), told each choice as a dict; None: nobody listens
        self.listener: Callable[[dict], None] | None = None

    def expected_from_trie(self, key: int, rid: str | None = None) -> float | None:
        """Tokens a trie proposal of class `key` is expected to commit: its class's measure, or
        that of the longest shorter match measured (a longer match is no weaker evidence), for
        request `rid` scaled by its calibration (trie_calibration.py); None where no match this
        long or shorter has been measured."""
        measured = self.ngram.measured_at_most(key)
        if measured is None:
            return None
        expected = self.ngram.expected_tokens("", self.max_nodes, measured)
        return expected if rid is None else expected * self.calibration.factor(rid)

    def expected_from_head(self, rid: str) -> float:
        return min(self.head.expected_tokens(rid, self.max_nodes), self.head_most)

    def choose(self, rids: list[str], trie_nodes: list[int], trie_keys: list[int],
               excess: float | None = None, head_ready: np.ndarray | None = None) -> np.ndarray:
        """(bs,) bool: True where the request drafts from the trie this step. excess: where the
        head's steps are fused, what a trie step costs beyond the head's, in the head's steps
        (step_prices.py; None: unpriced): trie drafts are taken only where they pay for it.
        head_ready: (bs,) bool, the requests that keep head drafts in a step with trie drafts
        (None: all); the others verify their roots alone there."""
        use_trie = self.preferred(rids, trie_nodes, trie_keys)
        event = None if self.listener is None else self._event("choose", rids, trie_nodes, trie_keys, use_trie, excess,
                                                              head_ready)
        if excess is not None and use_trie.any() and not self.pays(rids, use_trie, trie_keys, excess, head_ready):
            use_trie[:] = False
        self.took(rids, use_trie)
        if event is not None:
            self.listener({**event, "taken": int(use_trie.sum())})
        return use_trie

    def stay_off(self, rids: list[str], trie_nodes: list[int], trie_keys: list[int], use_trie: np.ndarray,
                 off_rate: float, head_rate: float) -> np.ndarray:
        """A step the fused hybrid keeps off the head's chain by rates (fused_hybrid.py), the
        trie's drafts where `use_trie`: recorded as a choice is (the streaks, the listener's
        event with both rates in tokens a second). Returns use_trie."""
        self.took(rids, use_trie)
        if self.listener is not None:
            self.listener({**self._event("choose", rids, trie_nodes, trie_keys, use_trie, None),
                           "taken": int(use_trie.sum()), "off_rate": round(off_rate), "head_rate": round(head_rate)})
        return use_trie

    def took(self, rids: list[str], use_trie: np.ndarray) -> None:
        """A step's sources (True: the trie's), for each request's streak of trie steps."""
        for rid, trie in zip(rids, use_trie.tolist()):
            self._trie_streak[rid] = self._trie_streak.get(rid, 0) + 1 if trie else 0

    def trie_may_go_on(self, rids: list[str]) -> bool:
        """Whether none of these requests is due to take the head's drafts at its next step
        (HEAD_RECHECK_STEPS)."""
        return all(self._trie_streak.get(rid, 0) < HEAD_RECHECK_STEPS for rid in rids)

    def preferred(self, rids: list[str], trie_nodes: list[int], trie_keys: list[int]) -> np.ndarray:
        """(bs,) bool: where the trie's draft is expected to commit more than the head's, the
        request not due for a recheck of the head."""
        use_trie = np.zeros(len(rids), dtype=bool)
        for i, (rid, nodes, key) in enumerate(zip(rids, trie_nodes, trie_keys)):
            trie = self.expected_from_trie(key, rid) if nodes > 1 else None
            use_trie[i] = (trie is not None and self._trie_streak.get(rid, 0) < HEAD_RECHECK_STEPS
                           and trie > self.expected_from_head(rid))
        return use_trie

    def pays(self, rids: list[str], use_trie: np.ndarray, trie_keys: list[int], excess: float,
             head_ready: np.ndarray | None = None) -> bool:
        """Whether the trie's step (its drafts where `use_trie`) is expected to commit more than
        the head's would by BREAK_GAIN * excess times the batch's head tokens."""
        gain, head = self._gain(rids, use_trie, trie_keys, head_ready)
        return gain >= BREAK_GAIN * excess * head

    def _gain(self, rids: list[str], use_trie: np.ndarray, trie_keys: list[int],
              head_ready: np.ndarray | None = None) -> tuple[float, float]:
        """What a step with the trie's drafts where `use_trie` is expected to commit over one of
        the head's drafts alone (less what the requests without head drafts beside them, per
        head_ready, lose: all but their root), and what the head's drafts are expected to commit
        over the batch."""
        head = [self.expected_from_head(rid) for rid in rids]
        gain = sum(self.expected_from_trie(key, rid) - expected
                   for rid, trie, key, expected in zip(rids, use_trie.tolist(), trie_keys, head) if trie)
        if head_ready is not None:
            gain -= sum(expected - 1 for trie, ready, expected in zip(use_trie.tolist(), head_ready.tolist(), head)
                        if not trie and not ready)
        return gain, sum(head)

    def breaks_chain(self, rids: list[str], trie_nodes: list[int], trie_keys: list[int], excess: float) -> bool:
        """Whether trie drafts at these roots would have paid for breaking the head's chain
        (a chained step's counterfactual: the next step is then proposed after its read);
        excess: what breaking costs beyond the chain's steps, as in choose."""
        use_trie = self.preferred(rids, trie_nodes, trie_keys)
        breaks = bool(use_trie.any()) and self.pays(rids, use_trie, trie_keys, excess)
        if self.listener is not None:
            self.listener({**self._event("counterfactual", rids, trie_nodes, trie_keys, use_trie, excess),
                           "taken": breaks})
        return breaks

    def _event(self, kind: str, rids: list[str], trie_nodes: list[int], trie_keys: list[int], use_trie: np.ndarray,
               excess: float | None, head_ready: np.ndarray | None = None) -> dict:
        """A choice for the listener: the batch, how many requests had trie drafts, preferred
        them (`use_trie`) and were due the head's recheck, the trie's expected gain over the
        head where preferred and the head's expected tokens over the batch; the caller adds
        `taken` (how many took the trie's drafts; a counterfactual: whether they would break
        the chain). excess: the price the trie's drafts had to pay (None: beside an unfused head)."""
        gain, head = self._gain(rids, use_trie, trie_keys, head_ready)
        return {"e": "source", "kind": kind, "bs": len(rids), "excess": None if excess is None else round(excess, 2),
                "with_trie": sum(n > 1 for n in trie_nodes), "preferred": int(use_trie.sum()),
                "due_head": sum(not self.trie_may_go_on([rid]) for rid in rids),
                "trie_gain": round(gain, 2), "head_tokens": round(head, 2)}

    def record(self, rids: list[str], trie: TreeProposal, trie_nodes: list[int], trie_keys: list[int],
               head: TreeProposal, head_nodes: list[int]) -> None:
        """Every trie proposal, and the head's (those of the requests it drafted for), as
        shadows to walk; the trie's that contend with the head (their class expects more than
        the head does for the request) calibrate their request's trie expectations."""
        shadows = self.ngram.record(rids, trie, trie_nodes, trie_keys)
        for rid, shadow, key in zip(rids, shadows, trie_keys):
            if shadow is not None:
                expected = self.expected_from_trie(key)
                if expected is not None and expected > self.expected_from_head(rid):
                    self.calibration.note(rid, shadow, expected)
        self.head.record(rids, head, head_nodes)

    def observe_batch(self, rids: list[str], committed: list[list[int]]) -> None:
        self.ngram.observe_batch(rids, committed)
        self.calibration.update(rids)
        self.head.observe_batch(rids, committed)

    def policy_keys(self, use_trie: np.ndarray, trie_keys: list[int]) -> list[int | None]:
        """The adaptive policy's evidence class of each request's draft: the trie's match
        length, or None for the head's, which the policy measures per request as it does
        for a head alone (classes by the head's expected tokens, tried before, moved with
        every step's outcome: each class's estimate rested on few walks, a chat episode at
        batch 1 on an H100 ended on them where EAGLE-3 alone drafted on, and the bucket
        stayed plain)."""
        return [key if trie else None for trie, key in zip(use_trie.tolist(), trie_keys)]

    def release(self, rid: str) -> None:
        self.ngram.release(rid)
        self.head.release(rid)
        self.calibration.release(rid)
        self._trie_streak.pop(rid, None)
