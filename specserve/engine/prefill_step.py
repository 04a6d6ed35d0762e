"""PrefillStep: a prompt chunk per request into the KV cache, and the first token of each
request whose prompt it ends. While the GPU runs the forward, the host runs the last plain
step's put-off bookkeeping, the deferred text and the drafter's background work."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specserve.engine.step_output import StepOutput
from specserve.engine.step_parts import StepPipeline
from specserve.request.req import Batch, Req
from specserve.sampling.sampler import SampledStep
from specserve.speculative.drafter import ReadsHiddenStates


@dataclass
class LaunchedPrefill:
    batch: Batch
    slots: list[int]      # the chunks' KV slots, request after request
    starts: list[int]     # each request's first position in the chunk
    logits: Any           # the forward's, at the last token of each chunk that ends a prompt
    capture: Any          # every token's hidden state, where the runner keeps them


class PrefillStep(StepPipeline):
    def launch(self, batch: Batch, started: float) -> LaunchedPrefill:
        slots = self.scheduler.alloc_slots(sum(batch.extend_lens))
        assert slots is not None, "the scheduler reserves the cache a prefill needs"
        capture = self.runner.hidden_capture.fresh() if self.runner.hidden_capture is not None else None
        starts = [req.kv_len for req in batch.reqs]
        try:
            logits = self.runner.extend(batch.reqs, batch.extend_lens, slots, batch.samples, capture)
            self.ahead.settle()   # the last plain step's bookkeeping, while the GPU runs the prefill
            self.text.run()
            if self.planner.drafter is not None:
                self.planner.drafter.flush()  # e.g. new prompts indexed in the background
        except BaseException:
            self.scheduler.free_slots(slots)  # no request holds them yet
            raise
        self.events.launched("prefill")
        return LaunchedPrefill(batch, slots, starts, logits, capture)

    def read(self, step: LaunchedPrefill) -> tuple[list[Req], SampledStep | None]:
        """The chunks' KV slots become their requests'; every token's state goes to the
        drafter; the first token of each request whose prompt ends here is sampled."""
        batch = step.batch
        self.scheduler.append_kv(batch.reqs, split(step.slots, batch.extend_lens))
        if step.capture is not None and isinstance(self.planner.drafter, ReadsHiddenStates):   # every token's state, request after request
            self.planner.drafter.observe_hidden(batch.reqs, step.starts, step.capture.features(), split(
                list(range(sum(batch.extend_lens))), batch.extend_lens))
        sampling = [req for req, samples in zip(batch.reqs, batch.samples) if samples]
        if not sampling:
            return sampling, None
        self.planner.admit()   # they decode from the next step: a probe looks at them first
        return sampling, self.sampler.first_tokens(step.logits, sampling)

    def commit(self, step: LaunchedPrefill, first: tuple[list[Req], SampledStep | None]) -> list[StepOutput]:
        sampling, sampled = first
        if not sampling:
            return []
        return self.planner.observe([self.committer.one(req, sampled, i) for i, req in enumerate(sampling)])


def split(items: list[int], counts: list[int]) -> list[list[int]]:
    """items cut into consecutive runs of the given lengths."""
    runs, offset = [], 0
    for count in counts:
        runs.append(items[offset:offset + count])
        offset += count
    return runs
