"""EAGLE (EAGLE-2 heads, reading the target's final state) and EAGLE3 (three target layers
fused by the head's fc): a one-layer head drafts from the target's own hidden states a
chain of K tokens per step (--speculative-eagle-topk 1) or EAGLE-2's dynamic tree of
--speculative-num-draft-tokens nodes (top-k > 1: draft_tree.py); eagle_runner.py has the
head's forwards. A chain's steps are fused by default (fused_drafter.py, a subclass: the
target's verification and the next chain in one device function), and so are a tree's (the
next tree instead); this class's own chain or tree still serves the steps that cannot be
fused, every request's first drafts, and the hybrid's trees (speculative/hybrid/).

The target's states arrive after every forward that caches tokens (`observe_hidden`: a
prefill's every token, a verify step's accepted nodes) and wait here until the head feeds
them: row r of the head's cache reads the state of position r and the token after it, so
once a request has R + 1 tokens, rows up to R - 1 can be fed; the output of row R - 1
drafts the token after the root. Rows of the chain's draft steps read the head's own
outputs, not the target's: they are never kept (their tokens stay UNSET in DraftKVTable, so
the next sync frees them).

Plain steps (the adaptive policy decodes plainly where drafting would lose) keep the
target's states too: they wait here, and the next proposal's catch-up feeds them, so the
head has read every committed token before it drafts again. Once what waits here reaches
HELD_STATES_BYTES the batch's requests are fed in one forward (`observe_batch`), which
bounds it.

Chain drafts are argmax or sampled exactly as STANDALONE's (see standalone.py): sampled
drafts hand their q over the target vocabulary to residual rejection. Tree drafts are the
head's top-k, a deterministic function of the context, which verification takes as it is.
"""
from __future__ import annotations

import contextlib
import itertools
from typing import TYPE_CHECKING

import torch

from specserve.kv.pool import host_to_device_async
from specserve.speculative.drafter import Drafter, ProposalHints, ReadsHiddenStates
from specserve.speculative.model_drafters.draft_chain import ChainRow
from specserve.speculative.model_drafters.draft_kv import DraftKVTable
from specserve.speculative.model_drafters.held_states import HeldTargetStates
from specserve.speculative.model_drafters.model_proposals import chain_proposal, draft_temperature, tree_proposal

if TYPE_CHECKING:
    from specserve.request.req import Req
    from specserve.speculative.model_drafters.eagle_runner import EagleHeadRunner


# Plain steps of the adaptive policy (engine/core.py) keep the target's states but do not draft:
# a request's states wait here until its head is fed (a probe's or a drafting step's catch-up).
# A feed is an eager forward of ~160 ops, launch-bound whatever its rows (H200, random 1.5B,
# batch 1: a plain step that fed took ~4 ms more than one that did not), so the states wait
# until all that is held reaches HELD_STATES_BYTES (EAGLE-3 on a 1.5B target: 9 KB a token,
# ~29k tokens), then the batch's requests are fed in one forward. Fed every 32 plain steps and
# at the step after each prefill instead, EAGLE engines the policy kept plain (the head not
# worth drafting) made 0.81-0.90x of plain's tok/s at batch 1 and 0.57-0.76x at 64 (H200, 1.5B,
# session 21: not one drafting step in 40 cells); replayed on a CPU, 64 requests with
# ShareGPT-like turnover fed 45 times in 296 plain steps. The inputs of a feed go to the device
# without waiting (EagleHeadRunner.catch_up). (With this budget the rows still lost, 0.59-0.84x
# (session 22): their prefills ran eagerly, outside the prefill graphs; prefill_graph.py.)
HELD_STATES_BYTES = 256 << 20


