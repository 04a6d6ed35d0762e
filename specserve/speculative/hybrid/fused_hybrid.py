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
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from specserve.speculative.drafter import ChainedSteps
from specserve.speculative.hybrid.drafter import HybridDrafter
from specserve.speculative.hybrid.source_choice import UNPRICED_EXCESS
from specserve.speculative.hybrid.step_prices import CHAINED
from specserve.speculative.model_drafters.fused_drafter import FusedChainDrafter
from specserve.verify.tree import TreeProposal

if TYPE_CHECKING:
    import torch

    from specserve.request.req import Req
    from specserve.runner.model_runner import InFlight
    from specserve.runner.tree_step import GreedyOutcome
    from specserve.sampling.sampler import SampledStep, Sampler
    from specserve.speculative.ngram.drafter import NgramDrafter


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
        if use_trie.any():
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
        are its counterfactual, and say whether the step after it is chained too."""
        head, head_nodes = self.head.chained_proposal(reqs)
        rids = [req.rid for req in reqs]
        trie, trie_nodes = self.ngram.propose(reqs, [self.max_nodes] * len(reqs))
        trie_keys = self.ngram.proposal_keys()
        excess = self.prices.break_excess(len(reqs))
        self._trie_next = self.choice.breaks_chain(rids, trie_nodes, trie_keys,
                                                   UNPRICED_EXCESS if excess is None else excess)
        self.prices.proposed(rids[0], reqs[0].num_tokens, CHAINED)
        self._record(reqs, trie, trie_nodes, trie_keys, head, head_nodes)
        head_only = np.zeros(len(reqs), dtype=bool)
        self._count(reqs, head_only, head_nodes)
        self._keys = self.choice.policy_keys(head_only, trie_keys)
        self._trie_only = False
        return head, head_nodes
