"""The overlap schedule: plain greedy decode steps run one step ahead.

Step N+1 is queued on the GPU before step N's tokens are read: its roots are step N's
argmax, copied on the device, and its KV slots are allocated before step N commits. Each
decode step writes its own slot into req_to_token on the device (tree_step.write_decode_slots),
so step N+1 finds step N's entry there and no commit writes the table again. While
the GPU runs step N+1, the host commits step N (stop checks, detokenizing, streaming) and
schedules the next step, so a batch-1 decode step costs its GPU time and nothing more.

A request that ends with step N (its length, known before the launch) gets no row in step
N+1, whose roots are then the other requests' argmax, gathered on the device. One that a
stop token ends (seen only when step N is read) keeps its row in step N+1, which is cut
when that step is read: its slot freed, its token never read. Otherwise a request ending
every other step at 64 (128-token answers) broke the chain on ~40% of the steps, each then
paying its host time in full. A step launched ahead for a batch that changes otherwise (a
request arrived, was preempted or aborted) is dropped: its slots are freed and its output
ignored. Only steps
that need nothing but the argmax qualify (greedy, no penalties, logprobs or min_new_tokens
still in force): every other sampling option depends on tokens the host has not seen yet.
Requests under a grammar qualify too: their step's argmax is taken under their masks
(grammar/next_masks.py): filled on threads from the previous step's commit (`after_commit`)
until the next engine step begins (`finish_masks`), then queued behind the forward; for a step
launched with the batch's last tokens, before its argmax is first needed.
Where the runner keeps hidden states (an EAGLE head or MTP layer drafts), each step keeps a
copy of its own, made on the device before the next step's replay overwrites the graph's
output: the engine hands them to the drafter when it reads the step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specserve.engine.scheduler import Scheduler
from specserve.grammar.next_masks import MaskedArgmax
from specserve.request.req import Batch, Req, ReqState, same_requests
from specserve.runner.model_runner import InFlight, ModelRunner


@dataclass
class StepAhead:
    """A launched decode step whose tokens the host has not read yet."""
    reqs: list[Req]
    slots: list[int]          # one new KV slot per request, not yet committed to it
    launched: InFlight        # its argmax: on the device, and on the way to the host
    hidden: torch.Tensor | None = None   # (bs, features) the target states the runner keeps (an EAGLE head's)
    rows: list[int] | None = None   # each request's row of the launch, once rows of ended requests were cut
    logits: torch.Tensor | None = None   # (bs, vocab) while its grammar masks are still to be applied
    masking: MaskedArgmax | None = None  # its grammar masks, being filled on threads

    def constrain(self) -> None:
        """Its argmax taken again under its requests' grammar masks, the matchers advanced past
        every token committed before this step (a request that ended meanwhile allows all):
        the masks are filled on threads until `finish_masks`."""
        assert self.rows is None, "a step is constrained before its rows are cut"
        self.masking = MaskedArgmax(self.logits, [r.grammar for r in self.reqs])
        self.logits = None

    def finish_masks(self) -> None:
        """Its masked argmax queued once its masks are filled; the matchers are free again.
        Where the fill raised, the step's argmax is not under the masks: it is to be released."""
        masking, self.masking = self.masking, None
        if masking is not None:
            self.launched = InFlight.launch(masking.result())

    def tokens(self) -> list[int]:
        """Its requests' argmax, once the step is done."""
        assert self.logits is None, "a step under a grammar is read once its masks are applied"
        self.finish_masks()
        tokens = self.launched.wait().tolist()
        return tokens if self.rows is None else [tokens[row] for row in self.rows]

    def hidden_rows(self) -> list[list[int]]:
        """Each request's row of `hidden`."""
        return [[row] for row in (self.rows if self.rows is not None else range(len(self.reqs)))]

    def roots(self, keep: list[int]) -> torch.Tensor:
        """The argmax of requests `keep` (indices into reqs), on the device: the next step's roots."""
        self.finish_masks()
        argmax = self.launched.device
        if self.rows is None and len(keep) == argmax.shape[0]:   # keep is ascending: every row, in order
            return argmax
        rows = keep if self.rows is None else [self.rows[i] for i in keep]
        # a pinned index copied without waiting: a pageable one would wait for the step in flight
        index = torch.tensor(rows, dtype=torch.long, pin_memory=argmax.is_cuda)
        return argmax.index_select(0, index.to(argmax.device, non_blocking=True))


