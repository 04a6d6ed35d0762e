"""EngineCore: one step is schedule -> (draft) -> forward -> verify -> commit.

Nothing else talks to the model. A decode step is a verify step whose draft trees hold only
their root, so plain decoding and every speculative algorithm share one path. Plain greedy
steps run one step ahead (overlap.py); greedy drafting steps launch the next one right
after their commit (drafting_steps.py, draft_ahead.py).
"""
from __future__ import annotations

import functools
import logging
import time
from typing import Callable

import torch

from specserve.engine.commit import (DeferredText, StepOutcome, can_defer_text, commit_accepted_kv, ends_within,
                                     finish_reason, unfinished)
from specserve.engine.draft_ahead import DraftAhead, OutcomeCopies
from specserve.engine.drafting_steps import DraftingSteps
from specserve.engine.overlap import OverlapSchedule, StepAhead
from specserve.engine.scheduler import Scheduler
from specserve.engine.stats import SpecCounters, StepLogger
from specserve.engine.step_output import StepOutput
from specserve.grammar.drafts import constrain_proposal
from specserve.grammar.finish import grammar_finish
from specserve.request.req import Batch, Req, ReqState, SpecStats
from specserve.runner.model_runner import InFlight, ModelRunner
from specserve.runner.tree_step import GreedyOutcome, pad_node_slots
from specserve.sampling.sampler import Sampler, SampledStep
from specserve.speculative.adaptive.draft_cuts import fit_to_free_slots
from specserve.speculative.adaptive.policy import AdaptiveDraftLength
from specserve.speculative.drafter import Drafter
from specserve.verify.tree import DraftTrees, TreeProposal

logger = logging.getLogger(__name__)


