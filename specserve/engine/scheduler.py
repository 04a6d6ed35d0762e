"""The scheduler decides who runs each step and owns every request's KV slots.

Policy: FCFS with prefill first. A step is either EXTEND (chunks of prompts, at most
`chunked_prefill_size` tokens) or DECODE/VERIFY (every running request that has its
cache). When the cache cannot grow, the most recently arrived running request is
preempted: its slots are freed and it is queued again at the front, to recompute its
cache later from prompt + output so far (greedy output is unchanged by this).
"""
from __future__ import annotations

import collections
import time

from specserve.engine.request import Batch, Req, ReqState
from specserve.kv.pool import KVPool


class Scheduler:
    def __init__(self, pool: KVPool, max_running_requests: int, chunked_prefill_size: int):
        self.pool = pool
        self.max_running = max_running_requests
        self.chunk_budget = chunked_prefill_size
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []        # by arrival; prefilling ones included

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
        """The next step's batch: prefill chunks if any prompt needs one, else a decode step."""
        extend = self._schedule_extend()
        if extend is not None:
            return extend
        decoding = [r for r in self.running if r.kv_len == r.num_tokens - 1]
        if not decoding:
            return None
        decoding = self._reserve_decode_slots(decoding)
        return Batch(reqs=decoding, is_extend=False) if decoding else None

    def _schedule_extend(self) -> Batch | None:
        budget = self.chunk_budget
        reqs, lens, samples = [], [], []
        # requests partway through a chunked prefill go first, then new ones in arrival order
        candidates = [r for r in self.running if r.kv_len < r.prefill_target] + list(self.waiting)
        decode_reserve = sum(1 for r in self.running if r.kv_len >= r.prefill_target)
        free = self.pool.slots.available() - decode_reserve   # what this step's chunks may take, together
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
        return Batch(reqs=reqs, is_extend=True, extend_lens=lens, samples=samples) if reqs else None

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
        while len(decoding) > self.pool.slots.available():
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

    def _release(self, req: Req) -> None:
        self.pool.slots.free(req.kv_slots)
        req.kv_slots = []
        if req.row is not None:
            self.pool.free_row(req.row)
            req.row = None

