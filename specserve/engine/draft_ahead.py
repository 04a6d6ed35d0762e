"""Greedy drafting steps, and the next one launched before this one's bookkeeping (or, for a
fused chain, before this one is read).

A drafting (verify) step cannot be queued before the previous one's outcome is on the
host, as a plain step is (overlap.py): its drafts continue the tokens that outcome commits.
What can move is everything else. Once step N's outcome is read, the host commits its
tokens and KV slots, updates the adaptive policy, and at once proposes and launches step
N+1 (`DraftAhead.hold`); only then does it do what N+1 does not depend on: the drafter's
observe and indexing of N's tokens, N's text, the step's statistics, and, after the step
returns, streaming its outputs and scheduling the next step. So on a GPU the host time a
drafting step adds to its forward is the read, the commit and the next proposal and
launch (issue 10: at batch 1 on an H100 ~0.45 ms of host time sat between two verify
graphs).

What a proposal sees does not change: the drafter's indexing of N's tokens is handed over
after N+1 is launched, as it was when N's tokens were observed in N's commit and handed
over after N+1's launch, and the policy sees N's tokens and cost before choosing N+1's
draft size, as before. A step launched ahead is priced (the policy's step costs) from the
moment the previous step was priced to its own: one whole cycle of the loop, its hidden
host work included. Only drafters whose proposals read nothing but committed tokens
and what was indexed or read with the step qualify (`Drafter.proposes_ahead`: NGRAM, and
the fused EAGLE / NAIVE_EAGLE / MTP chain, whose steps are launched through the drafter's
launch_fused where it serves the batch: the next drafts come with the outcome), and only
greedy requests (their commit needs the argmax alone; under a grammar, the argmax and, where
the model strays from it, one node's mask: grammar/greedy_paths.py), or sampled ones a fused
chain's step verifies on the device (FusedSteps.samples_fused: the q its drafts were drawn
from stays on the device, and its randomness is keyed by seed and position, so a step
launched ahead commits what it would have after the read).

A fused chain's step goes further (`ChainedStep`; under the adaptive policy while the
batch's bucket drafts, the policy's choice for it made once the step before is committed):
its next drafts come out of the step itself, on the device, so step N+1 is queued before
N is read (ChainedSteps.launch_chained: its root, drafts and prefix lengths derived from N's
outcome on the device, its KV slots allocated by the host beforehand), and the read,
commit, proposal bookkeeping and launch all run while the GPU computes N+1, as on the
plain overlap schedule. Once N is committed the drafter takes N+1's head rows for the requests
that go on (`ChainedStep.held`); rows of requests N ended are cut when N+1 is read, their
slots freed (their writes land in freed slots and past committed lengths), and the step
after it is launched from the host again.

An NGRAM step with forecasts does the same without a head (`ForecastStep`,
--speculative-ngram-forecast): while N runs, the trie proposes for every way N may end (its
last accepted node and the target's token after it), N+1 is queued before N is read with its
trees picked on the device from that forecast by N's outcome (runner/forecast_step.py), and
once N is committed the host picks the same trees and holds N+1.

The step launched ahead is for exactly the batch the scheduler would pick next (nobody
waiting, nobody else running, no failure being isolated). Should that change before it
is read (a request arrives), the step is still read and committed first (`retire`);
an abort drops it (its slots are freed; its device writes land in those slots and in
table positions past every request's committed length, rewritten before they are read).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from specserve.engine.commit import StepOutcome
from specserve.engine.scheduler import Scheduler
from specserve.grammar.greedy_paths import LogitsAt, keep_to_grammar
from specserve.kv.pool import PADDING_SLOT, host_to_device_async
from specserve.request.forecast_record import ForecastGate
from specserve.request.req import Req, same_requests
from specserve.runner.forecast_step import pick
from specserve.runner.model_runner import InFlight, ModelRunner
from specserve.runner.stream_events import record
from specserve.runner.tree_step import GreedyOutcome, pad_node_slots
from specserve.speculative.drafter import ChainedSteps, Drafter, ForecastSteps, FusedSteps, hints
from specserve.verify.tree import TreeProposal


@dataclass
class DraftStep:
    """A launched greedy drafting step whose outcome the host has not read yet."""
    reqs: list[Req]
    num_nodes: np.ndarray         # (bs,) real nodes per request
    node_slots: np.ndarray        # (bs, n) the nodes' KV slots, padding nodes PADDING_SLOT
    slots: list[int]              # the same slots, request after request: held by no request before commit
    launched: InFlight            # (bs, 1 + 2n) greedy outcome (tree_step.commit_path), or (bs,) argmax for n = 1
    hidden: torch.Tensor | None   # (bs, n, features) when the runner keeps them
    started: float                # when the host started the work this step's cost counts from
    # a fused drafter's step (its own outcome layout, with the next drafts): the drafter's read_fused
    read_fused: Callable[[torch.Tensor], GreedyOutcome] | None = None
    rows: list[int] | None = None   # each request's row of the outcome, once rows of ended requests were cut
    # the trees and their logits, read where a constrained request strays from its grammar
    tree: TreeProposal | None = None
    logits_at: LogitsAt | None = None
    nodes_run: int | None = None   # nodes the forward ran, where not its trees' (a forecast step's: every slot)
    # a forecast step's: the nodes a request the policy chose, given its trees whole (the width
    # of the forecast step after it)
    next_width: int | None = None
    forecast: bool = False         # picked from a forecast (ForecastStep), not proposed after the read
    table_written: bool = True     # the device wrote the accepted slots into the table (a sampled step's: n = 1 only)

    @property
    def num_slots(self) -> int:
        return self.node_slots.shape[1]

    @property
    def nodes_priced(self) -> int:
        """The nodes the step's forward ran, what the policy prices it by."""
        return int(self.num_nodes.sum()) if self.nodes_run is None else self.nodes_run

    def read(self) -> StepOutcome:
        """Waits for the step (the one host sync) and parses its outcome."""
        packed, hidden = self.launched.wait(), self.hidden
        if self.rows is not None:
            packed = packed[self.rows]
            if hidden is not None:   # without waiting: a blocking copy would wait for the step launched after it
                hidden = hidden.index_select(0, host_to_device_async(torch.tensor(self.rows), hidden.device))
        if self.read_fused is not None:   # the drafter keeps the next drafts; the table is written
            parsed = self.read_fused(packed)
            return StepOutcome(parsed.tokens, parsed.accepted, parsed.accept_lens, True, None)
        if self.num_slots == 1:   # no drafts: the argmax is the outcome, the step wrote its slots in the table
            bs = len(self.reqs)
            outcome = StepOutcome([[token] for token in packed.tolist()], np.zeros((bs, 1), dtype=np.int64),
                                  np.ones(bs, dtype=np.int64), True, hidden)
        else:
            parsed = GreedyOutcome.parse(packed)
            outcome = StepOutcome(parsed.tokens, parsed.accepted, parsed.accept_lens, self.table_written, hidden)
        if any(r.grammar is not None for r in self.reqs):   # verified unmasked: greedy_paths.py
            tree = self.tree
            moved = keep_to_grammar([r.grammar for r in self.reqs], outcome.tokens, outcome.accepted,
                                    outcome.accept_lens, self.logits_at, tree.tokens, tree.parents, tree.num_nodes)
            outcome.table_written = not moved   # the commit writes the table where a path left the device's
        return outcome