class EngineCore(DraftingSteps):
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, sampler: Sampler,
                 drafter: Drafter | None, num_draft_tokens: int, log_interval_s: float = 10.0,
                 adaptive: AdaptiveDraftLength | None = None, overlap: bool = False):
        self.runner = runner
        self.scheduler = scheduler
        self.sampler = sampler
        self.drafter = drafter
        self.num_draft_tokens = num_draft_tokens if drafter is not None else 1
        self.adaptive = adaptive if drafter is not None else None  # None: always verify the full draft
        # plain greedy decode steps run one step ahead (overlap.py): always without a drafter,
        # and with one while the adaptive draft length says plain decoding wins
        self.overlap = OverlapSchedule(runner, scheduler) if overlap else None
        # greedy drafting steps: the next one launched before this one's bookkeeping (draft_ahead.py)
        self.draft_ahead = DraftAhead(scheduler) if overlap else None
        self.outcome_copies = OutcomeCopies()   # greedy drafting steps' outcomes on their way to the host
        self.stats = StepLogger(log_interval_s, speculative=drafter is not None)
        self.spec_counters = SpecCounters()
        self.requests: dict[str, Req] = {}
        self.last_batch_reqs: list[Req] = []   # the requests of the step in flight, failed together if it raises
        scheduler.preempt_listeners.append(self._preempted)
        self.text = DeferredText()   # a drafting step's detokenizing, done while the GPU runs the next step
        self._unsettled: Callable[[], None] | None = None   # a plain step's bookkeeping, put off (_settle)

    # --- public surface ---
    def add_request(self, req: Req) -> None:
        if req.rid in self.requests:
            raise ValueError(f"request id {req.rid!r} is already in use")
        if req.max_new_tokens == 0:
            req.state = ReqState.FINISHED
            req.finish_reason = {"type": "length", "length": 0}
            req.finish_time = time.perf_counter()
            return
        self.requests[req.rid] = req
        self.scheduler.add(req)
        if self.drafter is not None:
            self.drafter.add_prompt(req)

    def abort(self, rid: str) -> Req | None:
        req = self.requests.pop(rid, None)
        if req is None or req.finished:
            return None
        self._settle()
        self._drop_ahead()  # a step launched ahead may hold a slot for this request
        self.text.drain(req)
        self.scheduler.abort(req)
        req.state = ReqState.FINISHED
        req.finish_reason = {"type": "abort", "message": "aborted"}
        req.finish_time = time.perf_counter()
        self._release_draft_state(req)
        return req

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[StepOutput]:
        ahead = self.draft_ahead.step if self.draft_ahead is not None else None
        if ahead is not None and not self.draft_ahead.batch_is_next(ahead.reqs):
            self._settle()
            return self._retire_ahead(ahead.reqs)
        batch = self.scheduler.schedule()
        kept = self.overlap.keep_through(batch) if self.overlap is not None and batch is not None and batch.is_extend \
            else None
        if batch is None or batch.is_extend:
            self._drop_ahead()
        if batch is None:
            self._settle()   # a prefill runs it after its launch, a decode step where _run_decode says
            self.text.run()
            return []
        self.last_batch_reqs = batch.reqs if kept is None else batch.reqs + kept.reqs
        try:
            outputs = self._run_extend(batch) if batch.is_extend else self._run_decode(batch)
        except BaseException:
            if kept is not None:
                self.overlap.release(kept)
            raise
        if kept is not None:
            outputs = self._commit_kept(kept) + outputs
        self.stats.maybe_log(self.scheduler)
        return outputs

    # --- the two kinds of step ---
    def _run_extend(self, batch: Batch) -> list[StepOutput]:
        slots = self.scheduler.alloc_slots(sum(batch.extend_lens))
        assert slots is not None, "the scheduler reserves the cache a prefill needs"
        capture = self.runner.hidden_capture.fresh() if self.runner.hidden_capture is not None else None
        starts = [req.kv_len for req in batch.reqs]
        try:
            logits = self.runner.extend(batch.reqs, batch.extend_lens, slots, batch.samples, capture)
            self._settle()    # the last plain step's bookkeeping, while the GPU runs the prefill
            self.text.run()   # while the GPU runs the prefill
            if self.drafter is not None:
                self.drafter.flush()  # e.g. new prompts indexed in the background while the GPU runs the prefill
        except BaseException:
            self.scheduler.free_slots(slots)  # no request holds them yet
            raise
        self.scheduler.append_kv(batch.reqs, _split(slots, batch.extend_lens))
        if capture is not None and self.drafter is not None:   # every token's state, request after request
            self.drafter.observe_hidden(batch.reqs, starts, capture.features(), _split(
                list(range(sum(batch.extend_lens))), batch.extend_lens))
        sampling = [req for req, samples in zip(batch.reqs, batch.samples) if samples]
        if not sampling:
            return []
        if self.adaptive is not None:
            self.adaptive.admit()   # they decode from the next step: a probe looks at them first
        trees = DraftTrees.root_only(torch.tensor(self._last_tokens(sampling)))
        sampled = self.sampler.sample(logits, trees, sampling, self.sampler.prepare(trees, sampling))
        return self._observe([self._commit(req, sampled, i) for i, req in enumerate(sampling)])

    def _run_decode(self, batch: Batch) -> list[StepOutput]:
        start = time.perf_counter()
        reqs = batch.reqs
        held = self.draft_ahead.take(reqs) if self.draft_ahead is not None else None
        if held is not None:
            self._settle()
            return self._finish_draft_step(reqs, held, steady=True)
        # the choice may read the policy one plain step stale (that step's after-work runs once the
        # next plain step is launched, _run_decode_ahead): a switch it makes applies a step later
        draft = self.drafter is not None and (self.adaptive is None or self.adaptive.should_draft(len(reqs)))
        if draft and self.adaptive is not None and (not self.drafter.ready_to_draft() or self._plain_step_ahead(reqs)):
            # its proposals would wait for the indexing of new prompts while the GPU idles (H100, 0.5B,
            # ShareGPT second turns at 32: one drafting step of 60-90 ms a run, ~15% of it): decode
            # plainly meanwhile, reading the plain step launched ahead while the drafter was behind
            # (_next_plain_rows) once it has caught up; the bucket stays in drafting mode
            draft = False
        if not draft and self.overlap is not None and self.sampler.argmax_is_enough(reqs):
            return self._run_decode_ahead(reqs, start)
        self._settle()   # proposals, probes and prices below read what the last step showed
        self._drop_ahead()
        probing = not draft and self._probe_due(reqs)
        if draft:
            proposal, num_nodes, record_shadows = self._propose(reqs)
            record_shadows()
        else:
            proposal, num_nodes = self._no_drafts(reqs)
        if draft and any(r.grammar is not None for r in reqs):   # forbidden drafts cut, forced ones added
            proposal = constrain_proposal(reqs, proposal, self.sampler.vocab_size, self._draft_limits(reqs))
            num_nodes = proposal.num_nodes.tolist()
        free = self.scheduler.available_slots()
        if sum(num_nodes) > free:   # the cache fits one token a request (the scheduler made sure), not every draft
            num_nodes = fit_to_free_slots(list(num_nodes), free)
            proposal = proposal.cut(num_nodes)
        slots = self.scheduler.alloc_slots(sum(num_nodes))
        if draft and self._drafts_greedily(reqs):
            return self._finish_draft_step(reqs, self._launch_draft(reqs, proposal, slots, start),
                                           steady=self.draft_ahead is None)
        try:
            outcome = self._verify(reqs, proposal, slots, index=draft or probing, drafted=draft)
        except BaseException:
            self.scheduler.free_slots(slots)  # no request holds them until commit
            raise
        if outcome.hidden is not None and self.drafter is not None:   # the states of the accepted nodes
            self.drafter.observe_hidden(reqs, [r.kv_len for r in reqs],
                                        outcome.hidden.reshape(len(reqs) * proposal.num_slots, -1),
                                        outcome.hidden_rows(proposal.num_slots))
        self._commit_kv(reqs, outcome, pad_node_slots(slots, proposal.num_nodes, proposal.num_slots), proposal.num_nodes)
        outputs = self._observe(self._commit_verified(reqs, outcome, defer_text=True))
        if self.adaptive is not None:
            if probing:
                self._probe(reqs)  # its host time is part of what plain steps cost
            # a plain step here prices plain decoding only where plain mode runs its steps so too
            # (drafting steps skip the check: `or` stops at them)
            steady = proposal.num_slots > 1 or not (
                self._rare_probe(reqs, probing) or (self.overlap is not None and self.sampler.argmax_is_enough(reqs)))
            self.adaptive.record_step(len(reqs), proposal.num_slots, time.perf_counter() - start,
                                      _committed(outputs), steady, int(proposal.num_nodes.sum()))
        return outputs

    def _verify(self, reqs: list[Req], proposal: TreeProposal, slots: list[int], index: bool = True,
                drafted: bool = True) -> StepOutcome:
        """Runs the step's forward and decides what each request commits. Greedy trees are
        verified on the device, which also writes the accepted slots into the KV table: one
        copy of the outcome comes back. Other steps go through the sampler (penalties,
        sampling, logprobs). The outcome also holds the nodes' hidden states (bs, n,
        features) when the runner keeps them (an EAGLE drafter reads them). A fused
        drafter (NAIVE_EAGLE, MTP, EAGLE chains) may run a step it proposed for itself, its
        next drafts included (`drafted`; a plain step's never: its next step may be plain too).
        While the GPU computes, the host detokenizes the previous step's tokens and hands
        the drafter's deferred indexing to its writer (`index`: plain steps that do not
        probe leave it to the next probe)."""
        n = proposal.num_slots
        fused = self.drafter.verify_fused(reqs, proposal, slots, self.sampler, self.text.run) \
            if self.drafter is not None and drafted else None
        if fused is not None:   # the text ran while the GPU computed the step
            return StepOutcome.from_sampled(fused, n, table_written=True)
        greedy = n > 1 and self.sampler.argmax_is_enough(reqs)
        if not greedy:  # the sampler's tensors are sent before the forward: a copy after it would wait for it
            host_trees = proposal.trees()
            prepared = self.sampler.prepare(host_trees, reqs, proposal.draft_probs)
        step = self.runner.run_trees(reqs, proposal, slots)
        launched = InFlight.launch(step.outcome) if greedy else None
        self.text.run()
        if self.drafter is not None and index:
            self.drafter.flush()  # indexed in the background while the GPU computes the step
        if greedy:
            parsed = GreedyOutcome.parse(launched.wait())
            return StepOutcome(parsed.tokens, parsed.accepted, parsed.accept_lens, True, step.hidden)
        sampled = self.sampler.sample(step.logits, host_trees, reqs, prepared)
        # a decode step (n = 1) wrote its one slot on the device (tree_step.write_decode_slots)
        return StepOutcome.from_sampled(sampled, n, table_written=n == 1, hidden=step.hidden)

    # --- plain greedy decoding, one step ahead (overlap.py) ---
    def _run_decode_ahead(self, reqs: list[Req], start: float) -> list[StepOutput]:
        current = None
        launched_ahead = self.overlap.ahead
        try:
            current = self.overlap.current_step(reqs, lambda: self._last_tokens(reqs))
            keep = self._next_plain_rows(reqs)
            if keep:
                self.overlap.launch_next(current, keep)
            self._settle()   # the last plain step's after-work, while the GPU runs this one and the next
            # a probe's host time hides behind the step launched ahead; a step that launches none
            # (the next one drafts, or every request ends in this one) leaves its probe to the
            # next plain step, which has the GPU busy while it probes
            probing = bool(keep) and self._probe_due(reqs)
            self.text.run()   # a drafting step's, before this step's tokens reach the detokenizers
            if probing:
                self.drafter.flush()  # what the probe proposes from, indexed in the background meanwhile
            tokens = current.tokens()
        except BaseException:
            self.overlap.release(current)
            self.overlap.drop()
            raise
        # a request a stop token ended here keeps its row in the step ahead, cut when that is read
        outputs = self._commit_plain(current, tokens)
        if probing and self.overlap.ahead is None:   # the launch found no slots: nothing in flight
            self.adaptive.put_off_probe(len(reqs))
            probing = False
        after = functools.partial(self._after_plain_step, reqs, outputs, probing, current is launched_ahead, start)
        if self.drafter is not None and self.scheduler.has_work():
            # shown after the next launch (_settle): the drafter's observe, the policy's and its
            # probe cost ~0.1-0.2 ms of host time a step at 32-64 requests on an H200's host (0.5B,
            # 1.5B), and between reading this step and launching the one after next that time is
            # the GPU's, wherever the host is behind (the steps that probe). With nothing in
            # flight (a request ended) the next launch is a prefill as a rule.
            self._unsettled = functools.partial(after, time.perf_counter() - start)
        else:
            after()
        return outputs

    def _commit_plain(self, step: StepAhead, tokens: list[int]) -> list[StepOutput]:
        """A plain step's tokens, read: its KV slots (in the table already: the step wrote
        them), its hidden states to the drafter (a head's, fed when it drafts again), its commit."""
        reqs = step.reqs
        if step.hidden is not None and self.drafter is not None:
            # the runner copied them out of the decode graph (launch_greedy_decode): no second copy
            self.drafter.observe_hidden(reqs, [r.kv_len for r in reqs], step.hidden, step.hidden_rows(), owned=True)
        self.scheduler.append_kv(reqs, [[slot] for slot in step.slots], write_table=False)
        # detokenized after the next launch (DeferredText): at 64 requests ~0.2-0.3 ms of host
        # time a step that otherwise sits between reading this step and launching the one after next
        return self._commit_verified(reqs, SampledStep.plain(tokens), defer_text=True, plain=True)

    def _commit_kept(self, kept: StepAhead) -> list[StepOutput]:
        """The step launched ahead that a prefill came after (OverlapSchedule.keep_through),
        read once the prefill has run: its tokens are shown to the drafter and the policy, not
        priced (its time is the prefill's too)."""
        try:
            tokens = kept.tokens()
        except BaseException:
            self.overlap.release(kept)
            raise
        return self._observe(self._commit_plain(kept, tokens))

    def _after_plain_step(self, reqs: list[Req], outputs: list[StepOutput], probing: bool, was_ahead: bool,
                          start: float, seconds: float | None = None) -> None:
        """A plain step's tokens shown to the drafter and the policy, its probe and its price
        (`seconds`: measured when this was put off, see _settle)."""
        self._observe(outputs)
        if self.adaptive is None:
            return
        if probing:
            self._probe(reqs)  # while the GPU runs the step launched ahead
        # plain decoding is priced by the steps plain mode runs: launched ahead, no probe
        steady = was_ahead and not self._rare_probe(reqs, probing)
        seconds = time.perf_counter() - start if seconds is None else seconds
        self.adaptive.record_step(len(reqs), 1, seconds, len(outputs), steady)   # a token each

    def _settle(self) -> None:
        """Runs a plain step's bookkeeping that waited for the next launch (a step that had
        nothing in flight); before anything that reads the drafter's or the policy's state:
        a decode step, an abort, a preemption."""
        unsettled, self._unsettled = self._unsettled, None
        if unsettled is not None:
            unsettled()

    def _probe_due(self, reqs: list[Req]) -> bool:
        """Whether this plain step probes (adaptive.py: every k-th plain step, k from the
        probes' measured host time; at least every `drafter.probe_every`-th for a model
        drafter, whose proposals cost draft forwards, and at most `drafter.probe_every_at_most`);
        put off while the drafter's background bookkeeping is far behind (the probe would wait for it)."""
        return (self.adaptive is not None and self.drafter.ready_to_probe()
                and self.adaptive.probe_due(len(reqs), self.drafter.probe_every, self.drafter.probe_every_at_most))

    def _rare_probe(self, reqs: list[Req], probing: bool) -> bool:
        """Whether this step probed where most plain steps of its bucket do not: then it is
        no plain step as plain mode runs them (where every plain step probes, it is one)."""
        return probing and self.adaptive.probe_every(len(reqs)) > 1

    def _probe(self, reqs: list[Req]) -> None:
        """A plain step's look at whether drafting would pay now: proposals for a few of its
        requests, kept as the adaptive policy's shadows only (nothing is verified). Its host
        time is the probe's cost: the proposals include the wait for the indexing they need
        (what the drafter's writer has not finished while the GPU computed)."""
        start = time.perf_counter()
        sample = self._probe_sample(reqs)
        if sample:
            proposal, num_nodes = self.drafter.propose(sample, self._draft_limits(sample))
            rids, keys = [r.rid for r in sample], self.drafter.proposal_keys()
            self.adaptive.record_proposals(rids, proposal, num_nodes, keys)
            self.adaptive.probe(len(reqs), rids, num_nodes, keys)
        self.adaptive.record_probe(len(reqs), time.perf_counter() - start)

    def _probe_sample(self, reqs: list[Req]) -> list[Req]:
        """The requests a probe proposes for: a window rotating through the batch, or, where it
        samples part of the batch and the drafter's proposals cost more for some requests, the
        cheapest: a model drafter's proposal first feeds every row the request's draft cache
        lacks, for a new request its whole prompt (H200, 1.5B, EAGLE-3 held plain at 64: one
        probe of 16 requests, ~10 ms, was all the adaptive engine lost to plain on code-types;
        how much of it was that catch-up was not profiled)."""
        window = self.adaptive.probe_requests(len(reqs))   # at most the batch: no request twice
        if len(window) < len(reqs):
            live = [r for r in reqs if not r.finished]
            order = self.drafter.probe_order(live)
            if order is not None:
                return [live[i] for i in order[:len(window)]]
        return [reqs[i % len(reqs)] for i in window if not reqs[i % len(reqs)].finished]

    def _next_plain_rows(self, reqs: list[Req]) -> list[int]:
        """The requests (indices) whose next step can be launched before this one's tokens are
        read: those this step does not end by length or context; none where that step would draft."""
        context = self.runner.context_length
        keep = [i for i, r in enumerate(reqs) if len(r.output_ids) + 1 < r.max_new_tokens and r.kv_len + 2 <= context]
        if keep and self.adaptive is not None and self.adaptive.would_draft(len(keep)) and self.drafter.ready_to_draft():
            return []
        # a drafting bucket whose drafter is behind with its indexing launches its plain steps ahead
        # too: they would not draft either (_run_decode), and each one not launched ahead left the GPU
        # idle while the host worked (H200, 0.5B, ShareGPT second turns at 32: the first 20 steps of
        # a run, 1.55-1.77 ms each against ~1.2 launched ahead, while 32 new prompts were indexed)
        return keep

    def _plain_step_ahead(self, reqs: list[Req]) -> bool:
        """Whether a plain step for exactly these requests is already on the GPU."""
        return self.overlap is not None and self.overlap.holds_step_for(reqs)

    def _drop_ahead(self) -> None:
        if self.overlap is not None:
            self.overlap.drop()
        if self.draft_ahead is not None:
            self.draft_ahead.drop()

    def _no_drafts(self, reqs: list[Req]) -> tuple[TreeProposal, list[int]]:
        return TreeProposal.root_only(self._last_tokens(reqs)), [1] * len(reqs)

    @staticmethod
    def _last_tokens(reqs: list[Req]) -> list[int]:
        return [r.last_token for r in reqs]

    # --- commit ---
    def _commit_kv(self, reqs: list[Req], outcome: StepOutcome, node_slots, num_nodes) -> None:
        commit_accepted_kv(self.scheduler, reqs, outcome, node_slots, num_nodes)
        if self.drafter is not None:
            self.spec_counters.count_verified(num_nodes, outcome.accept_lens)

    def _commit_verified(self, reqs: list[Req], sampled: SampledStep | StepOutcome,
                         defer_text: bool = False, plain: bool = False) -> list[StepOutput]:
        """A decode/verify step's commit (not a prefill's first token): its speculative stats too
        (a `plain` step's, one token a request, without a look at each: SpecStats)."""
        if self.drafter is not None:
            if not plain:
                SpecStats.record_step(reqs, sampled.tokens)
            self.spec_counters.count_commit(len(reqs), len(reqs) if plain else sum(map(len, sampled.tokens)))
        return [self._commit(req, sampled, i, defer_text) for i, req in enumerate(reqs)]

    def _commit(self, req: Req, sampled: SampledStep | StepOutcome, index: int,
                defer_text: bool = False) -> StepOutput:
        """Appends the request's committed tokens (its KV slots were committed before) and
        checks for its end (the caller shows them to the drafter and the policy).
        `defer_text`: detokenizing waits for the next step's GPU time (commit.py)."""
        tokens = sampled.tokens[index]
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        text = self.text if defer_text and can_defer_text(req) else None
        if text is not None and sampled.logprobs is None and req.grammar is None and not ends_within(req, tokens):
            req.output_ids.extend(tokens)   # no token ends it: no per-token checks
            text.defer(req, tokens)
            new_tokens = tokens
        else:
            new_tokens = self._commit_tokens(req, sampled, index, text)
        self.stats.count_tokens(len(new_tokens))
        return StepOutput(req=req, new_token_ids=new_tokens, finished=req.finished)

    def _observe(self, outputs: list[StepOutput]) -> list[StepOutput]:
        """Shows a step's committed tokens to the policy and the drafter, one call each for the
        batch: on every plain step (no shadow walk pending, one token each) calls per request
        and the accept-length stats cost ~41 us at batch 64 on a CPU core, ~35 us batched. A
        finished request's state is gone already. Returns the outputs."""
        if self.drafter is not None:
            reqs, committed = unfinished(outputs)
            if self.adaptive is not None and self.adaptive.walking:   # no rid list on the other steps
                self.adaptive.observe_batch([req.rid for req in reqs], committed)
            self.drafter.observe_batch(reqs, committed)
        return outputs

    def _commit_tokens(self, req: Req, sampled: SampledStep | StepOutcome, index: int, text: DeferredText | None) -> list[int]:
        """The tokens one by one, up to the one that ends the request."""
        new_tokens = []
        for position, token in enumerate(sampled.tokens[index]):
            new_tokens.append(token)
            req.output_ids.append(token)
            if sampled.logprobs is not None and req.return_logprob:
                req.output_logprobs.append(sampled.logprobs[index][position])
                if sampled.top_logprobs is not None:
                    req.output_top_logprobs.append(sampled.top_logprobs[index][position])
            reason = finish_reason(req, token, text)
            if req.grammar is not None:
                reason = grammar_finish(req, token, reason)
            if reason is not None:
                self._finish(req, reason)
                break
        return new_tokens

    def _finish(self, req: Req, reason: dict) -> None:
        self.text.drain(req)
        if reason["type"] != "stop" or not isinstance(reason.get("matched"), str):
            req.detokenizer.flush()
        self.scheduler.finish(req, reason)
        self.requests.pop(req.rid, None)
        self._release_draft_state(req)

    def _preempted(self, req: Req) -> None:
        self._settle()   # the drafter saw the request's last tokens first
        if self.drafter is not None:
            self.drafter.preempted(req)   # e.g. a draft model's KV, rebuilt when the request resumes

    def _release_draft_state(self, req: Req) -> None:
        if self.drafter is not None:
            self.drafter.release(req)
        if self.adaptive is not None:
            self.adaptive.release(req.rid)


def _committed(outputs: list[StepOutput]) -> int:
    return sum(len(out.new_token_ids) for out in outputs)


def _split(items: list[int], counts: list[int]) -> list[list[int]]:
    """items cut into consecutive runs of the given lengths."""
    runs, offset = [], 0
    for count in counts:
        runs.append(items[offset:offset + count])
        offset += count
    return runs
