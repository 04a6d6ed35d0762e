"""The overlap schedule: plain decode steps run one step ahead.

Step N+1 is queued on the GPU before step N's tokens are read: its roots are step N's
argmax, copied on the device, and its KV slots are allocated before step N commits. Sampled
steps too, where their tokens come from the step's logits alone (temperature, top-k, top-p,
min-p and a seed: Sampler.samples_on_device): they are sampled on the device (sample_plain:
the random numbers are keyed by seed and position, so a step launched ahead samples what it
would after the read), and those tokens root the next step. Each
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
that need nothing but the argmax or such sampling qualify (no penalties, logprobs or
min_new_tokens still in force): every other option depends on tokens the host has not seen yet.
Requests under a grammar qualify too, greedy ones (sampling ones take the sampler's masked
path): their steps are launched on the previous step's unmasked argmax like any other, no
mask filled before the launch (filled first, at 64 requests the fill, ~1 ms a step on an H200's
host, was on the critical path). As a step is read, each constrained request's token is checked
by its matcher (grammar/next_masks.py); where the grammar forbids one, its masked argmax, from
the step's logits (kept: the next launch overwrites a graph's), is committed instead, and the
request's row of the step launched ahead on the forbidden token is cut (`read`): the request
waits a step, launched with the next one at its committed token, while the others run on.
Where the runner keeps hidden states (an EAGLE head or MTP layer drafts), each step keeps a
copy of its own, made on the device before the next step's replay overwrites the graph's
output: the engine hands them to the drafter when it reads the step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specserve.engine.scheduler import Scheduler
from specserve.grammar.next_masks import keep_plain_to_grammar
from specserve.request.req import Batch, Req, ReqState, same_requests
from specserve.runner.model_runner import InFlight, ModelRunner
from specserve.runner.side_stream import beside
from specserve.runner.stream_events import record
from specserve.sampling.sampler import Sampler


@dataclass
class StepAhead:
    """A launched decode step whose tokens the host has not read yet."""
    reqs: list[Req]
    slots: list[int]          # one new KV slot per request, not yet committed to it
    launched: InFlight        # its argmax: on the device, and on the way to the host
    hidden: torch.Tensor | None = None   # (bs, features) the target states the runner keeps (an EAGLE head's)
    rows: list[int] | None = None   # each request's row of the launch, once rows of ended requests were cut
    logits: torch.Tensor | None = None   # (bs, vocab) a copy of its logits, where a request has a grammar
    logits_copied: torch.cuda.Event | None = None   # fired once that copy is made (on a GPU)
    # the first step of a batch that runs dry (plain_step.py): the step after it waits for its token
    opens_dry_stretch: bool = False

    def tokens(self) -> list[int]:
        """Its requests' argmax, once the step is done: unmasked (to_grammar makes it the masked one)."""
        tokens = self.launched.wait().tolist()
        return tokens if self.rows is None else [tokens[row] for row in self.rows]

    def to_grammar(self, tokens: list[int]) -> list[int]:
        """Makes `tokens` (from `tokens()`) the argmax under each request's grammar, in place.
        Returns the requests (indices) whose grammar forbade their unmasked argmax: the next
        step's rows launched on those are wrong. Only then are the logits read (their masked
        argmax), on a side stream: the read waits for this step's logits, not for the step
        launched ahead, so the GPU runs on while the host picks and launches the next one."""
        if self.logits is None:
            return []
        # only the strays' rows are gathered (a step with rows cut gathered all of them each
        # step: 64 x 151k fp32 logits, ~39 MB, beside the step queued after it)
        with beside(self.logits_copied):
            return keep_plain_to_grammar([r.grammar for r in self.reqs], tokens,
                                         lambda strays: self.logits[self._launch_rows(strays)])

    def _launch_rows(self, indices: list[int]) -> list[int]:
        """The rows of the launch that requests `indices` (into reqs) hold."""
        return indices if self.rows is None else [self.rows[i] for i in indices]

    def hidden_rows(self) -> list[list[int]]:
        """Each request's row of `hidden`."""
        return [[row] for row in self._launch_rows(list(range(len(self.reqs))))]

    def roots(self, keep: list[int]) -> torch.Tensor:
        """The unmasked argmax of requests `keep` (indices into reqs), on the device: the next step's roots."""
        argmax = self.launched.device
        if self.rows is None and len(keep) == argmax.shape[0]:   # keep is ascending: every row, in order
            return argmax
        rows = self._launch_rows(keep)
        # a pinned index copied without waiting: a pageable one would wait for the step in flight
        index = torch.tensor(rows, dtype=torch.long, pin_memory=argmax.is_cuda)
        return argmax.index_select(0, index.to(argmax.device, non_blocking=True))