@dataclass
class ChainedStep:
    """A fused step queued before the host read the step before it (ChainedSteps.launch_chained):
    its slots are nobody's until that step is committed and this one is held."""
    reqs: list[Req]
    launched: InFlight
    node_slots: np.ndarray     # (bs, n) the target's KV slots
    reserved: np.ndarray       # (bs, r) the drafter's own (its head's rows)

    def held(self, drafter: ChainedSteps, live: list[int], started: float) -> DraftStep:
        """The step for the requests at rows `live` (those the step before did not end), the
        drafter holding their reserved rows; the other rows are cut when it is read.
        started: where its cost counts from (the step before's pricing, as for any step
        launched ahead)."""
        reqs = [self.reqs[i] for i in live]
        drafter.adopt_chained(reqs, self.reserved[live])
        node_slots = self.node_slots[live]
        return DraftStep(reqs, np.full(len(reqs), node_slots.shape[1], dtype=np.int64), node_slots,
                         node_slots.ravel().tolist(), self.launched, None, started,
                         functools.partial(drafter.read_fused, reqs), None if len(live) == len(self.reqs) else live)

    def hold(self, scheduler: Scheduler, drafter: ChainedSteps, before: StepOutcome, live: list[int],
             started: float) -> tuple[DraftStep, TreeProposal, list[int], list[int] | None]:
        """`held`, and what the policy chooses from: the chains it verifies and their keys."""
        ended = sorted(set(range(len(self.reqs))) - set(live))
        if ended:
            self.free(scheduler, drafter, ended)
        step = self.held(drafter, live, started)
        proposal, num_nodes = drafter.chained_proposal(step.reqs)
        return step, proposal, num_nodes, hints(drafter).proposal_keys()

    def free(self, scheduler: Scheduler, drafter: ChainedSteps, rows: list[int]) -> None:
        """Frees these rows' slots (the step may still write them: whoever gets them next
        writes after it, in stream order)."""
        scheduler.free_slots(self.node_slots[rows].ravel().tolist())
        drafter.free_chained(self.reserved[rows])


