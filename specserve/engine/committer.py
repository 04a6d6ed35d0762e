"""Committer: a step's outcome made the requests' own: the KV slots of their accepted nodes,
their committed tokens (stop checks, logprobs, text) and, for a request that ends, its end."""
from __future__ import annotations

import time

from specserve.engine.commit import DeferredText, StepOutcome, can_defer_text, commit_accepted_kv, ends_within, \
    finish_reason
from specserve.engine.draft_planner import DraftPlanner
from specserve.engine.scheduler import Scheduler
from specserve.engine.stats import SpecCounters, StepLogger
from specserve.engine.step_output import StepOutput
from specserve.grammar.finish import grammar_finish
from specserve.request.req import Req, SpecStats
from specserve.sampling.sampler import SampledStep


class Committer:
    def __init__(self, scheduler: Scheduler, planner: DraftPlanner, text: DeferredText, stats: StepLogger,
                 requests: dict[str, Req]):
        self.scheduler, self.planner, self.text, self.stats = scheduler, planner, text, stats
        self.requests = requests   # the engine's running requests by id: a finished one leaves it
        self.spec_counters = SpecCounters()

    @property
    def speculative(self) -> bool:
        return self.planner.drafter is not None

    def kv(self, reqs: list[Req], outcome: StepOutcome, node_slots, num_nodes) -> None:
        """Each request keeps its accepted nodes' KV slots; the others are freed (commit.py)."""
        commit_accepted_kv(self.scheduler, reqs, outcome, node_slots, num_nodes)
        if self.speculative:
            self.spec_counters.count_verified(num_nodes, outcome.accept_lens)

    def verified(self, reqs: list[Req], sampled: SampledStep | StepOutcome, defer_text: bool = False,
                 plain: bool = False) -> list[StepOutput]:
        """A decode/verify step's commit (not a prefill's first token): its speculative stats too
        (a `plain` step's, one token a request, without a look at each: SpecStats)."""
        if self.speculative:
            if not plain:
                SpecStats.record_step(reqs, sampled.tokens)
            self.spec_counters.count_commit(len(reqs), len(reqs) if plain else sum(map(len, sampled.tokens)))
        return [self.one(req, sampled, i, defer_text) for i, req in enumerate(reqs)]

    def one(self, req: Req, sampled: SampledStep | StepOutcome, index: int, defer_text: bool = False) -> StepOutput:
        """Appends the request's committed tokens (its KV slots were committed before) and
        checks for its end (the caller shows them to the drafter and the policy).
        `defer_text`: detokenizing waits for the next step's GPU time (commit.py)."""
        tokens = sampled.tokens[index]
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        text = self.text if defer_text and can_defer_text(req) else None
        # no token ends it (nor its grammar, whose matcher took them as the step was read): no per-token checks
        if (text is not None and sampled.logprobs is None and not ends_within(req, tokens)
                and (req.grammar is None or req.grammar.confirm_ahead(tokens))):
            req.output_ids.extend(tokens)
            text.defer(req, tokens)
            new_tokens = tokens
        else:
            new_tokens = self._tokens(req, sampled, index, text)
        self.stats.count_tokens(len(new_tokens))
        return StepOutput(req=req, new_token_ids=new_tokens, finished=req.finished)

    def _tokens(self, req: Req, sampled: SampledStep | StepOutcome, index: int, text: DeferredText | None) -> list[int]:
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
                self.finish(req, reason)
                break
        return new_tokens

    def finish(self, req: Req, reason: dict) -> None:
        self.text.drain(req)
        if reason["type"] != "stop" or not isinstance(reason.get("matched"), str):
            req.detokenizer.flush()
        parked = self.scheduler.finish(req, reason)
        self.requests.pop(req.rid, None)
        if not parked:   # else once it is released (ParkedRequests.listeners)
            self.planner.release(req)