class OverlapSchedule:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler):
        self.runner, self.scheduler = runner, scheduler
        self.ahead: StepAhead | None = None

    def current_step(self, reqs: list[Req], last_tokens: Callable[[], list[int]]) -> StepAhead:
        """The step to read now: the one launched ahead for exactly these requests, or a
        new launch rooted at their last tokens."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            self._cut_ended(ahead)
        if ahead is not None and same_requests(ahead.reqs, reqs):
            return ahead
        self.release(ahead)
        slots = self.scheduler.alloc_slots(len(reqs))
        assert slots is not None, "the scheduler reserves a slot per decoding request"
        return self._launch(reqs, [r.kv_len for r in reqs], slots, last_tokens(), constrain_now=True)

    def holds_step_for(self, reqs: list[Req]) -> bool:
        """Whether the step launched ahead is for exactly these requests (those a stop token
        ended since aside): current_step would read it."""
        ahead = self.ahead
        return ahead is not None and same_requests([r for r in ahead.reqs if not r.finished], reqs)

    def launch_next(self, current: StepAhead, keep: list[int]) -> None:
        """Queues the step after `current` (whose tokens are not committed yet) for its
        requests `keep` (indices: those that do not end with `current`)."""
        reqs = [current.reqs[i] for i in keep]
        slots = self.scheduler.alloc_slots(len(reqs))
        if slots is None:
            return
        self.ahead = self._launch(reqs, [r.kv_len + 1 for r in reqs], slots, current.roots(keep), constrain_now=False)

    def after_commit(self) -> None:
        """Once the step before the one launched ahead is committed: where a stop token (or a
        grammar's end) ended every request of the step ahead, it is dropped, so an idle engine
        holds no slot for it; otherwise its grammar masks are started, if any: filled on
        threads while the host publishes this step's outputs and comes back to the next step
        (finish_masks)."""
        ahead = self.ahead
        if ahead is None:
            return
        if all(r.finished for r in ahead.reqs):
            self.drop()
        elif ahead.logits is not None:
            ahead.constrain()

    def finish_masks(self) -> None:
        """The step ahead's masked argmax queued, once its masks are filled: called as the next
        engine step begins, before anything there may touch the matchers (a drafting step's
        tree masks, a commit's accepts) and before that step's launch needs the argmax."""
        if self.ahead is None:
            return
        try:
            self.ahead.finish_masks()
        except BaseException:
            self.drop()   # its argmax is not under the masks: never to be read
            raise

    def _cut_ended(self, step: StepAhead) -> None:
        """Cuts the rows of requests that a stop token ended after `step` was launched: their
        slots freed (no request holds them), their tokens never read."""
        live = [i for i, r in enumerate(step.reqs) if not r.finished]
        if len(live) == len(step.reqs):
            return
        kept = set(live)
        self.scheduler.free_slots([slot for i, slot in enumerate(step.slots) if i not in kept])
        step.rows = live if step.rows is None else [step.rows[i] for i in live]
        step.reqs, step.slots = [step.reqs[i] for i in live], [step.slots[i] for i in live]

    def _launch(self, reqs: list[Req], kv_lens: list[int], slots: list[int], roots, constrain_now: bool) -> StepAhead:
        """constrain_now: the matchers have seen every token before this step (its roots are on
        the host), so its grammar masks apply at once; else they wait for after_commit."""
        launched, hidden, logits = self.runner.launch_greedy_decode(reqs, kv_lens, slots, roots)
        step = StepAhead(list(reqs), slots, launched, hidden=hidden)
        if any(r.grammar is not None for r in reqs):
            step.logits = logits
            if constrain_now:
                step.constrain()
        return step

    def keep_through(self, batch: Batch) -> StepAhead | None:
        """The step launched ahead, taken out to be read after `batch` (a prefill the scheduler
        chose instead of the next decode step) where its tokens still count: every one of its
        requests still runs, with its row, and none is in the batch (a mixed chunk's decode
        rows). Otherwise None, and drop() frees it as before. Its GPU work is done by the time
        the prefill is: dropping it threw away a decode step of the running batch for every
        request that arrived while others decoded (a server's steady state)."""
        ahead = self.ahead
        if ahead is None or self.scheduler.focus is not None:
            return None
        self._cut_ended(ahead)
        running, batched = {id(r) for r in self.scheduler.running}, {id(r) for r in batch.reqs}
        if not ahead.reqs or any(r.state is not ReqState.RUNNING or r.row is None or id(r) not in running
                                 or id(r) in batched for r in ahead.reqs):
            return None
        self.ahead = None
        return ahead

    def drop(self) -> None:
        """Forgets the step launched ahead, if any."""
        ahead, self.ahead = self.ahead, None
        self.release(ahead)

    def release(self, step: StepAhead | None) -> None:
        """Frees a step's slots (no request holds them before its commit), once its masks, if
        any, are filled (their threads use the matchers)."""
        if step is None:
            return
        masking, step.masking = step.masking, None
        try:
            if masking is not None:
                masking.wait()   # it returns once every thread is done, also where one raised
        finally:
            self.scheduler.free_slots(step.slots)