class OverlapSchedule:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, sampler: Sampler | None = None):
        """sampler: samples the steps of sampled requests on the device (None: greedy steps only)."""
        self.runner, self.scheduler, self.sampler = runner, scheduler, sampler
        self.ahead: StepAhead | None = None
        # requests whose row of the step ahead was cut, as a grammar forbade the token it was
        # launched on: they have no step in flight, and join the next launch at their last token
        self.waiting: set[int] = set()   # their ids
        self.relaunches = 0   # such rows cut, all told

    def serves(self, reqs: list[Req]) -> bool:
        """Whether these requests' plain steps run on this schedule: greedy ones that need the
        argmax alone (under a grammar's mask, if any), or, with a sampler, ones whose tokens
        are sampled from the logits alone (Sampler.samples_on_device)."""
        return Sampler.masked_argmax_is_enough(reqs) or (self.sampler is not None and Sampler.samples_on_device(reqs))

    def current_step(self, reqs: list[Req], last_tokens: Callable[[], list[int]]) -> StepAhead:
        """The step to read now: the one launched ahead for exactly these requests (but those
        waiting: `read`), or a new launch rooted at their last tokens."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            self._cut_ended(ahead)
        if ahead is not None and self._serves(ahead, reqs):
            return ahead
        self.release(ahead)
        slots = self.scheduler.alloc_slots(len(reqs))
        assert slots is not None, "the scheduler reserves a slot per decoding request"
        return self._launch(reqs, [r.kv_len for r in reqs], slots, last_tokens())

    def launch_ahead(self, reqs: list[Req], opens_dry_stretch: bool = False) -> bool:
        """Queues a step for these requests at their last (committed) tokens as the step ahead,
        which the next plain step reads (the successor of a step whose batch has nothing to
        draft: plain_step.py). Returns False where no slots are left (nothing launched)."""
        self.drop()
        slots = self.scheduler.alloc_slots(len(reqs))
        if slots is None:
            return False
        self.ahead = self._launch(reqs, [r.kv_len for r in reqs], slots, [r.last_token for r in reqs])
        self.ahead.opens_dry_stretch = opens_dry_stretch
        return True

    def holds_step_for(self, reqs: list[Req]) -> bool:
        """Whether the step launched ahead is for exactly these requests (those a stop token
        ended since aside, those waiting aside): current_step would read it."""
        ahead = self.ahead
        return ahead is not None and same_requests([r for r in ahead.reqs if not r.finished],
                                                   [r for r in reqs if id(r) not in self.waiting])

    def _serves(self, ahead: StepAhead, reqs: list[Req]) -> bool:
        """Whether `ahead` is the step of these requests: all of them, in order, but those
        waiting (no step in flight: the next launch takes them)."""
        return bool(ahead.reqs) and same_requests(ahead.reqs, [r for r in reqs if id(r) not in self.waiting])

    def launch_next(self, current: StepAhead, batch: list[Req], keep: list[int]) -> None:
        """Queues the step after `current` (whose tokens are not committed yet) for the batch's
        requests `keep` (indices into batch, its order): current's that do not end with it,
        rooted at its argmax on the device, and any waiting, not in current, at their last tokens."""
        in_current = {id(r): i for i, r in enumerate(current.reqs)}
        reqs = [batch[i] for i in keep]
        slots = self.scheduler.alloc_slots(len(reqs))
        if slots is None:
            return
        rows = [in_current.get(id(r)) for r in reqs]
        kv_lens = [r.kv_len + (row is not None) for r, row in zip(reqs, rows)]
        self.ahead = self._launch(reqs, kv_lens, slots, self._roots(current, reqs, rows))

    @staticmethod
    def _roots(current: StepAhead, reqs: list[Req], rows: list[int | None]) -> torch.Tensor:
        """The next step's roots on the device: current's argmax at rows (indices into its
        reqs), the last token of a request waiting (row None), copied without waiting."""
        from_current = current.roots([row for row in rows if row is not None])
        waiting = [r.last_token for r, row in zip(reqs, rows) if row is None]
        if not waiting:
            return from_current
        device, pinned = from_current.device, from_current.is_cuda
        tokens = torch.tensor(waiting, dtype=from_current.dtype, pin_memory=pinned).to(device, non_blocking=True)
        order, n = [], 0   # each request's index into [from_current, tokens]
        for row in rows:
            order.append(n if row is not None else len(from_current) + len(order) - n)
            n += row is not None
        index = torch.tensor(order, dtype=torch.long, pin_memory=pinned).to(device, non_blocking=True)
        return torch.cat([from_current, tokens]).index_select(0, index)

    def read(self, step: StepAhead) -> list[int]:
        """The step's tokens, each under its request's grammar. Where a grammar forbade one, the
        request's row of the step launched ahead, if any, is cut (its slot freed): that step is
        `step`'s successor, rooted at its unmasked argmax (nothing else is launched between a
        step's launch and its read; a step kept through a prefill has none). The request then
        waits, its step launched with the next at the token committed, while the others' steps
        run on (a row that strays costs it one step, not the batch its overlap)."""
        tokens = step.tokens()
        changed = step.to_grammar(tokens)
        self.waiting = set()
        ahead = self.ahead
        if changed and ahead is not None:
            strayed = {id(step.reqs[i]) for i in changed}
            live = [i for i, r in enumerate(ahead.reqs) if id(r) not in strayed]
            self.relaunches += len(ahead.reqs) - len(live)
            self.waiting = {id(r) for r in ahead.reqs if id(r) in strayed}
            self._cut(ahead, live)
            if not ahead.reqs:
                self.drop()
        return tokens

    def after_commit(self) -> None:
        """Once the step before the one launched ahead is committed: where a stop token (or a
        grammar's end) ended every request of the step ahead, it is dropped, so an idle engine
        holds no slot for it."""
        ahead = self.ahead
        if ahead is not None and all(r.finished for r in ahead.reqs):
            self.drop()

    def _cut_ended(self, step: StepAhead) -> None:
        """Cuts the rows of requests that a stop token ended after `step` was launched."""
        self._cut(step, [i for i, r in enumerate(step.reqs) if not r.finished])

    def _cut(self, step: StepAhead, live: list[int]) -> None:
        """Keeps only the rows of step's requests `live` (ascending indices): the others' slots
        freed (no request holds them), their tokens never read."""
        if len(live) == len(step.reqs):
            return
        kept = set(live)
        self.scheduler.free_slots([slot for i, slot in enumerate(step.slots) if i not in kept])
        step.rows = live if step.rows is None else [step.rows[i] for i in live]
        step.reqs, step.slots = [step.reqs[i] for i in live], [step.slots[i] for i in live]

    def _launch(self, reqs: list[Req], kv_lens: list[int], slots: list[int], roots) -> StepAhead:
        launched, hidden, logits = self.runner.launch_greedy_decode(reqs, kv_lens, slots, roots)
        if not all(r.params.greedy for r in reqs):   # sampled on the device, rooted at kv_lens
            launched = InFlight.launch(self.sampler.sample_plain(logits, reqs, kv_lens))
        step = StepAhead(list(reqs), slots, launched, hidden=hidden)
        if any(r.grammar is not None for r in reqs):
            # copied before the next launch overwrites a graph's logits (64 x 151k fp32 logits:
            # ~40 MB, some 25 us of an H200's bandwidth, not measured), read only where a grammar
            # forbids a token
            step.logits = logits.clone()
            if logits.is_cuda:
                step.logits_copied = record(torch.cuda.Event())
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
        """Forgets the step launched ahead, if any (the next step is launched afresh for all)."""
        ahead, self.ahead = self.ahead, None
        self.waiting = set()
        self.release(ahead)

    def release(self, step: StepAhead | None) -> None:
        """Frees a step's slots (no request holds them before its commit)."""
        if step is not None:
            self.scheduler.free_slots(step.slots)
