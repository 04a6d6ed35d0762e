"""FusedHybridDrafter: the hybrid (drafter.py) over a head that drafts chains (EAGLE / EAGLE3
with top-k 1), whose head steps are the fused chain's (model_drafters/fused_drafter.py): the
target's verification and the head's next chain in one device function, the next step queued
before this one is read. Without that, a hybrid head step ran EagleDrafter's own chain (H100,
1.5B, batch 1: 3.5-3.7 ms a step against ~2.0 ms fused and chained), and on chat the hybrid
lost to EAGLE-3 alone in every cell.

A step is one of two kinds:
- every request drafts from the head: the fused step, chained to the next while the batch
  stays the same. While it runs, the trie proposes at the chained step's roots too (a lookup,
  microseconds), as a counterfactual the choice learns from; where those drafts would have
  paid for breaking the chain (source_choice.py), no next step is chained, and the
  next proposal, made once this step is read, looks again;
- some request drafts from the trie: the engine verifies the step, the trie's drafts beside
  the head's pending chains for the other requests where they have current argmax ones
  (FusedChainDrafter.pending_chains), else their roots alone. (Drafting for them there with
  EagleDrafter's unfused chain, eager and with a host sync, made such steps 5.7-13.9 ms at
  batch 8 and ~27 ms at 64, where fused steps took 2.6 and 4.4 ms: H100, 1.5B.) The head's
  next drafts start from a catch-up of the rows such steps committed.

A request's choice is the hybrid's (source_choice.py) with one more condition: over the
batch, the trie's drafts must be expected to commit more than the head's would by what their
step costs beyond the head's (step_prices.py: each kind of step priced per batch bucket as it
runs; a trie step and the restart after it where the head's steps are chained, a trie step
alone where the chain is broken already), so a lone request with a middling trie match does not
break every request's chain (nor keep the batch off the fused steps), and at 64, where a trie
step and its restart cost ~4 chained steps, twice the head's tokens is not enough.

Where the chain is broken, the head's next step is a restart, and the choice above weighs it as
the chained step it leads back to. So first the steps off the chain are weighed against the
head's runs (run_rates.py): while the recent steps off the chain, with this one (the trie's
drafts where it has them, else the head's pending chains or the roots alone, as a plain step
where that pays), commit more a second than the head's runs did from their restarts on, the
step stays off the chain. On code edits the trie's gaps are a step or two long, and a restart
there held the batch on the chain's ~4-token steps where the trie's committed 12-16 (H100,
1.5B, batch 1: 4 such detours, 44 ms of a 138-ms run where NGRAM alone took 97); on chat the
recent steps fall under the head's rate after a plain step or two, and the head restarts.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from specserve.speculative.drafter import ChainedSteps
from specserve.speculative.hybrid.drafter import HybridDrafter
from specserve.speculative.hybrid.source_choice import UNPRICED_EXCESS
from specserve.speculative.hybrid.run_rates import RunRates
from specserve.speculative.hybrid.step_prices import CHAINED, PLAIN, RESTART, TRIE
from specserve.speculative.model_drafters.fused_drafter import FusedChainDrafter
from specserve.verify.tree import TreeProposal

if TYPE_CHECKING:
    import torch

    from specserve.request.req import Req
    from specserve.runner.model_runner import InFlight
    from specserve.runner.tree_step import GreedyOutcome
    from specserve.sampling.sampler import SampledStep, Sampler
    from specserve.speculative.ngram.drafter import NgramDrafter


# A chained step's counterfactual looks at this many of a larger batch's requests (a window that
# moves through the batch). Its host work runs beside the GPU's step and must fit in it: at 64 a
# chained head step took 6.2-7.5 ms in the hybrid against 3.4-3.6 ms for EAGLE-3's alone (H100,
# 1.5B, code-types; same 256 nodes), and on the CPU (tiny random target and head, 64 requests,
# greedy, every step chained, breaking never paying) a step's commit and launch took 3.18 ms of
# host time against EAGLE-3's 1.85: the trie's lookups for all 64, and walking their shadows and
# the head's. Over a window of 16: 2.69 ms (3 runs each).
COUNTERFACTUAL_REQUESTS = 16


class FusedHybridDrafter(HybridDrafter, ChainedSteps):
    proposes_ahead = True   # both sources: the trie's lookup, the fused head's pending drafts or catch-up
    # the head's steps are the fused chain's, whose price the policy learns as the head's alone does
    ragged_verify = FusedChainDrafter.ragged_verify
    switch_margin = FusedChainDrafter.switch_margin
    leave_margin = FusedChainDrafter.leave_margin

    def __init__(self, ngram: "NgramDrafter", head: FusedChainDrafter, max_nodes: int):
        super().__init__(ngram, head, max_nodes)
        self.head: FusedChainDrafter = head
        # the trie was expected to pay at the last chained step's roots: chain no step after it
        self._trie_next = False
        self.runs = RunRates()
        self._off_chain = False   # this proposal stays off the head's chain (no restart)
        self._window_start = 0    # where the next chained step's counterfactual window starts

    def _choose(self, reqs: list["Req"], trie_nodes: list[int], trie_keys: list[int]) -> np.ndarray:
        """The step off the chain where it pays against the head's runs (the module docstring);
        else the choice's rule."""
        use_trie = self._off_chain_drafts(reqs, trie_nodes, trie_keys)
        self._off_chain = use_trie is not None
        return use_trie if use_trie is not None else super()._choose(reqs, trie_nodes, trie_keys)

    def _off_chain_drafts(self, reqs: list["Req"], trie_nodes: list[int], trie_keys: list[int]) -> np.ndarray | None:
        """(bs,) bool, the requests that take the trie's drafts in a step off the chain (the
        others verify their pending chains or their roots alone); None where restarting the
        head is expected to pay, or where the head's runs or the trie's steps are not priced
        at this bucket yet."""
        bs, rids = len(reqs), [req.rid for req in reqs]
        head_rate, trie_price = self.runs.head_rate(bs), self.prices.price(TRIE, bs)
        if head_rate is None or trie_price is None:
            return None
        held = [self.head.holds_chain(req) for req in reqs]
        use_trie, tokens = self._off_chain_tokens(rids, trie_nodes, trie_keys, held)
        price, plain_price = trie_price, self.prices.price(PLAIN, bs)
        if plain_price is not None and not any(held) and bs / plain_price > tokens / trie_price:
            use_trie[:], tokens, price = False, bs, plain_price   # roots alone: a plain step
        off_rate = self.runs.off_rate(tokens, price)
        if off_rate < head_rate:
            return None
        return self.choice.stay_off(rids, trie_nodes, trie_keys, use_trie, off_rate, head_rate)

    def _off_chain_tokens(self, rids: list[str], trie_nodes: list[int], trie_keys: list[int],
                          held: list[bool]) -> tuple[np.ndarray, float]:
        """Where a step off the chain takes the trie's drafts (where it has some expected to
        commit at least what the request's pending chain would, or its root alone: a class not
        measured yet counts one token), and the tokens the step is expected to commit."""
        use_trie, tokens = np.zeros(len(rids), dtype=bool), 0.0
        for i, (rid, nodes, key, chain) in enumerate(zip(rids, trie_nodes, trie_keys, held)):
            otherwise = self.choice.expected_from_head(rid) if chain else 1.0
            trie = (self.choice.expected_from_trie(key, rid) or 1.0) if nodes > 1 else None
            use_trie[i] = trie is not None and trie >= otherwise
            tokens += trie if use_trie[i] else otherwise
        return use_trie, tokens

    def _step_kind(self, use_trie: np.ndarray) -> str:
        if use_trie.any():
            return TRIE
        return PLAIN if self._off_chain else RESTART

    def _timed(self, reqs: list["Req"], committed: list[list[int]], timed: tuple[str | None, float] | None) -> None:
        if timed is None:
            self.runs.interrupted()
        else:
            kind, seconds = timed
            self.runs.step(kind in (CHAINED, RESTART), len(reqs), sum(map(len, committed)), seconds)

    def _trie_price(self, reqs: list["Req"]) -> tuple[float, np.ndarray]:
        """A step proposed after a read: the chain is broken (or never ran), so the head's next
        step restarts whichever source drafts now; a trie step is weighed against the chained
        steps a restart leads back to. Beside trie drafts, the other requests verify the head's
        pending chains where they have them, else their roots alone."""
        excess = self.prices.stay_excess(len(reqs))
        ready = np.fromiter((self.head.holds_chain(req) for req in reqs), dtype=bool, count=len(reqs))
        return UNPRICED_EXCESS if excess is None else excess, ready

    def _head_drafts(self, reqs: list["Req"], max_nodes: list[int],
                     use_trie: np.ndarray) -> tuple[TreeProposal, list[int], np.ndarray]:
        self._trie_next = False
        if use_trie.any() or self._off_chain:
            head, head_nodes = self.head.pending_chains(reqs, [1 if t else m for t, m in zip(use_trie.tolist(),
                                                                                              max_nodes)])
            return head, head_nodes, use_trie | (np.asarray(head_nodes) <= 1)
        head, head_nodes = self.head.propose(reqs, max_nodes)
        return head, head_nodes, use_trie

    # --- the fused head's steps ---
    def samples_fused(self, reqs: list["Req"], sampling_rule: str) -> str | None:
        """The head's: a sampled batch's steps run launched ahead, its head steps fused and
        chained; a step with trie drafts (no q) is verified by the engine's sampler."""
        return self.head.samples_fused(reqs, sampling_rule)

    def verify_fused(self, reqs: list["Req"], proposal: TreeProposal, slots: list[int], sampler: "Sampler",
                     while_running: Callable[[], None] | None = None) -> "SampledStep | None":
        return self.head.verify_fused(reqs, proposal, slots, sampler, while_running)

    def holds_fused_rows(self) -> bool:
        return self.head.holds_fused_rows()   # none after pending_chains: a step off the chain

    def launch_fused(self, reqs: list["Req"], proposal: TreeProposal, slots: list[int],
                     kind: str = "greedy") -> "InFlight | None":
        return self.head.launch_fused(reqs, proposal, slots, kind)   # None after pending_chains: nothing reserved

    def read_fused(self, reqs: list["Req"], outcome: "torch.Tensor") -> "GreedyOutcome":
        return self.head.read_fused(reqs, outcome)

    def chain_nodes(self, reqs: list["Req"], launched: "InFlight") -> int:
        return 0 if self._trie_next else self.head.chain_nodes(reqs, launched)

    def launch_chained(self, reqs: list["Req"], node_slots: np.ndarray) -> "tuple[InFlight, np.ndarray] | None":
        return self.head.launch_chained(reqs, node_slots)

    def adopt_chained(self, reqs: list["Req"], reserved: np.ndarray) -> None:
        self.head.adopt_chained(reqs, reserved)

    def free_chained(self, reserved: np.ndarray) -> None:
        self.head.free_chained(reserved)

    def chained_proposal(self, reqs: list["Req"]) -> tuple[TreeProposal, list[int]]:
        """The head's chains the chained step verifies; the trie's drafts at the same roots
        are its counterfactual, and say whether the step after it is chained too. In a batch
        of more than COUNTERFACTUAL_REQUESTS, the counterfactual (the trie's lookups, both
        sources' shadows) covers that many of its requests, a window moving through the batch
        step by step, and the batch breaks its chain where they would have paid for it."""
        head, head_nodes = self.head.chained_proposal(reqs)
        rids = [req.rid for req in reqs]
        self.prices.proposed(rids[0], reqs[0].num_tokens, CHAINED)
        window = self._counterfactual_window(len(reqs))
        sample = [reqs[i] for i in window]
        trie, trie_nodes = self.ngram.propose(sample, [self.max_nodes] * len(sample))
        trie_keys = self.ngram.proposal_keys()
        excess = self.prices.break_excess(len(reqs))
        self._trie_next = self.choice.breaks_chain([req.rid for req in sample], trie_nodes, trie_keys,
                                                   UNPRICED_EXCESS if excess is None else excess)
        self._record(sample, trie, trie_nodes, trie_keys, head.rows(window), [head_nodes[i] for i in window])
        head_only = np.zeros(len(reqs), dtype=bool)
        self._count(reqs, head_only, head_nodes)
        self._keys = [None] * len(reqs)   # the head's drafts: the policy measures them per request
        self._trie_only = False
        return head, head_nodes

    def _counterfactual_window(self, bs: int) -> list[int]:
        """The rows of a batch of bs whose counterfactual this chained step looks at."""
        if bs <= COUNTERFACTUAL_REQUESTS:
            return list(range(bs))
        start = self._window_start % bs
        self._window_start = start + COUNTERFACTUAL_REQUESTS
        return [(start + i) % bs for i in range(COUNTERFACTUAL_REQUESTS)]
