"""HybridDrafter: EAGLE / EAGLE3 with --speculative-hybrid-ngram. Each request's step drafts
from the n-gram trie or from the head, whichever is expected to commit more
(source_choice.py), and the batch's trees, of either source, are verified in one step.

The trie proposes for the whole batch first (one call, microseconds); then the head drafts,
in one forward, for the requests that chose it. A request that took the trie's draft gives
its head nothing to do that step: the target's states of the tokens it commits wait in the
head's store (EagleDrafter.observe_hidden) and the head is fed them at its next draft for
the request, as after plain steps of the adaptive policy; its rows in the prefix cache are
fed when it finishes (head_prefix_cache.py). The trie sees every prompt and every committed
token, whichever source drafted.

A step that verifies trie drafts verifies deterministic drafts only: the head then drafts
its argmax (top-k 1) or its top-k tree, not a sampled chain, whose q could not share a step
with trie drafts, which have none (verify/rules.py verifies a batch with or without q).
Where no request of the step takes the trie's draft, the head drafts as EAGLE alone does
(sampled requests' chains sampled, with their q). Sampled requests are verified exactly
either way.

While every request of a greedy batch drafts from the trie, the next step may be queued before
this one is read, its trie drafts picked on the device from the trie's forecast, as NGRAM's are
(ForecastSteps, --speculative-ngram-forecast; engine/draft_ahead.py): that hides the read, the
commit and the next proposal behind the GPU's step (H100, 1.5B, batch 1: a hybrid's trie step
took ~2.67 ms where NGRAM's forecast steps took ~2.32). Only while no request is due to take the
head's drafts (source_choice.HEAD_RECHECK_STEPS): a step picked from a forecast verifies trie
drafts for all.

This class's head runs EagleDrafter's own chain or EAGLE-2's trees; a head that drafts chains
is the fused chain's, whose steps verify and draft in one device function, chained ahead
(fused_hybrid.py, a subclass).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from specserve.speculative.drafter import Drafter, ForecastSteps, ProposalHints, ReadsHiddenStates
from specserve.speculative.hybrid.source_choice import HEAD, NGRAM, SourceChoice
from specserve.speculative.hybrid.step_prices import RESTART, TRIE, StepPrices
from specserve.verify.tree import TreeProposal

if TYPE_CHECKING:
    import torch

    from specserve.request.req import Req
    from specserve.speculative.model_drafters.eagle import EagleDrafter
    from specserve.speculative.ngram.drafter import NgramDrafter


class HybridDrafter(Drafter, ProposalHints, ReadsHiddenStates, ForecastSteps):
    # a probe costs what the head's does where it drafts for any of the probed requests
    probe_every = 16
    probe_every_at_most = 128

    def __init__(self, ngram: "NgramDrafter", head: "EagleDrafter", max_nodes: int):
        self.ngram, self.head = ngram, head
        self.max_nodes = max_nodes
        self.choice = SourceChoice(max_nodes, head.num_steps)
        self.prices = StepPrices()
        self._keys: list[int] = []
        self.proposals = {NGRAM: 0, HEAD: 0}   # drafts proposed by each source, over all requests
        self._seen: dict[str, int] = {}        # rid -> its tokens when last observed
        self._unrecorded: list[tuple] = []     # proposals made ahead of that (_record)
        self._trie_only = False                # the last step drafted from the trie alone, and may again
        self._probing = False                  # this proposal is a probe's: the head drafts its argmax

    # --- the two sources ---
    def add_prompt(self, req: "Req") -> None:
        self.ngram.add_prompt(req)
        self.head.add_prompt(req)

    def propose(self, reqs: list["Req"], max_nodes: list[int]) -> tuple[TreeProposal, list[int]]:
        rids = [req.rid for req in reqs]
        trie, trie_nodes = self.ngram.propose(reqs, max_nodes)
        trie_keys = self.ngram.proposal_keys()
        use_trie = self._choose(reqs, trie_nodes, trie_keys)
        self.prices.proposed(rids[0], reqs[0].num_tokens, self._step_kind(use_trie))
        head, head_nodes, use_trie = self._head_drafts(reqs, max_nodes, use_trie)
        self._record(reqs, trie, trie_nodes, trie_keys, head, head_nodes)
        proposal = merge_proposals(trie, head, use_trie)
        num_nodes = proposal.num_nodes.tolist()
        self._count(reqs, use_trie, num_nodes)
        self._keys = self.choice.policy_keys(use_trie, trie_keys)
        self._trie_only = bool(use_trie.all()) and self.choice.trie_may_go_on(rids)
        return proposal, num_nodes

    def _choose(self, reqs: list["Req"], trie_nodes: list[int], trie_keys: list[int]) -> np.ndarray:
        """(bs,) bool: the requests that draft from the trie this step (source_choice.choose)."""
        return self.choice.choose([req.rid for req in reqs], trie_nodes, trie_keys, *self._trie_price(reqs))

    def _step_kind(self, use_trie: np.ndarray) -> str:
        """The step's kind, as step_prices.py prices it."""
        return TRIE if use_trie.any() else RESTART

    def propose_probe(self, reqs: list["Req"], max_nodes: list[int]) -> tuple[TreeProposal, list[int]]:
        """The head's drafts argmax, as the head's own probes are (EagleDrafter.propose_probe)."""
        self._probing = True
        try:
            with self.head.argmax_drafts():
                return self.propose(reqs, max_nodes)
        finally:
            self._probing = False

    def _trie_price(self, reqs: list["Req"]) -> tuple[float | None, np.ndarray | None]:
        """What a trie step must pay for beyond the head's, and which requests would keep head
        drafts beside it (source_choice.choose); None, None: nothing, every request keeps them,
        the head's steps being the engine's verify steps as the trie's are."""
        return None, None

    def _head_drafts(self, reqs: list["Req"], max_nodes: list[int],
                     use_trie: np.ndarray) -> tuple[TreeProposal, list[int], np.ndarray]:
        """The head's drafts for the requests that do not take the trie's, and which take the
        trie's after them."""
        self.head.sampled_drafts = not (use_trie.any() or self._probing)   # see the module docstring
        head, head_nodes = self.head.propose(reqs, [1 if t else m for t, m in zip(use_trie.tolist(), max_nodes)])
        if head.draft_probs is None:   # a request the head could not draft for (its cache full) takes the trie's
            use_trie = use_trie | (np.asarray(head_nodes) <= 1)
        return head, head_nodes, use_trie

    def _record(self, reqs: list["Req"], trie: TreeProposal, trie_nodes: list[int], trie_keys: list[int],
                head: TreeProposal, head_nodes: list[int]) -> None:
        """Both sources' proposals as the choice's shadows. A proposal made before the tokens
        of the step before were observed (launched ahead: engine/draft_ahead.py) waits until
        they are, or those tokens would walk it."""
        record = ([req.rid for req in reqs], trie, trie_nodes, trie_keys, head, head_nodes)
        if all(self._seen.get(req.rid) == req.num_tokens for req in reqs):
            self.choice.record(*record)
        else:
            self._unrecorded.append(record)

    def _count(self, reqs: list["Req"], use_trie: np.ndarray, num_nodes: list[int]) -> None:
        for req, trie, nodes in zip(reqs, use_trie.tolist(), num_nodes):
            if nodes > 1:
                source = NGRAM if trie else HEAD
                self.proposals[source] += 1
                req.spec.draft_sources[source] = req.spec.draft_sources.get(source, 0) + 1

    # --- forecasts: the next trie step queued before this one is read ---
    def forecasts(self, batch_size: int) -> bool:
        return self._trie_only and self.ngram.forecasts(batch_size)

    def forecast(self, reqs: list["Req"], proposal: TreeProposal, nodes: int) -> np.ndarray:
        return self.ngram.forecast(reqs, proposal, nodes)

    def forecast_held(self, reqs: list["Req"], proposal: TreeProposal, num_nodes: list[int],
                      keys: list[int]) -> None:
        """The forecast's trie drafts, recorded as a proposal's: the choice's shadows (the
        head drafted nothing), the sources' counts, the policy's keys and the trie streaks."""
        rids, use_trie = [req.rid for req in reqs], np.ones(len(reqs), dtype=bool)
        self.choice.took(rids, use_trie)
        self.prices.proposed(rids[0], reqs[0].num_tokens, TRIE)
        roots = TreeProposal.root_only([r.last_token for r in reqs])
        self._record(reqs, proposal, num_nodes, keys, roots, [1] * len(reqs))
        self._count(reqs, use_trie, num_nodes)
        self._keys = self.choice.policy_keys(use_trie, keys)
        self._trie_only = self.choice.trie_may_go_on(rids)

    def observe_hidden(self, reqs: list["Req"], starts: list[int], states: "torch.Tensor",
                       rows: list[list[int]], owned: bool = False) -> None:
        self.head.observe_hidden(reqs, starts, states, rows, owned)

    def prefilled(self, reqs: list["Req"]) -> None:
        self.prices.prefilled()
        self.head.prefilled(reqs)

    def observe(self, req: "Req", committed: list[int]) -> None:
        self.observe_batch([req], [committed])

    def observe_batch(self, reqs: list["Req"], committed: list[list[int]]) -> None:
        rids = [req.rid for req in reqs]
        if reqs:
            self._timed(reqs, committed, self.prices.committed(rids, reqs[0].num_tokens - len(committed[0]),
                                                              time.perf_counter()))
        self.choice.observe_batch(rids, committed)
        for record in self._unrecorded:
            self.choice.record(*record)
        self._unrecorded.clear()
        for req in reqs:
            self._seen[req.rid] = req.num_tokens
        self.ngram.observe_batch(reqs, committed)
        self.head.observe_batch(reqs, committed)

    def _timed(self, reqs: list["Req"], committed: list[list[int]], timed: tuple[str | None, float] | None) -> None:
        """A step's kind and time (StepPrices.committed), for what watches runs of steps."""

    def flush(self) -> None:
        self.ngram.flush()
        self.head.flush()

    def release(self, req: "Req") -> None:
        self.choice.release(req.rid)
        self.prices.release(req.rid)
        self._seen.pop(req.rid, None)
        self.ngram.release(req)
        self.head.release(req)

    def preempted(self, req: "Req") -> None:
        self.ngram.preempted(req)
        self.head.preempted(req)

    def close(self) -> None:
        self.ngram.close()
        self.head.close()

    def scratch(self) -> "HybridDrafter":
        """The trie's scratch and a fresh choice; the head keeps per-request state only."""
        return type(self)(self.ngram.scratch(), self.head.scratch(), self.max_nodes)

    # --- what the adaptive policy asks ---
    def proposal_keys(self) -> list[int]:
        return self._keys

    def probe_order(self, reqs: list["Req"]) -> list[int]:
        return self.head.probe_order(reqs)

    def took_prefill(self) -> bool:
        return self.head.took_prefill()

    def ready_to_probe(self) -> bool:
        return self.ngram.ready_to_probe()

    def ready_to_draft(self) -> bool:
        return self.ngram.ready_to_draft()


def merge_proposals(trie: TreeProposal, head: TreeProposal, use_trie: np.ndarray) -> TreeProposal:
    """Row i from `trie` where use_trie[i], else from `head`, padded to the wider of the two
    (padding: token 0, parent -1). Only a proposal of the head's alone may carry a q."""
    if not use_trie.any():
        return head
    assert head.draft_probs is None, "a sampled head draft shares a step with trie drafts"
    if use_trie.all():
        return trie
    width = max(trie.num_slots, head.num_slots)
    tokens = np.where(use_trie[:, None], _padded(trie.tokens, width, 0), _padded(head.tokens, width, 0))
    parents = np.where(use_trie[:, None], _padded(trie.parents, width, -1), _padded(head.parents, width, -1))
    num_nodes = np.where(use_trie, trie.num_nodes, head.num_nodes)
    return TreeProposal(tokens, parents, num_nodes)


def _padded(array: np.ndarray, width: int, fill: int) -> np.ndarray:
    if array.shape[1] == width:
        return array
    return np.concatenate([array, np.full((array.shape[0], width - array.shape[1]), fill, dtype=array.dtype)], axis=1)