@dataclass
class ForecastStep:
    """A verify step queued before the host read the step before it, its trees picked on the
    device from the drafter's forecast by that step's outcome (runner/forecast_step.py): its
    slots are nobody's until that step is committed and this one is held."""
    reqs: list[Req]
    launched: InFlight
    node_slots: np.ndarray     # (bs, n) a slot for every node a picked tree's first n may have
    table: np.ndarray          # the forecast it picked from (trees of up to the table's width)
    gate: ForecastGate         # its engine's, which hears what each request's pick found
    step_ratio: float          # the gate's r when it was launched
    hidden: torch.Tensor | None = None   # (bs, n, features) when the runner keeps them

    def hold(self, scheduler: Scheduler, drafter: ForecastSteps, before: StepOutcome, live: list[int],
             started: float) -> tuple[DraftStep, TreeProposal, list[int], list[int]]:
        """The step for the requests at rows `live` (those the step before did not end), its
        trees the first n nodes of the ones the step before's outcome picked (`before`), as on
        the device; the slots of nodes no tree took are freed (the device wrote none of them:
        it gave them the padding slot). Each live request's record notes whether it found its
        entry. Also returns, for the policy, the trees whole (what the drafter proposed), their
        node counts and keys, which the drafter hears too (ForecastSteps.forecast_held)."""
        bs, n = self.node_slots.shape
        picked = pick(self.table, before.accept_lens, before.accepted, before.tokens, n)
        for i in live:   # the evidence for whether their next steps forecast (request/forecast_record.py)
            self.gate.observe(self.reqs[i].forecast, bool(picked.found[i]), int(before.accept_lens[i]), self.step_ratio)
        reqs, full = [self.reqs[i] for i in live], picked.full
        proposed = TreeProposal(full.tokens[live], full.parents[live], full.num_nodes[live])
        proposed_nodes, keys = proposed.num_nodes.tolist(), [picked.keys[i] for i in live]
        try:
            drafter.forecast_held(reqs, proposed, proposed_nodes, keys)
        except BaseException:   # the step is nobody's: every slot it has comes back
            self.free(scheduler, drafter, list(range(bs)))
            raise
        verified = picked.verified
        taken = np.arange(n) < verified.num_nodes[:, None]
        ended = np.ones(bs, dtype=bool)
        ended[live] = False
        scheduler.free_slots(self.node_slots[~taken | ended[:, None]].tolist())
        node_slots = np.where(taken, self.node_slots, PADDING_SLOT)[live]
        num_nodes = verified.num_nodes[live]
        tree = TreeProposal(verified.tokens[live], verified.parents[live], num_nodes)
        step = DraftStep(reqs, num_nodes, node_slots, node_slots[taken[live]].tolist(), self.launched, self.hidden,
                         started, rows=None if len(live) == bs else live, tree=tree, nodes_run=bs * n, forecast=True)
        return step, proposed, proposed_nodes, keys

    def free(self, scheduler: Scheduler, drafter: ForecastSteps, rows: list[int]) -> None:
        """Frees these rows' slots (the step may still write them: whoever gets them next
        writes after it, in stream order)."""
        scheduler.free_slots(self.node_slots[rows].ravel().tolist())


def launch_forecast_step(runner: ModelRunner, before: DraftStep, table: np.ndarray, slots: list[int],
                         copies: "OutcomeCopies", gate: ForecastGate, step_ratio: float) -> ForecastStep:
    """Queues the step after `before` (launched, not read) for the same requests, its trees
    picked from `table` by before's outcome on the device (their first n nodes), `slots` a
    request's n nodes after another's, and the copy of its outcome to the host. `gate` hears
    what its picks find, weighed at `step_ratio` (request/forecast_record.py)."""
    reqs = before.reqs
    node_slots = np.asarray(slots, dtype=np.int64).reshape(len(reqs), -1)
    outcome = before.launched.device
    if before.rows is not None:   # the rows of requests the step before that ended are cut
        outcome = outcome.index_select(0, torch.tensor(before.rows, device=outcome.device))
    step = runner.run_forecast_trees(reqs, [r.kv_len for r in reqs], node_slots, outcome, table)
    return ForecastStep(reqs, copies.launch(step.outcome), node_slots, table, gate, step_ratio, step.hidden)


