"""PrefillStep: a prompt chunk per request into the KV cache, and the first token of each
request whose prompt it ends. While the GPU runs the forward, the host hands a head the
prompts' states and runs the last plain step's put-off bookkeeping, the deferred text and the
drafter's background work."""
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


class PrefillStep(StepPipeline):
    def launch(self, batch: Batch, started: float) -> LaunchedPrefill:
        slots = self.scheduler.alloc_slots(sum(batch.extend_lens))
        assert slots is not None, "the scheduler reserves the cache a prefill needs"
        capture = self.runner.hidden_capture.fresh() if self.runner.hidden_capture is not None else None
        starts = [req.kv_len for req in batch.reqs]
        try:
            logits = self.runner.extend(batch.reqs, batch.extend_lens, slots, batch.samples, capture)
            self._hand_over_states(batch, starts, capture)
            self.ahead.settle()   # the last plain step's bookkeeping, while the GPU runs the prefill
            self.text.run()
            if self.planner.drafter is not None:
                self.planner.drafter.flush()  # e.g. new prompts indexed in the background
        except BaseException:
            self.scheduler.free_slots(slots)  # no request holds them yet
            raise
        self.events.launched("prefill")
        return LaunchedPrefill(batch, slots, starts, logits)

    def _hand_over_states(self, batch: Batch, starts: list[int], capture) -> None:
        """Every token's state (request after request) to a drafter that reads them, and the
        prompts whose states are now complete to its head at once: its forward over them is
        queued behind the prefill, whose device time hides the host's launches. Fed at the
        first drafting step instead, they were an eager forward and a host sync of their own
        (H100, 1.5B, EAGLE-3 at 32 requests: the first drafts' proposals 73.5 -> 25.8 ms of
        host time a run, 17 admissions; BENCHMARKS.md has what it did to tok/s)."""
        drafter = self.planner.drafter
        if capture is None or not isinstance(drafter, ReadsHiddenStates):
            return
        drafter.observe_hidden(batch.reqs, starts, capture.features(),
                               split(list(range(sum(batch.extend_lens))), batch.extend_lens))
        drafter.prefilled(batch.reqs)

    def read(self, step: LaunchedPrefill) -> tuple[list[Req], SampledStep | None]:
        """The chunks' KV slots become their requests'; the first token of each request whose
        prompt ends here is sampled."""
        batch = step.batch
        self.scheduler.append_kv(batch.reqs, split(step.slots, batch.extend_lens))
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
