"""NAIVE_EAGLE and MTP: a chain of one draft per step (the root and d1), where the target's
verification of step N and the head's draft for step N + 1 run in one device function (one
CUDA graph replay, runner/fused_chain.py): no host round trip between them, one host sync
per step, which reads the committed tokens and the next draft together.

The head is an EAGLE head from our trainer (either kind: EAGLE-2's final state or EAGLE-3's
three layers) for NAIVE_EAGLE, an MTP layer (mtp_head.py) for MTP; both keep the row layout
of eagle.py (row r reads the state of position r and the token at r + 1).

Per request, the drafter keeps the draft the last fused step made (`pending`, at the
position it drafts) and its head cache fed up to the row before the root. A request without
a pending draft (a prompt just prefilled, a resumed preemption, or a step the engine
verified itself) first goes through EagleDrafter's chain with one step: the catch-up of its
rows from the stored target states, then its first draft (a host sync, on such steps only).
Then every request gets its next two head rows reserved, and the step is fused.

Batches the fused step cannot serve (penalties, logprobs, min_new_tokens still holding stop
tokens back, a head cache that did not fit) are verified by the engine as usual: the target
forward keeps its states (observe_hidden) and the next step catches up on them.
Sampling: drafts are sampled from the head's q (unseeded requests; verified by residual
rejection with that q) or its argmax (greedy and seeded requests; the coupled rule gives a
seeded request plain decoding's tokens), as STANDALONE's and EAGLE's chains.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from specserve.runner.tree_step import GreedyOutcome
from specserve.sampling.sampler import SampledStep
from specserve.speculative.draft_kv import UNSET
from specserve.speculative.eagle import EagleDrafter
from specserve.speculative.model_proposals import chain_proposal, draft_temperature
from specserve.speculative.tree import TreeProposal

if TYPE_CHECKING:
    from specserve.engine.request import Req
    from specserve.runner.eagle_runner import EagleHeadRunner
    from specserve.runner.fused_chain import FusedChainRunner
    from specserve.sampling.sampler import Sampler

FUSED_ROWS = 2   # the head rows a fused step feeds: L - 1 and L (L = the request's tokens)


class NaiveEagleDrafter(EagleDrafter):
    """EAGLE's drafter with one draft per step whose verify steps it runs itself (verify_fused)."""

    def __init__(self, runner: "EagleHeadRunner", fused: "FusedChainRunner"):
        super().__init__(runner)
        self.fused = fused
        self.pending: dict[str, tuple[int, int]] = {}   # rid -> (position, token) of the next draft
        self._reserved: set[str] = set()                 # requests whose fused rows this step reserved

    def propose(self, reqs: list["Req"], max_nodes: list[int]) -> tuple[TreeProposal, list[int]]:
        lagging = [req for req in reqs if self._draft_of(req) is None]
        if lagging:
            self._first_drafts(lagging)
        self._reserved = set()
        drafted, drafts = [], []
        for index, (req, limit) in enumerate(zip(reqs, max_nodes)):
            draft = self._draft_of(req)
            if draft is None or self.kv.reserve(req, FUSED_ROWS) is None:
                continue    # no draft (its states were missing) or no room: the engine verifies this batch
            self._reserved.add(req.rid)
            if limit > 1:
                drafted.append(index)
                drafts.append([draft])
        self.kv.write_table()
        roots = [r.output_ids[-1] if r.output_ids else r.prompt_ids[-1] for r in reqs]
        proposal, num_nodes = chain_proposal(max_nodes, roots, drafted, drafts, None, 1)
        if not self._fuses(reqs) and any(draft_temperature(reqs[i]) > 0 for i in drafted):
            proposal = self._with_q(proposal, reqs)
        return proposal, num_nodes

    def _fuses(self, reqs: list["Req"]) -> bool:
        """Whether the fused step serves this batch (else the engine verifies it)."""
        return all(r.rid in self._reserved and fusable(r) for r in reqs)

    def _with_q(self, proposal: TreeProposal, reqs: list["Req"]) -> TreeProposal:
        """The proposal with the q its sampled drafts were drawn from, for the engine's
        residual rejection (node 1 has no children: its q stays 0)."""
        q = self.fused.q_table.index_select(0, torch.tensor([r.row for r in reqs], device=self.fused.device))
        return dataclasses.replace(proposal, draft_probs=torch.stack([q, torch.zeros_like(q)], dim=1))

    def _draft_of(self, req: "Req") -> int | None:
        """The pending draft, if it is for the request's next position and the head's cache
        holds every row before the root (a fused step feeds the two after)."""
        pending = self.pending.get(req.rid)
        if pending is None or pending[0] != req.num_tokens or req.rid not in self.kv.sequences:
            return None
        return pending[1] if self.kv.sync(req).committed == self.kv.rows_of(req) else None

    def _first_drafts(self, reqs: list["Req"]) -> None:
        """EAGLE's catch-up and a chain of one draft, for requests without a pending draft;
        their q goes where the fused step reads it."""
        proposal, num_nodes = super().propose(reqs, [FUSED_ROWS] * len(reqs))
        drafted = [i for i, count in enumerate(num_nodes) if count == FUSED_ROWS]
        if not drafted:
            return
        drafts = proposal.tokens[drafted, 1].tolist()
        for i, draft in zip(drafted, drafts):
            self.pending[reqs[i].rid] = (reqs[i].num_tokens, draft)
        probs = None if proposal.draft_probs is None else proposal.draft_probs[drafted, 0]
        self.fused.set_pending_q([reqs[i].row for i in drafted], probs, drafts)

    def verify_fused(self, reqs: list["Req"], proposal: TreeProposal, slots: list[int],
                     sampler: "Sampler") -> "SampledStep | None":
        if not self._fuses(reqs):
            return None
        head_slots = []
        for req in reqs:
            first = self.kv.rows_of(req)
            head_slots.extend(self.kv.sequences[req.rid].slots[first:first + FUSED_ROWS])
        kind = verification_kind(reqs, sampler.sampling_rule)
        outcome = self.fused.launch(reqs, proposal, slots, head_slots, kind).wait()   # the step's one sync
        parsed = GreedyOutcome.parse(outcome[:, :-1])     # commit_path's layout, whatever the verification
        for req, tokens, draft in zip(reqs, parsed.tokens, outcome[:, -1].tolist()):
            # rows L - 1 and L now hold the tokens at L and L + 1; row L's is junk unless d1 was accepted
            self.kv.record_drafts(req, [tokens[0], tokens[1] if len(tokens) == FUSED_ROWS else UNSET])
            self.pending[req.rid] = (req.num_tokens + len(tokens), draft)
        return SampledStep(parsed.tokens, parsed.accepted_nodes, None, None)

    def release(self, req: "Req") -> None:
        super().release(req)
        self.pending.pop(req.rid, None)


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