class EagleDrafter(Drafter, ProposalHints, ReadsHiddenStates):
    probe_every = 16   # a probe costs the head's forwards and a host sync
    # H200, 1.5B at batch 1: a probe step took 5.4 ms against 1.25 ms; probing every 32nd plain
    # step cost ~10% where the head is not worth drafting (new requests are still probed at once)
    probe_every_at_most = 128
    # False: every request's chain drafts the head's argmax (a deterministic function of the
    # context, verified without a q): drafts that share a step with another source's, which
    # has no q (speculative/hybrid/drafter.py), need it, and so do probes (propose_probe)
    sampled_drafts = True

    def __init__(self, runner: "EagleHeadRunner"):
        self.runner = runner
        self.num_steps = runner.num_steps
        self.kv = DraftKVTable(runner.pool, token_offset=1, row_fanout=runner.topk)
        self.states = HeldTargetStates()

    def propose_probe(self, reqs: list["Req"], max_nodes: list[int]):
        """Argmax drafts for every request. A probe's chain is walked by exact matches against
        what plain steps sample, so a sampled draft node counts with probability sum(p q),
        where verifying it by rejection accepts sum(min(p, q)); an argmax node counts p(argmax q)
        either way. Measured with the kept 1.5B head on 16 ShareGPT second turns at temperature
        0.7, top-p 0.95 (lab/sampled_accept_bias.py, chains of 3): sampled drafts verified by
        rejection commit 2.589 tokens a step, walks of sampled probes expected 2.415, argmax
        drafts commit 2.574. A bucket held plain on walks of sampled chains underrated drafting
        by ~7%; argmax walks by ~0.6%."""
        with self.argmax_drafts():
            return self.propose(reqs, max_nodes)

    @contextlib.contextmanager
    def argmax_drafts(self):
        """Every chain drafted inside the block is the head's argmax (see sampled_drafts)."""
        sampled, self.sampled_drafts = self.sampled_drafts, False
        try:
            yield
        finally:
            self.sampled_drafts = sampled

    def observe_hidden(self, reqs: list["Req"], starts: list[int], states: torch.Tensor,
                       rows: list[list[int]], owned: bool = False) -> None:
        flat = [i for r in rows for i in r]
        if flat == list(range(len(flat))):
            # every row in order (a plain step's, a prefill's): kept as they are where the
            # caller's copy is handed over, else copied (a graph's outputs are overwritten by
            # its next replay)
            gathered = states[:len(flat)] if owned else states[:len(flat)].clone()
        else:   # the index goes without waiting: a blocking copy would wait for the step launched ahead
            gathered = states.index_select(0, host_to_device_async(torch.tensor(flat), states.device))
        if len(flat) == len(reqs):   # one state a request (each hands over one at least): a plain step's, kept whole
            self.states.append_plain_step([req.rid for req in reqs], starts, gathered)
            return
        for req, start, part in zip(reqs, starts, gathered.split([len(r) for r in rows])):
            self.states.append(req.rid, start, part)

    def prefilled(self, reqs: list["Req"]) -> None:
        """Feeds the new prompts whose every row can be fed: those whose states reach the
        prompt's last token (a chunk before that only hands its states over; a prompt's last
        token may be cached by a decode step, after a chunk that ends one short), unless the
        request ends with its first token (it never drafts)."""
        self.feed([req for req in reqs if not req.output_ids and req.max_new_tokens > 1 and self.can_feed(req)
                   and self.states.end(req.rid) >= self.kv.rows_of(req)])

    def propose(self, reqs: list["Req"], max_nodes: list[int]):
        chained, features = [], []
        for index, (req, limit) in enumerate(zip(reqs, max_nodes)):
            if limit <= 1:
                continue
            rows = self.kv.rows_of(req)                       # R: rows 0 .. R - 1 are fed
            start = self.kv.reserve(req, self.runner.draft_slots)
            first = None if start is None else min(start, rows - 1)
            fed = None if first is None else self.states.rows(req.rid, first, rows)
            if fed is None:            # no room, or states missing: no drafts for it this step
                if start is not None:
                    self.kv.release(req)
                continue
            chained.append((index, req, first))
            features.append(fed)
        roots = [r.last_token for r in reqs]
        if not chained:
            return chain_proposal(max_nodes, roots, [], [], None, self.num_steps)
        try:
            drafts, probs = self._draft(chained, features)
        except BaseException:   # rows from `first` on may not hold what the table says; their states are kept
            for _, req, first in chained:
                self.kv.truncate(req, first)
            raise
        drafted = [index for index, _, _ in chained]
        if self.runner.topk > 1:
            return tree_proposal(max_nodes, roots, drafted, drafts, self.runner.tree_nodes)
        return chain_proposal(max_nodes, roots, drafted, drafts, probs, self.num_steps)

    def _draft(self, chained, features) -> tuple[list[list[int]], torch.Tensor | None]:
        """Catch-up of rows a chain does not feed, then the chain; the drafts on the host (the
        one sync) and q, if sampled."""
        self.kv.write_table()
        lagging, rows, chain_features = [], [], []
        for (_, req, first), fed in zip(chained, features):
            seq, end = self.kv.sequences[req.rid], self.kv.rows_of(req)
            # row r reads position r's state and token r + 1: a chain from the prompt's last row is
            # a request's first, after its prompt's rows (fed by the prefill's step, or here where
            # it could not be); with an unchained step and a host sync, such steps cost 15-20 ms
            # for ~60 new chats at batch 64 on an H100 (1.5B) against ~4.5 ms for a chained step:
            # judged with an episode's other steps, two of them stopped one that had made 1.3x
            # over plain, and the batch decoded plainly for its remaining ~130 (took_prefill)
            self.prompt_fed |= first <= len(req.prompt_ids) - 1
            chain_start = max(first, end - self.runner.fed_rows)    # the chain feeds rows chain_start .. end - 1
            if chain_start > first:
                lagging.append((seq, first, chain_start, fed[:chain_start - first]))
            rows.append(ChainRow(tokens=seq.tokens[chain_start:end],
                                 slots=seq.slots[chain_start:end] + seq.slots[end:end + self.runner.draft_slots],
                                 req_row=seq.row, prefix_len=chain_start, seed=req.seed,
                                 temperature=draft_temperature(req) if self.sampled_drafts else 0.0))
            chain_features.append(fed[chain_start - first:])
        if lagging:
            self._catch_up(lagging)
        drafts, probs = self.runner.draft(rows, torch.cat(chain_features), sample=any(r.temperature > 0 for r in rows))
        for _, req, _ in chained:   # fed: keep the last row's state only, for a re-feed
            self.states.drop_before(req.rid, self.kv.rows_of(req) - 1)
        return drafts.tolist(), probs

    def _catch_up(self, lagging: list[tuple]) -> None:
        """One head forward without drafting over rows first .. stop - 1 of each (sequence,
        first, stop, their target states)."""
        slots = list(itertools.chain.from_iterable(seq.slots[first:stop] for seq, first, stop, _ in lagging))
        self.runner.catch_up([seq.row for seq, _, _, _ in lagging], [first for _, first, _, _ in lagging],
                             [seq.tokens[first:stop] for seq, first, stop, _ in lagging], slots,
                             torch.cat([states for _, _, _, states in lagging]))

    def probe_order(self, reqs: list["Req"]) -> list[int]:
        """Fewest rows to catch up first (DraftKVTable.cheapest_first)."""
        return self.kv.cheapest_first(reqs)

    def observe(self, req: "Req", committed: list[int]) -> None:
        self.kv.sync(req)   # the chain's rows go back to the pool

    def observe_batch(self, reqs: list["Req"], committed: list[list[int]]) -> None:
        """Syncs the head caches that hold a chain's rows; once the states held reach HELD_STATES_BYTES,
        feeds the batch's, if they are at least half of them (the rest wait for requests
        that are not decoding: a prefill in chunks; feeding a few rows each step would cost
        a forward a step)."""
        self.kv.sync_batch(reqs)
        if self.states.held_bytes < HELD_STATES_BYTES:
            return
        waiting = [req for req in reqs if self.states.count(req.rid) > 1]   # the last fed row stays
        if 2 * sum(self.states.count(req.rid) - 1 for req in waiting) * self.states.row_bytes >= HELD_STATES_BYTES:
            self.feed(waiting)

    def feed(self, reqs: list["Req"]) -> None:
        """Step 0 over every row the requests' head caches lack (tokens plain steps committed),
        in one catch-up forward, without drafting: afterwards each holds only the last fed
        row's state (a chain re-feeds it). A request whose rows do not fit in the pool keeps
        its states until they do."""
        fed = []
        for req in reqs:
            end = self.kv.rows_of(req)
            start = self.kv.reserve(req, 0)
            if start is None or start >= end:
                continue
            states = self.states.rows(req.rid, start, end)
            if states is None:     # never expected: every cached token's state arrives (observe_hidden)
                self.kv.truncate(req, start)
                continue
            fed.append((req, self.kv.sequences[req.rid], start, end, states))
        if not fed:
            return
        self.kv.write_table()
        try:
            self._catch_up([(seq, start, end, states) for _, seq, start, end, states in fed])
        except BaseException:   # the rows do not hold what the table says; the states are kept
            for req, _, start, _, _ in fed:
                self.kv.truncate(req, start)
            raise
        for req, _, _, end, _ in fed:
            self.states.drop_before(req.rid, end - 1)

    def can_feed(self, req: "Req") -> bool:
        """Whether `feed` may run for the request now (no step in flight writes its rows)."""
        return True

    def release(self, req: "Req") -> None:
        self.kv.release(req)
        self.states.release(req.rid)

    def preempted(self, req: "Req") -> None:
        self.release(req)   # its resumed prefill brings every state back