class OutcomeCopies:
    """Where drafting steps' outcomes are copied to the host: two pinned buffers per shape,
    used in turn, and an event for each turn. At most two drafting steps' outcomes are on
    their way at a time (a forecast step is launched before the step before it is read), and
    each is read (copied out: GreedyOutcome.parse, tolist) before the step after next is
    launched, or dropped (a later copy into the same buffer lands after it, and the event then
    marks the later one); so the buffers and events serve every step, where a pinned
    allocation and an event per step cost host time between two verify graphs."""

    def __init__(self):
        self._buffers: dict[tuple[tuple[int, ...], torch.dtype], list[torch.Tensor]] = {}
        self._done: list[torch.cuda.Event] = []
        self._turn = 0

    def launch(self, tensor: torch.Tensor) -> InFlight:
        if not tensor.is_cuda:
            return InFlight.launch(tensor)
        key = (tuple(tensor.shape), tensor.dtype)
        hosts = self._buffers.get(key)
        if hosts is None:
            hosts = self._buffers[key] = [torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                                          for _ in range(2)]
        if not self._done:
            self._done = [torch.cuda.Event(), torch.cuda.Event()]
        turn, self._turn = self._turn, 1 - self._turn
        host = hosts[turn]
        host.copy_(tensor, non_blocking=True)
        record(self._done[turn])
        return InFlight(tensor, host, self._done[turn])


def launch_draft_step(runner: ModelRunner, drafter: Drafter, reqs: list[Req], proposal: TreeProposal,
                      slots: list[int], started: float, copies: OutcomeCopies, kind: str = "greedy") -> DraftStep | None:
    """Queues the step's forward, greedy verification and table commit (n > 1), or its
    argmax (n = 1), and the copy of the outcome to the host, without waiting; or the
    drafter's fused step (verification and the next drafts), where it serves the batch.
    kind: the verification (runner/fused_chain.KINDS); a sampled batch (a fused drafter's)
    that its fused step does not take is not launched: None, for the engine's sampler."""
    n = proposal.num_slots
    node_slots = pad_node_slots(slots, proposal.num_nodes, n)
    fused = drafter.launch_fused(reqs, proposal, slots, kind) if isinstance(drafter, FusedSteps) else None
    if fused is not None:
        return DraftStep(reqs, proposal.num_nodes, node_slots, slots, fused, None, started,
                         functools.partial(drafter.read_fused, reqs))
    if kind != "greedy":
        return None
    step = runner.run_trees(reqs, proposal, slots)
    launched = copies.launch(step.outcome if n > 1 else step.logits[:, 0].argmax(-1))
    return DraftStep(reqs, proposal.num_nodes, node_slots, slots, launched, step.hidden, started,
                     tree=proposal, logits_at=step.logits_at)


class DraftAhead:
    """At most one drafting step launched before the scheduler asked for it."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.step: DraftStep | None = None
        self.steps_taken = 0   # steps read from a launch ahead (tests and benches count them)

    def batch_is_next(self, reqs: list[Req]) -> bool:
        """Whether the scheduler's next batch is exactly `reqs` decoding again: nobody waits
        for admission, nobody else runs (or prefills), no failure is being isolated."""
        scheduler = self.scheduler
        running = scheduler.running
        return not scheduler.waiting and scheduler.focus is None and same_requests(running, reqs)

    def hold(self, step: DraftStep) -> None:
        self.drop()
        self.step = step

    def take(self, reqs: list[Req]) -> DraftStep | None:
        """The step launched ahead for exactly these requests (else it is dropped: None)."""
        step, self.step = self.step, None
        if step is not None and same_requests(step.reqs, reqs):
            self.steps_taken += 1
            return step
        self._release(step)
        return None

    def keep_if_for(self, reqs: list[Req]) -> bool:
        """Whether the step launched ahead is for exactly these requests; one for others is
        dropped (its slots freed)."""
        if self.step is not None and same_requests(self.step.reqs, reqs):
            return True
        self.drop()
        return False

    def drop(self) -> None:
        """Forgets the step launched ahead, if any, and frees its slots."""
        step, self.step = self.step, None
        self._release(step)

    def _release(self, step: DraftStep | None) -> None:
        if step is not None:
            self.scheduler.free_slots(step.slots)
