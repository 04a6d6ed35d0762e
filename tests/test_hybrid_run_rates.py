"""The fused hybrid's runs (speculative/hybrid/run_rates.py and fused_hybrid.py): a head run's
rate pools its restart and chained steps per bucket; where the chain is broken, a step stays
off it (the trie's drafts, or the roots alone as a plain step) while the recent steps off the
chain commit more a second than the head's runs did, and restarts the head once they do not."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from specserve.speculative.hybrid.fused_hybrid import FusedHybridDrafter
from specserve.speculative.hybrid.run_rates import MIN_HEAD_RUNS, RunRates
from specserve.speculative.hybrid.step_prices import PLAIN, RESTART, TRIE
from specserve.verify.tree import TreeProposal


def test_a_head_runs_rate_counts_its_restart_and_ends_off_the_chain():
    runs = RunRates()
    for _ in range(MIN_HEAD_RUNS):
        assert runs.head_rate(1) is None
        runs.step(True, 1, 4, 0.006)        # a restart
        runs.step(True, 1, 4, 0.002)        # a chained step
        runs.step(False, 1, 16, 0.0027)     # a trie step ends the run
    assert runs.head_rate(1) == pytest.approx(8 / 0.008)
    assert runs.head_rate(64) is None       # per batch bucket
    # off the chain: the last OFF_WINDOW - 1 steps and the one to choose
    runs.step(False, 1, 1, 0.0015)
    assert runs.off_rate(1, 0.0015) == pytest.approx((16 + 1 + 1) / 0.0057)
    runs.step(True, 1, 4, 0.006)            # a head step forgets them; a prefill ends its run
    assert runs.off_rate(1, 0.0015) == pytest.approx(1 / 0.0015)
    runs.interrupted()
    assert runs.head_rate(1) == pytest.approx((8 * MIN_HEAD_RUNS + 4) / (0.008 * MIN_HEAD_RUNS + 0.006))


class Trie:
    """A trie whose next proposal is set by the test: a 16-node draft of class 5, or nothing."""

    def __init__(self):
        self.nodes = 1

    def propose(self, reqs, max_nodes):
        tokens = list(range(self.nodes))
        return TreeProposal.from_lists([(tokens, list(range(-1, self.nodes - 1)))] * len(reqs)), [self.nodes] * len(reqs)

    def proposal_keys(self):
        return [5 if self.nodes > 1 else 0]


def test_a_broken_chain_restarts_the_head_only_where_its_runs_beat_the_steps_off_it():
    """Priced as on an H100 at batch 1 (a trie step 2.7 ms, a plain one 1.45, head runs of a
    6-ms restart and 2-ms chained steps of 4 tokens): a gap in the trie's matches right after
    trie steps of 16 tokens is a plain step; after plain steps alone, the head restarts."""
    trie, restarts, pending = Trie(), [], []
    head = SimpleNamespace(num_steps=3, holds_chain=lambda req: False,
                           propose=lambda reqs, nodes: restarts.append(1) or (TreeProposal.root_only([0]), [1]),
                           pending_chains=lambda reqs, nodes: pending.append(1) or (TreeProposal.root_only([0]), [1]),
                           holds_fused_rows=lambda: bool(restarts and not pending))
    hybrid = FusedHybridDrafter(trie, head, 16)
    hybrid.choice.expected_from_trie = lambda key, rid=None: 12.0 if key == 5 else None
    hybrid.choice.expected_from_head = lambda rid: 4.0
    req = SimpleNamespace(rid="a", num_tokens=10, last_token=0, spec=SimpleNamespace(draft_sources={}))

    def committed(kind, tokens, seconds):
        hybrid.runs.step(kind == RESTART or kind == "chained", 1, tokens, seconds)
        hybrid.prices._price[(kind, 1)] = seconds

    def proposed():
        restarts.clear(), pending.clear()
        req.num_tokens += 1
        proposal, _ = hybrid.propose([req], [16])
        return "restart" if restarts else "trie" if proposal.num_nodes[0] > 1 else "plain"

    assert proposed() == "restart"                     # nothing priced: the choice's rule
    for _ in range(MIN_HEAD_RUNS):
        committed(RESTART, 4, 0.006), committed("chained", 4, 0.002), committed("chained", 4, 0.002)
        committed(TRIE, 16, 0.0027)
    committed(PLAIN, 1, 0.00145)
    committed(TRIE, 16, 0.0027)
    assert proposed() == "plain" and not hybrid.holds_fused_rows()   # a gap after a copying stretch
    assert hybrid.prices._kind_at("a", req.num_tokens) == PLAIN
    committed(PLAIN, 1, 0.00145)
    committed(PLAIN, 1, 0.00145)
    assert proposed() == "restart"                     # two plain steps (690 tok/s) under the head's 1200
    trie.nodes = 16
    assert proposed() == "trie"                        # the trie's 12 expected in 2.7 ms beat the head's runs
    heard = []
    hybrid.choice.listener = heard.append
    hybrid.propose([req], [16])
    assert heard[-1]["kind"] == "choose" and heard[-1]["taken"] == 1 and heard[-1]["head_rate"] == 1200


def test_off_the_chain_a_pending_chain_keeps_its_request_where_the_trie_promises_less():
    hybrid = FusedHybridDrafter(Trie(), SimpleNamespace(num_steps=3), 16)
    hybrid.choice.expected_from_trie = lambda key, rid=None: {5: 3.0, 7: 9.0}.get(key)
    hybrid.choice.expected_from_head = lambda rid: 4.0
    use_trie, tokens = hybrid._off_chain_tokens(["a", "b", "c", "d"], [16, 16, 16, 1], [5, 7, 6, 0],
                                                held=[True, True, False, False])
    # a: its chain (4) over the trie's 3; b: the trie's 9; c: an unmeasured class, over the root alone; d: its root
    assert use_trie.tolist() == [False, True, True, False]
    assert tokens == pytest.approx(4 + 9 + 1 + 1)
