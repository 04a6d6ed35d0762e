"""The scheduler decides who runs each step and owns every request's KV slots.

Policy: FCFS. A step is EXTEND (chunks of prompts, at most `chunked_prefill_size` tokens)
or DECODE/VERIFY (every running request that has its cache). While nobody decodes,
prompts are prefilled first. While requests decode, prefill chunks are paced
(prefill_pacer.py) so that no stream stalls behind a long prompt: they alternate with
decode steps, or, with `enable_mixed_chunk` (SGLang's --enable-mixed-chunk), ride in the
same EXTEND step as the decoding requests' next tokens.

When the cache cannot grow, the most recently arrived running request is preempted: its
slots are freed and it is queued again at the front, to recompute its cache later from
prompt + output so far (greedy output is unchanged by this).

`focus` narrows the next steps to a few requests: the engine retries a failed batch's
requests one at a time to find the one whose step fails.
"""
from __future__ import annotations

import collections
import time
from typing import Callable

from specserve.engine.prefill_pacer import PrefillPacer
from specserve.engine.request import Batch, Req, ReqState
from specserve.kv.pool import KVPool


class Scheduler:
    def __init__(self, pool: KVPool, max_running_requests: int, chunked_prefill_size: int,
                 enable_mixed_chunk: bool = False):
        self.pool = pool
        self.max_running = max_running_requests
        self.pacer = PrefillPacer(chunked_prefill_size)
        self.mixed_chunk = enable_mixed_chunk
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []        # by arrival; prefilling ones included
        self.focus: list[Req] | None = None  # when set, only these requests are scheduled
        self._last_step: tuple[int, int] | None = None   # (prompt tokens, decoding requests) of the last batch
        # called with each preempted request (the core tells the drafter: a draft model's cache goes too)
        self.preempt_listeners: list[Callable[[Req], None]] = []

    # --- intake ---
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def abort(self, req: Req) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self._release(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- scheduling ---
    def schedule(self) -> Batch | None:
        """The next step's batch (see the module docstring for the policy)."""
        decoding = [r for r in self._candidates(self.running) if r.kv_len == r.num_tokens - 1]
        # a mixed step's prefill part is timed against a plain decode step: one runs first
        mixed = self.mixed_chunk and self.pacer.decode_step_s is not None
        prefill_turn = not decoding or mixed or self._last_step is None or self._last_step[0] == 0
        batch, decode_count = None, 0
        if prefill_turn:
            batch, decode_count = self._schedule_extend(decoding if mixed else [])
        if batch is None and decoding:
            decoding = self._reserve_decode_slots(decoding)
            batch, decode_count = (Batch(reqs=decoding, is_extend=False), len(decoding)) if decoding else (None, 0)
        if batch is None and not prefill_turn:   # a decode turn, but preemption left nobody to decode
            batch, decode_count = self._schedule_extend([])
        self._last_step = None if batch is None else (sum(batch.extend_lens[decode_count:]), decode_count)
        return batch

    def record_step_time(self, seconds: float) -> None:
        """The wall time of the step last scheduled: the pacer learns the costs from it."""
        if self._last_step is not None:
            self.pacer.record(seconds, *self._last_step)

    def _candidates(self, reqs) -> list[Req]:
        if self.focus is None:
            return list(reqs)
        return [r for r in reqs if any(r is f for f in self.focus)]

    def _schedule_extend(self, decoding: list[Req]) -> tuple[Batch | None, int]:
        """Prompt chunks (requests partway through a chunked prefill first, then new ones in
        arrival order), behind `decoding`'s next tokens if any (a mixed step). Returns the
        batch and how many requests it decodes; no batch if no prompt can take a chunk."""
        if not any(r.kv_len < r.prefill_target for r in self.running) and not self.waiting:
            return None, 0
        if decoding:
            decoding = self._reserve_decode_slots(decoding)
        # a prompt with one token left to cache decodes it: it is in `decoding`, not here
        candidates = (self._candidates(r for r in self.running
                                       if r.kv_len < r.prefill_target and not any(r is d for d in decoding))
                      + self._candidates(self.waiting))
        decode_reserve = sum(1 for r in self.running if r.kv_len >= r.prefill_target)
        # others' streams wait while a chunk runs: paced unless nobody else decodes (or they are paused)
        budget = self.pacer.budget(decoding=decode_reserve > 0 and self.focus is None)
        free = self.pool.slots.available() - decode_reserve   # what this step's chunks may take, together
        reqs, lens, samples = list(decoding), [1] * len(decoding), [True] * len(decoding)
        for req in candidates:
            if budget <= 0 or free <= 0:
                break
            if req.state is ReqState.WAITING and not self._admit(req, decode_reserve):
                break  # FCFS: later requests wait behind this one
            length = min(req.prefill_target - req.kv_len, budget, free)
            reqs.append(req)
            lens.append(length)
            samples.append(req.kv_len + length == req.num_tokens)
            budget -= length
            free -= length
        if len(reqs) == len(decoding):
            return None, 0
        return Batch(reqs=reqs, is_extend=True, extend_lens=lens, samples=samples), len(decoding)

    def _admit(self, req: Req, decode_reserve: int) -> bool:
        """Moves a waiting request into running if a row and some cache are free."""
        if len(self.running) >= self.max_running or self.pool.free_rows() == 0:
            return False
        if self.pool.slots.available() <= decode_reserve:
            return False
        self.waiting.remove(req)
        req.row = self.pool.alloc_row()
        req.state = ReqState.RUNNING
        self.running.append(req)
        return True

    def _reserve_decode_slots(self, decoding: list[Req]) -> list[Req]:
        """Preempts the newest requests until every remaining one can grow by one token."""
        while decoding and len(decoding) > self.pool.slots.available():
            victim = self.running[-1]
            self.preempt(victim)
            if victim in decoding:
                decoding.remove(victim)
        return decoding

    def preempt(self, req: Req) -> None:
        self.running.remove(req)
        self._release(req)
        req.state = ReqState.WAITING
        req.preemptions += 1
        self.waiting.appendleft(req)
        for listener in self.preempt_listeners:
            listener(req)

    # --- cache bookkeeping ---
    def alloc_slots(self, count: int) -> list[int] | None:
        return self.pool.slots.alloc(count)

    def free_slots(self, slots: list[int]) -> None:
        self.pool.slots.free(slots)

    def append_kv(self, reqs: list[Req], slot_lists: list[list[int]], write_table: bool = True) -> None:
        """The tokens at each request's next positions now live in its `slot_lists` entry,
        with one req_to_token write for the whole batch: a write per request costs a
        host-to-device copy and a kernel launch each, host time that grows with the batch
        (a millisecond or more per step at 64 requests). write_table=False: the entries are
        in the table already (a step launched ahead wrote them)."""
        rows: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for req, kept in zip(reqs, slot_lists):
            if kept:
                start = req.kv_len
                req.kv_slots.extend(kept)
                rows.extend([req.row] * len(kept))
                positions.extend(range(start, start + len(kept)))
                slots.extend(kept)
        if slots and write_table:
            self.pool.write_entries_async(rows, positions, slots)

    def finish(self, req: Req, reason: dict) -> None:
        req.state = ReqState.FINISHED
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        if req in self.running:
            self.running.remove(req)
        self._release(req)

    def trim_kv(self, req: Req) -> None:
        """Restores the invariant kv_len <= num_tokens - 1 after a step that failed between
        committing KV slots and committing their tokens: the slots of tokens never committed go."""
        excess = req.kv_slots[max(req.num_tokens - 1, 0):]
        if excess:
            del req.kv_slots[-len(excess):]
            self.pool.slots.free(excess)

    def _release(self, req: Req) -> None:
        self.pool.slots.free(req.kv_slots)
        req.kv_slots = []
        if req.row is not None:
            self.pool.free_row(req.row)
            req.row = None


