"""The fused chain drafter: EAGLE / EAGLE3 with top-k 1 (a chain of K drafts), NAIVE_EAGLE and
MTP (K = 1), and EAGLE / EAGLE3 with EAGLE-2's trees (top-k > 1: the pending drafts are the
head's next tree, verified without a q), where the target's verification of step N and the head's K drafts for step
N + 1 run in one device function (speculative/model_drafters/fused_step.py; one CUDA graph replay,
fused_chain.py): no host round trip between them, one host sync per step, which reads the
committed tokens and the next drafts together.

The head is an EAGLE head from our trainer (either kind: EAGLE-2's final state or EAGLE-3's
three layers), or an MTP layer (mtp_head.py) for MTP; both keep the row layout of eagle.py
(row r reads the state of position r and the token at r + 1).

Per request, the drafter keeps the drafts the last fused step made (`pending`, with the
position of the first) and its head cache fed up to the row before the root. A request
without pending drafts (a prompt just prefilled, a resumed preemption, or a step the engine
verified itself) first goes through EagleDrafter's chain: the catch-up of its rows from the
stored target states, then its first K drafts (a host sync, on such steps only). Then every
request gets its next head rows reserved (eagle_runner.reserved_head_rows: 2K for a chain), and the step
is fused.

On the engine's path of steps launched ahead (greedy batches, and sampled ones this step
verifies: samples_fused; pinned drafting, or the adaptive policy while the batch's bucket
drafts), the next fused step is queued before the host reads this one
(launch_chained: speculative/model_drafters/fused_chain.py derives its inputs from this step's outcome on the
device; engine/draft_ahead.py): its head rows are allocated then and taken into the head's
table once this step is committed (adopt_chained).

Batches the fused step cannot serve (penalties, logprobs, min_new_tokens still holding stop
tokens back, a head cache that did not fit) are verified by the engine as usual: the target
forward keeps its states (observe_hidden) and the next step catches up on them.
Sampling: drafts are sampled from the head's q (unseeded requests; verified by residual
rejection with that q) or its argmax (greedy and seeded requests; the coupled rule gives a
seeded request plain decoding's tokens), as STANDALONE's and EAGLE's chains. Without a q
table (fused_chain.Q_TABLE_BYTES: too many requests x drafts x vocabulary) a batch with
sampled drafts takes EagleDrafter's unfused chain, whose q lives for one step only.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from specserve.runner.tree_step import GreedyOutcome
from specserve.sampling.sampler import SampledStep
from specserve.speculative.drafter import ChainedSteps
from specserve.speculative.model_drafters.eagle import EagleDrafter
from specserve.speculative.model_drafters.model_proposals import chain_proposal, draft_temperature, tree_proposal
from specserve.verify.tree import TreeProposal

if TYPE_CHECKING:
    from specserve.request.req import Req
    from specserve.runner.model_runner import InFlight
    from specserve.sampling.sampler import Sampler
    from specserve.speculative.model_drafters.eagle_runner import EagleHeadRunner
    from specserve.speculative.model_drafters.fused_chain import FusedChainRunner


class FusedChainDrafter(EagleDrafter, ChainedSteps):
    """EAGLE's chain drafter whose verify steps it runs itself (verify_fused, or launch_fused
    and read_fused on the engine's greedy path, which launches the next step before the
    bookkeeping it does not need: engine/draft_ahead.py)."""
    ragged_verify = False   # a fused step runs every request's chain
    # a proposal reads the pending drafts (read_fused), the head's cache synced to the committed
    # tokens and, for a request without pending drafts, the target states observe_hidden kept
    proposes_ahead = True
    # SWITCH_MARGIN (1.15) is for switches that cost: NGRAM's first drafting step is not launched
    # ahead, and with the step launched ahead of it thrown away the modes alternated. A fused
    # chain's episode is chained from its second step on (engine/draft_ahead.py) and the head's
    # catch-up of the plain stretch is paid once; 1.15 kept plain the batches of 8 where chained
    # steps won 1.08-1.17x (H200, 1.5B, session 28: expected 1.08-1.16x at the steps' prices)
    switch_margin = 1.05
    # An episode is dear to restart: a probe costs the head's forwards and a host sync (5-15 ms
    # on an H200 at batch 1, 1.5B) and the episode's first step the head's catch-up (~4.7 ms
    # against ~2.4 chained), and the request's evidence keeps the dip it ended on until the next
    # probe, 16-128 plain steps later. Ended where plain decoding was first expected to win, on
    # chat at batch 1 (accept ~2.2 of 4) episodes that realized 1.20-1.27x over plain ended on
    # two or three one-token steps (the best tier expected at 0.92-0.95x plain), and the bucket
    # decoded plainly for 60-110 steps at a time: 0.95-1.01x where pinned chains made 1.23-1.27x.
    # The guard (modes.py) still stops an episode whose realized rate falls below plain's. From
    # batch 4 down the margin widens (policy.LEAVE_MARGIN_BATCH): 0.70 at batch 1.
    leave_margin = 0.85

    def __init__(self, runner: "EagleHeadRunner", fused: "FusedChainRunner"):
        super().__init__(runner)
        self.fused = fused
        self.trees = fused.trees
        self.reserved_rows = fused.head_columns
        # rid -> (position of the first draft, its drafts: K of a chain, or a tree's n - 1 tokens and their parents)
        self.pending: dict[str, tuple[int, list[int]]] = {}
        # requests whose fused rows this step reserved -> the reserved rows' 2K head slots
        self._reserved: dict[str, list[int]] = {}
        # requests whose reserved rows belong to a fused step launched and not read yet
        self._in_flight: set[str] = set()

    def propose(self, reqs: list["Req"], max_nodes: list[int]) -> tuple[TreeProposal, list[int]]:
        self._reserved = {}
        sampled = not self.trees and any(draft_temperature(r) > 0 for r in reqs)   # (trees: argmax drafts)
        if sampled and self.fused.q_table is None:
            return super().propose(reqs, max_nodes)   # the unfused chain, which hands its q over itself
        pendings = [self._drafts_of(req) for req in reqs]   # (a sync of each head cache: once a step)
        lagging = [i for i, pending in enumerate(pendings) if pending is None]
        if lagging:
            self._first_drafts([reqs[i] for i in lagging])
            for i in lagging:
                pendings[i] = self._drafts_of(reqs[i])
        drafted, drafts = [], []
        for index, (req, limit, pending) in enumerate(zip(reqs, max_nodes, pendings)):
            if pending is None:
                continue    # no drafts (its states were missing): the engine verifies this batch
            seq = self.kv.sequences[req.rid]    # synced by _drafts_of: every row before the root is in
            first = self.kv.reserve(req, self.reserved_rows, chain_table=False, seq=seq)
            if first is None:
                continue    # no room: the engine verifies this batch
            self._reserved[req.rid] = seq.slots[first:first + self.reserved_rows]
            if limit > 1:
                drafted.append(index)
                drafts.append(pending)
        self.kv.write_table()
        proposal, num_nodes = self._proposal(max_nodes, [r.last_token for r in reqs], drafted, drafts)
        if not self._fuses(reqs) and sampled and drafted:
            proposal = self._with_q(proposal, reqs)
        return proposal, num_nodes

    def _proposal(self, max_nodes: list[int], roots: list[int], drafted: list[int],
                  drafts: list[list[int]]) -> tuple[TreeProposal, list[int]]:
        """The pending drafts of the requests `drafted` as chains or trees, cut to max_nodes."""
        if self.trees:
            return tree_proposal(max_nodes, roots, drafted, drafts, self.fused.nodes)
        return chain_proposal(max_nodes, roots, drafted, drafts, None, self.num_steps)

    def pending_chains(self, reqs: list["Req"], max_nodes: list[int]) -> tuple[TreeProposal, list[int]]:
        """Chains for a step the engine verifies beside another source's deterministic drafts
        (the hybrid's trie: speculative/hybrid/fused_hybrid.py), at no head forward: the
        pending drafts of requests with a limit above 1 where they are current and argmax
        (greedy and seeded requests), which verification takes without a q; the others' roots
        alone. No fused rows are reserved: the engine verifies the step."""
        self._reserved = {}
        drafted, drafts = [], []
        for index, (req, limit) in enumerate(zip(reqs, max_nodes)):
            pending = self._drafts_of(req) if limit > 1 and draft_temperature(req) == 0 else None
            if pending is not None:
                drafted.append(index)
                drafts.append(pending)
        return chain_proposal(max_nodes, [r.last_token for r in reqs], drafted, drafts, None, self.num_steps)

    def holds_chain(self, req: "Req") -> bool:
        """Whether pending_chains would find the request's argmax drafts from its root (the
        head cache's sync aside): no sync, for a choice made before the proposal."""
        return draft_temperature(req) == 0 and self._current_drafts(req) is not None

    def holds_fused_rows(self) -> bool:
        return bool(self._reserved)

    def _fuses(self, reqs: list["Req"]) -> bool:
        """Whether the fused step serves this batch (else the engine verifies it)."""
        return all(r.rid in self._reserved and fusable(r) for r in reqs)

    def _with_q(self, proposal: TreeProposal, reqs: list["Req"]) -> TreeProposal:
        """The proposal with the q its sampled drafts were drawn from, for the engine's
        residual rejection (the last node has no children: its q stays 0)."""
        q = self.fused.q_table.index_select(0, torch.tensor([r.row for r in reqs], device=self.fused.device))
        q = q[:, :proposal.num_slots - 1]       # a batch of root-only trees has no drafts' q
        return dataclasses.replace(proposal, draft_probs=torch.cat([q, torch.zeros_like(q[:, :1])], dim=1))

    def _current_drafts(self, req: "Req") -> list[int] | None:
        """The pending drafts, if they start at the request's next position."""
        pending = self.pending.get(req.rid)
        return pending[1] if pending is not None and pending[0] == req.num_tokens else None

    def _drafts_of(self, req: "Req") -> list[int] | None:
        """The pending drafts, if they start at the request's next position and the head's
        cache holds every row before the root (a fused step feeds the rows from there)."""
        drafts = self._current_drafts(req)
        if drafts is None or req.rid not in self.kv.sequences:
            return None
        return drafts if self.kv.sync(req).committed == self.kv.rows_of(req) else None

    def _first_drafts(self, reqs: list["Req"]) -> None:
        """EAGLE's catch-up and chain of K drafts, for requests without pending drafts; their
        q goes where the fused step reads it."""
        nodes = self.fused.nodes
        proposal, num_nodes = super().propose(reqs, [nodes] * len(reqs))
        drafted = [i for i, count in enumerate(num_nodes) if count == nodes]
        if not drafted:
            return
        drafts = proposal.tokens[drafted, 1:]
        if self.trees:   # draft_tree's layout: the tokens, then their parents
            drafts = np.concatenate([drafts, proposal.parents[drafted, 1:]], axis=1)
        drafts = drafts.tolist()
        for i, chain in zip(drafted, drafts):
            self.pending[reqs[i].rid] = (reqs[i].num_tokens, chain)
        probs = None if proposal.draft_probs is None else proposal.draft_probs[drafted]
        self.fused.set_pending_q([reqs[i].row for i in drafted], probs, drafts)

    def verify_fused(self, reqs: list["Req"], proposal: TreeProposal, slots: list[int], sampler: "Sampler",
                     while_running: Callable[[], None] | None = None) -> "SampledStep | None":
        launched = self.launch_fused(reqs, proposal, slots, self.verification(reqs, sampler.sampling_rule))
        if launched is None:
            return None
        if while_running is not None:
            while_running()
        parsed = self.read_fused(reqs, launched.wait())   # the step's one sync
        return SampledStep(parsed.tokens, parsed.accepted_nodes, None, None)

    def samples_fused(self, reqs: list["Req"], sampling_rule: str) -> str | None:
        """Sampled drafts need the q table (without it propose takes the unfused chain)."""
        kind = self.verification(reqs, sampling_rule)
        sampled_drafts = not self.trees and any(draft_temperature(r) > 0 for r in reqs)
        if kind == "greedy" or kind not in self.fused.kinds or (sampled_drafts and self.fused.q_table is None) \
                or not all(fusable(r) for r in reqs):
            return None
        return kind

    def verification(self, reqs: list["Req"], sampling_rule: str) -> str:
        """verification_kind; a tree's drafts are the head's top-k, never sampled: verified
        without a q, by the sampler's rule (which the fused step serves only coupled)."""
        if self.trees:
            return "greedy" if all(r.params.greedy for r in reqs) else sampling_rule
        return verification_kind(reqs, sampling_rule)

    def launch_fused(self, reqs: list["Req"], proposal: TreeProposal, slots: list[int],
                     kind: str = "greedy") -> "InFlight | None":
        if not self._fuses(reqs) or kind not in self.fused.kinds:   # (rejection without a q table)
            return None
        head_slots = np.array([self._reserved[r.rid] for r in reqs], dtype=np.int64)
        launched = self.fused.launch(reqs, proposal, slots, head_slots, kind)
        self._in_flight.update(r.rid for r in reqs)
        return launched

    def chain_nodes(self, reqs: list["Req"], launched: "InFlight") -> int:
        nodes = self.fused.nodes
        if not self.fused.chains(launched, reqs):
            return 0
        # both tables must hold the next step's positions: this step's nodes, the next one's
        # and its head rows
        width = min(self.fused.target.pool.req_to_token.shape[1], self.kv.pool.req_to_token.shape[1])
        reach = 2 * nodes + self.reserved_rows
        return nodes if all(r.kv_len + reach < width for r in reqs) else 0

    def launch_chained(self, reqs: list["Req"], node_slots: np.ndarray) -> "tuple[InFlight, np.ndarray] | None":
        slots = self.kv.pool.slots.alloc(len(reqs) * self.reserved_rows)
        if slots is None:
            return None
        head_slots = np.asarray(slots, dtype=np.int64).reshape(len(reqs), self.reserved_rows)
        try:
            return self.fused.launch_chained(reqs, node_slots, head_slots), head_slots
        except BaseException:
            self.kv.pool.slots.free(slots)
            raise

    def chained_proposal(self, reqs: list["Req"]) -> tuple[TreeProposal, list[int]]:
        """The chains a step launch_chained queued verifies, on the host once the step before
        is read: each request's last token and its pending drafts."""
        return self._proposal([self.fused.nodes] * len(reqs), [r.last_token for r in reqs], list(range(len(reqs))),
                              [self.pending[r.rid][1] for r in reqs])

    def adopt_chained(self, reqs: list["Req"], head_slots: np.ndarray) -> None:
        for req, slots in zip(reqs, head_slots.tolist()):
            self.kv.append_reserved(req, slots)
        self._in_flight.update(r.rid for r in reqs)

    def free_chained(self, head_slots: np.ndarray) -> None:
        self.kv.pool.slots.free(head_slots.ravel().tolist())

    def read_fused(self, reqs: list["Req"], outcome: torch.Tensor) -> GreedyOutcome:
        nodes = self.fused.nodes
        parsed = GreedyOutcome.parse(outcome[:, :1 + 2 * nodes])   # commit_path's layout, whatever the verification
        for req, tokens, drafts in zip(reqs, parsed.tokens, outcome[:, 1 + 2 * nodes:].tolist()):
            # rows L - 1 .. L - 2 + a now hold the committed tokens; the reserved rows after them
            # stay unset (junk or the draft steps' rows) and are freed by the next sync
            self.kv.record_drafts(req, tokens)
            self.pending[req.rid] = (req.num_tokens + len(tokens), drafts)
        self._in_flight.difference_update(r.rid for r in reqs)
        return parsed

    def observe_batch(self, reqs: list["Req"], committed: list[list[int]]) -> None:
        """As EagleDrafter's, except for the requests of a fused step launched ahead of this
        call (engine/draft_ahead.py): a sync would free the rows that step writes."""
        if self._in_flight:
            kept = [i for i, req in enumerate(reqs) if req.rid not in self._in_flight]
            reqs, committed = [reqs[i] for i in kept], [committed[i] for i in kept]
        super().observe_batch(reqs, committed)

    def can_feed(self, req: "Req") -> bool:
        return req.rid not in self._in_flight   # a feed's sync would free the rows that step writes

    def release(self, req: "Req") -> None:
        super().release(req)
        self.pending.pop(req.rid, None)
        self._in_flight.discard(req.rid)


def fusable(req: "Req") -> bool:
    """What verification inside the fused step handles: the target's filtered distribution,
    no penalties, no logprobs, no stop tokens held back by min_new_tokens."""
    params = req.params
    return not params.has_penalties and not req.return_logprob and params.min_new_tokens <= len(req.output_ids)


def verification_kind(reqs: list["Req"], sampling_rule: str) -> str:
    """fused_chain.KINDS: as the engine's sampler picks its rule (Sampler._rule): sampled
    drafts are verified by residual rejection with their q unless a seeded request asks for
    the coupled rule (which stays exact, it only accepts sampled drafts less)."""
    if all(r.params.greedy for r in reqs):
        return "greedy"
    sampled_drafts = any(draft_temperature(r) > 0 for r in reqs)
    seeded = any(r.params.seed is not None for r in reqs)
    if sampled_drafts and (sampling_rule == "rejection" or not seeded):
        return "rejection"
    return sampling_rule
