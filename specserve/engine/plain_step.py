"""PlainStep: plain greedy decode steps on the overlap schedule (overlap.py says how).

Each step is read from the launch ahead (or launched now), and the step after it is
launched before its tokens are read; while the GPU runs both, the host runs the last
step's put-off bookkeeping, the deferred text and, before a probe, the drafter's indexing.
Its own bookkeeping (the tokens shown to the drafter and the policy, its probe and price)
is put off in turn while a drafter runs and more work is queued (`AfterPlainStep`): the
drafter's observe, the policy's and its probe cost ~0.1-0.2 ms of host time a step at 32-64
requests on an H200's host (0.5B, 1.5B), and between reading this step and launching the
one after next that time is the GPU's, wherever the host is behind (the steps that probe).

Plain steps also run inside a drafting episode where the drafter has nothing to propose (a
batch that runs dry: a greedy drafting step whose proposal held roots alone launches a plain
step ahead instead, drafting_step.py). Once that first step's token is committed, and the
drafter still proposes nothing, the next step is launched, and from it on the stretch runs on
the overlap schedule: each step launches the next one ahead while the proposals stay empty,
so a stretch without drafts costs what plain decoding does.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from specserve.engine.overlap import StepAhead
from specserve.engine.step_output import StepOutput
from specserve.engine.step_parts import StepPipeline
from specserve.request.req import Batch, Req
from specserve.sampling.sampler import SampledStep
from specserve.speculative.drafter import ReadsHiddenStates


@dataclass
class LaunchedPlain:
    current: StepAhead       # the step read now
    probing: bool            # it probes after its commit
    was_ahead: bool          # it was launched ahead (as plain mode runs its steps)
    started: float


@dataclass
class AfterPlainStep:
    """A plain step's tokens shown to the drafter and the policy, its probe and its price
    (`seconds`: measured when it was put off)."""
    pipeline: PlainStep
    reqs: list[Req]
    outputs: list[StepOutput]
    probing: bool
    was_ahead: bool
    started: float
    seconds: float | None = None

    def run(self) -> None:
        self.pipeline.after_step(self)


class PlainStep(StepPipeline):
    def launch(self, batch: Batch, started: float) -> LaunchedPlain:
        """This step (from the launch ahead, or launched now) and, for the requests it does not
        end, the next one; then the host work the GPU hides. A probe's host time hides behind
        the step launched ahead; a step that launches none (the next one drafts, or every
        request ends in this one) leaves its probe to the next plain step."""
        reqs, overlap = batch.reqs, self.ahead.plain
        launched_ahead, current = overlap.ahead, None
        try:
            current = overlap.current_step(reqs, lambda: [r.last_token for r in reqs])
            self.events.launched("plain", 1, current is launched_ahead)
            keep = self._next_rows(reqs, current)
            if keep:
                overlap.launch_next(current, reqs, keep)
            self.ahead.settle()   # the last plain step's after-work, while the GPU runs this one and the next
            probing = bool(keep) and self.planner.probe_due(reqs)
            self.text.run()   # a drafting step's, before this step's tokens reach the detokenizers
            if probing:
                self.planner.drafter.flush()  # what the probe proposes from, indexed in the background meanwhile
        except BaseException:
            self._fail(current)
            raise
        return LaunchedPlain(current, probing, current is launched_ahead, started)

    def read(self, step: LaunchedPlain) -> list[int]:
        try:
            return self.ahead.plain.read(step.current)
        except BaseException:
            self._fail(step.current)
            raise

    def commit(self, step: LaunchedPlain, tokens: list[int]) -> list[StepOutput]:
        """A request a stop token ended here keeps its row in the step ahead, cut when that
        is read. The bookkeeping is put off to the next launch while a drafter runs and the
        scheduler has work (with nothing in flight the next launch is a prefill as a rule)."""
        reqs = step.current.reqs
        outputs = self._commit_tokens(step.current, tokens)
        self.ahead.plain.after_commit()   # the step ahead dropped where its requests all ended here
        if step.current.opens_dry_stretch and self.ahead.plain.ahead is None:
            self._go_on_dry(reqs, outputs)
        probing = step.probing
        if probing and self.ahead.plain.ahead is None:   # the launch found no slots: nothing in flight
            self.planner.put_off_probe(reqs)
            probing = False
        after = AfterPlainStep(self, reqs, outputs, probing, step.was_ahead, step.started)
        if self.planner.drafter is not None and self.scheduler.has_work():
            after.seconds = time.perf_counter() - step.started
            self.ahead.after_plain = after
        else:
            after.run()
        return outputs

    def after_step(self, after: AfterPlainStep) -> None:
        self.planner.observe(after.outputs)
        if self.planner.adaptive is None:
            return
        if after.probing:
            self.planner.probe(after.reqs)  # while the GPU runs the step launched ahead
        # plain decoding is priced by the steps plain mode runs: launched ahead, no probe
        steady = after.was_ahead and not self.planner.rare_probe(after.reqs, after.probing)
        seconds = time.perf_counter() - after.started if after.seconds is None else after.seconds
        self.planner.record_step(len(after.reqs), 1, seconds, len(after.outputs), steady)   # a token each

    # --- the step launched ahead that a prefill came after ---
    def keep_through(self, batch: Batch | None):
        """The step launched ahead, taken out to be read after `batch` if that is a prefill
        that leaves its requests running (OverlapSchedule.keep_through); else None."""
        overlap = self.ahead.plain
        if overlap is None or batch is None or not batch.is_extend:
            return None
        return overlap.keep_through(batch)

    def commit_kept(self, kept: StepAhead) -> list[StepOutput]:
        """That step, read once the prefill is launched (its GPU work came first): its tokens
        are shown to the drafter and the policy, not priced (its time is the prefill's too)."""
        try:
            tokens = self.ahead.plain.read(kept)
        except BaseException:
            self.release(kept)
            raise
        return self.planner.observe(self._commit_tokens(kept, tokens))

    def release(self, step: StepAhead | None) -> None:
        if step is not None:
            self.ahead.plain.release(step)

    def _commit_tokens(self, step: StepAhead, tokens: list[int]) -> list[StepOutput]:
        """A plain step's tokens, read: its KV slots (in the table already: the step wrote
        them), its hidden states to the drafter (a head's, fed when it drafts again), its commit."""
        reqs = step.reqs
        if step.hidden is not None and isinstance(self.planner.drafter, ReadsHiddenStates):
            # the runner copied them out of the decode graph (launch_greedy_decode): no second copy
            self.planner.drafter.observe_hidden(reqs, [r.kv_len for r in reqs], step.hidden, step.hidden_rows(), owned=True)
        self.scheduler.append_kv(reqs, [[slot] for slot in step.slots], write_table=False)
        # detokenized after the next launch (DeferredText): at 64 requests ~0.2-0.3 ms of host
        # time a step that otherwise sits between reading this step and launching the one after next
        return self.committer.verified(reqs, SampledStep.plain(tokens), defer_text=True, plain=True)

    def _next_rows(self, reqs: list[Req], current: StepAhead) -> list[int]:
        """The requests (indices) whose next step can be launched before this one's tokens are
        read: those this step does not end by length or context, and those without a row in it
        (a grammar forbade the token their row of it was launched on: overlap.py) that the
        context leaves room; none where that step would draft (it would not where the drafter
        has nothing to propose: `_runs_dry`)."""
        context, in_step = self.runner.context_length, {id(r) for r in current.reqs}

        def runs_on(r: Req) -> bool:
            if id(r) in in_step:
                return len(r.output_ids) + 1 < r.max_new_tokens and r.kv_len + 2 <= context
            return r.kv_len + 1 <= context
        keep = [i for i, r in enumerate(reqs) if runs_on(r)]
        if not keep or self.planner.plain_rows_may_run_ahead(len(keep)):
            return keep
        if current.opens_dry_stretch:   # its token may start a match: the stretch goes on from its commit
            return []
        return keep if self._runs_dry([reqs[i] for i in keep]) else []

    def _runs_dry(self, reqs: list[Req]) -> bool:
        """Whether the drafter proposes nothing for these requests (DraftPlanner.runs_dry), asked
        with the tokens committed so far while the GPU runs this step: the last plain step's
        tokens are shown to the drafter first. A stretch ends a step late where this step's token
        starts a match: the plain step launched ahead commits one token, then drafting resumes."""
        if not self.planner.drafter.proposes_cheaply:
            return False
        self.ahead.settle()
        return self.planner.runs_dry(reqs)

    def _go_on_dry(self, reqs: list[Req], outputs: list[StepOutput]) -> None:
        """After the first step of a dry stretch: where the drafter, shown its token, still has
        nothing to propose for the batch, and the batch decodes on, the next plain step is
        launched now, and the steps after it ahead (`_next_rows`). Waiting for the first step's
        token keeps the stretch of a one-token mismatch (a copied answer that differs in a word)
        from delaying its drafts a step; longer stretches run on the overlap schedule from their
        third token."""
        drafting = self.ahead.drafting
        context = self.runner.context_length
        if (any(out.finished for out in outputs) or drafting is None or not drafting.batch_is_next(reqs)
                or any(r.kv_len + 1 > context for r in reqs) or self.planner.plain_rows_may_run_ahead(len(reqs))
                or not self._runs_dry(reqs)):
            return
        self.ahead.plain.launch_ahead(reqs)

    def _fail(self, current: StepAhead | None) -> None:
        self.ahead.plain.release(current)
        self.ahead.plain.drop()
