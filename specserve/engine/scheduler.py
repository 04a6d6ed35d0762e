"""The scheduler decides who runs each step and owns every request's KV slots.

A step is EXTEND (chunks of prompts, at most `chunked_prefill_size` tokens)
or DECODE/VERIFY (every running request that has its cache). While nobody decodes,
prompts are prefilled first. While requests decode, prefill chunks are paced
(prefill_pacer.py) so that no stream stalls behind a long prompt: they alternate with
decode steps, or, with `enable_mixed_chunk` (SGLang's --enable-mixed-chunk), ride in the
same EXTEND step as the decoding requests' next tokens. Pacing protects only the streams
that had their first token before the prompts arrived: a burst of requests arriving
together is prefilled first, whichever of them started streaming already.

While a prompt is partway through a chunked prefill and another prompt is too, or a waiting
one could start, the oldest takes at most half of the step's prompt tokens: newcomers start
beside a long prefill instead of behind it, within the pacer's budget for the step. A later
prompt takes only the room that the rests of the prompts before it leave free, so prompts
partway through never fill the pool together (none could finish, and with nobody decoding
nobody would be preempted).

Waiting requests are admitted in arrival order (`fcfs`), or, with `schedule_policy="lpm"`
(SGLang's longest prefix match), those with the longest cached prefix first, so requests
that share a prefix run together. With the prefix cache on (kv/ledger.py), a request
computes only what the cache lacks, and one whose uncached prompt starts with tokens that
another request is prefilling in this very step waits a step for them to be cached
(SHARED_PREFIX_MIN): under fcfs everyone behind it waits too, under lpm others go first.

With an EAGLE head's rows in the prefix cache, finished requests are released a few at a
time (engine/parked.py): each release may feed the head, and one feed serves many.

When the cache cannot grow, the most recently arrived running request is preempted: its
slots are released (with the prefix cache on, its written KV stays cached until evicted)
and it is queued again at the front, to rebuild its cache later from prompt + output so
far (greedy output is unchanged by this).

`focus` narrows the next steps to a few requests: the engine retries a failed batch's
requests one at a time to find the one whose step fails.
"""
from __future__ import annotations

import collections
import contextlib
import time
from typing import Callable, Iterator

from specserve.engine.parked import ParkedRequests
from specserve.engine.prefill_pacer import PrefillPacer
from specserve.kv.ledger import KVLedger
from specserve.kv.pool import KVPool
from specserve.request.req import Batch, Req, ReqState

SCHEDULE_POLICIES = ("fcfs", "lpm")
SHARED_PREFIX_MIN = 32     # tokens another request's chunk must add to a waiting one's cached prefix to hold it back
LPM_MAX_QUEUE = 128        # longer queues are served fcfs: matching every waiting request each step costs too much


class Scheduler:
    def __init__(self, pool: KVPool, max_running_requests: int, chunked_prefill_size: int,
                 enable_mixed_chunk: bool = False, prefix_cache: bool = False, schedule_policy: str = "fcfs"):
        if schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}; got {schedule_policy!r}")
        self.pool = pool
        self.kv = KVLedger(pool, prefix_cache)
        self.policy = schedule_policy
        self.max_running = max_running_requests
        self.pacer = PrefillPacer(chunked_prefill_size)
        self.mixed_chunk = enable_mixed_chunk
        self.waiting: collections.deque[Req] = collections.deque()
        self.running: list[Req] = []        # by arrival; prefilling ones included
        self.focus: list[Req] | None = None  # when set, only these requests are scheduled
        self._last_step: tuple[int, int] | None = None   # (prompt tokens, decoding requests) of the last batch
        # called with each preempted request (the core tells the drafter: a draft model's cache goes too)
        self.preempt_listeners: list[Callable[[Req], None]] = []
        self.parked = ParkedRequests()   # finished requests whose slots are released later, together (`finish`)
        # slots a decoding request's step may take, which admission leaves free for each: its
        # token and, with a drafter, its draft nodes (the engine sets it). With one, a full
        # pool left no room for drafts: a prompt-sharing batch decoded one token a step
        self.decode_room = 1
        # slots of a drafter's own KV cache, which holds every running request's whole sequence
        # with no prefix shared (a draft model's): admission keeps the running requests within
        # it, else a batch the target's prefix cache fits decodes without drafts (None: no such cache)
        self.draft_capacity: int | None = None
        self._prefilled: list[Req] = []     # requests the last batch gave a prompt chunk, cached at the next schedule

    # --- intake ---
    def add(self, req: Req) -> None:
        self.waiting.append(req)
        self.parked.arrived(req)

    def abort(self, req: Req) -> None:
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        self._release(req, keep_cache=False)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.parked.reqs)

    # --- scheduling ---
    def schedule(self) -> Batch | None:
        """The next step's batch (see the module docstring for the policy)."""
        self._cache_prefilled()
        if self.parked.due(bool(self.running), self.kv.available() < self.pool.size // 4):
            self.parked.release(self.kv.before_release, lambda req: self._release(req, keep_cache=True))
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
        if batch is None:   # a decode turn, or preemption freed room for a prompt: nobody decodes
            batch, decode_count = self._schedule_extend([])
        self._last_step = None if batch is None else (sum(batch.extend_lens[decode_count:]), decode_count)
        self._prefilled = batch.reqs[decode_count:] if batch is not None and batch.is_extend else []
        return batch

    def _cache_prefilled(self) -> None:
        """The prompt chunks of the last step join the prefix cache (a step that failed and was
        trimmed leaves only what it committed); done here, once the step has fully committed."""
        for req in self._prefilled:
            if req.state is ReqState.RUNNING and req.row is not None:
                self.kv.cache_prefill(req)
        self._prefilled = []

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
        if self.policy == "lpm":
            self._sort_waiting_by_cached_prefix()
        # a prompt with one token left to cache decodes it: it is in `decoding`, not here
        in_batch = {id(r) for r in decoding}
        started = self._candidates(r for r in self.running if r.kv_len < r.prefill_target and id(r) not in in_batch)
        candidates = started + self._candidates(self.waiting)
        # (so a mixed step's decoding requests need room beside those whose prompts are cached)
        decode_reserve = self.decode_room * sum(1 for r in self.running
                                                if r.kv_len >= r.prefill_target or id(r) in in_batch)
        # others' streams wait while a chunk runs: paced unless nobody else decodes (or they are paused)
        budget = self.pacer.budget(decoding=decode_reserve > 0 and self.focus is None
                                   and self._streamed_before(candidates))
        oldest_chunk = self._oldest_prompt_chunk(started, len(candidates) > len(started), budget, decode_reserve)
        planned = 0   # slots this step's chunks take, together
        # prompt tokens the requests already given a chunk still owe after it: a later prompt's
        # chunk never takes their room, else two prompts partway through fill the pool together
        # and neither can finish (nobody decodes, so nobody is preempted: the engine stalls)
        owed = 0
        draft_demand = sum(self._draft_need(r) for r in self.running) if self.draft_capacity is not None else 0
        reqs, lens, samples = list(decoding), [1] * len(decoding), [True] * len(decoding)
        for req in candidates:
            if budget <= 0 or self.kv.available() - decode_reserve - planned - owed <= 0:
                break
            if req.state is ReqState.WAITING:
                if self._shares_a_chunk_in_this_step(req, reqs[len(decoding):], lens[len(decoding):]):
                    if self.policy == "lpm":
                        continue
                    break  # FCFS: later requests wait behind this one
                if (self.draft_capacity is not None and self.running
                        and draft_demand + self._draft_need(req) > self.draft_capacity):
                    break   # (alone, a request runs: drafts it gets no room for are cut)
                if not self._admit(req, decode_reserve + planned + owed):
                    break
                draft_demand += self._draft_need(req)
            # admission locks the request's cached prefix: what is free is counted again
            length = min(req.prefill_target - req.kv_len, budget,
                         self.kv.available() - decode_reserve - planned - owed)
            if started and req is started[0]:
                length = min(length, oldest_chunk)
            reqs.append(req)
            lens.append(length)
            samples.append(req.kv_len + length == req.num_tokens)
            budget -= length
            planned += length
            owed += req.prefill_target - req.kv_len - length
        if len(reqs) == len(decoding):
            return None, 0
        return Batch(reqs=reqs, is_extend=True, extend_lens=lens, samples=samples), len(decoding)

    def _streamed_before(self, prompts: list[Req]) -> bool:
        """Whether a running request had its first token before the oldest of `prompts` arrived:
        only such streams are protected by pacing. Requests that arrive together are prefilled
        first, as SGLang and vLLM do: pacing a burst for the sake of its own first streams
        delays the rest and slows the whole burst (H200, 7B shape, plain, 256 tokens out,
        prompts arriving at once: 32 x 2048 tokens 2008-2715 -> 3054-3124 tok/s, mean time to
        first token 1402 -> 532-631 ms; 64 x 512 8117 -> 9077-9084 tok/s; median inter-token
        latency unchanged; docs/bench/h200_2026-12-05b)."""
        if not prompts:
            return False
        oldest = min(r.arrival_time for r in prompts)
        return any(r.first_token_time is not None and r.first_token_time < oldest for r in self.running)

    def _draft_need(self, req: Req) -> int:
        """Slots of the drafter's own cache a request takes at its next drafting step."""
        return req.num_tokens + self.decode_room

    def _oldest_prompt_chunk(self, started: list[Req], others_wait: bool, budget: int, decode_reserve: int) -> int:
        """The most tokens the oldest prompt partway through its prefill takes this step: half
        the budget while another prompt is partway too or a waiting one could start, so a
        short request that arrives during a long prefill shares its steps instead of waiting
        for its end (a 4k-token prompt on a CPU: 62-66 s to a newcomer's first token, 0.18 s
        idle); the whole budget otherwise, and when the pool holds no room beyond the rest of
        the oldest's prompt (the others could not take the other half)."""
        may_start = others_wait and len(self.running) < self.max_running and self.pool.free_rows() > 0
        if not started or (len(started) == 1 and not may_start):
            return budget
        oldest = started[0]
        if self.kv.available() - decode_reserve - (oldest.prefill_target - oldest.kv_len) <= 0:
            return budget
        return max(budget // 2, 1)   # the long prompt still moves forward

    def _admit(self, req: Req, reserved: int) -> bool:
        """Moves a waiting request into running, with its cached prefix, if a row and room
        for at least one more token than `reserved` are free."""
        if len(self.running) >= self.max_running or self.pool.free_rows() == 0:
            return False
        if self.kv.available() <= reserved:
            return False
        req.row = self.pool.alloc_row()
        self.kv.attach(req)
        if self.kv.available() <= reserved:   # locking its cached prefix took the last room: it waits
            self._release(req, keep_cache=False)
            return False
        self.waiting.remove(req)
        req.state = ReqState.RUNNING
        self.running.append(req)
        return True

    def _shares_a_chunk_in_this_step(self, req: Req, prefilling: list[Req], chunk_lens: list[int]) -> bool:
        """Whether a chunk in this step computes at least SHARED_PREFIX_MIN tokens of the
        waiting `req`'s prompt that the cache lacks: next step it finds them cached. Not with a
        draft head's rows in the cache (kv/draft_rows.py): a chunk is cached once the head has
        rows for it, at its request's release, and the wait would last the whole prefill."""
        if self.kv.tree is None or self.kv.draft is not None or not prefilling:
            return False
        probe = self.kv.cached_prefix_len(req) + SHARED_PREFIX_MIN
        if probe > self.kv.match_limit(req):
            return False
        head = req.all_ids[:probe]
        return any(other.kv_len + length >= probe and other.all_ids[:probe] == head
                   for other, length in zip(prefilling, chunk_lens))

    def _sort_waiting_by_cached_prefix(self) -> None:
        """lpm: the longest cached prefix first; arrival order among equals (a stable sort)."""
        if self.kv.tree is None or len(self.waiting) > LPM_MAX_QUEUE:
            return
        ordered = sorted(self.waiting, key=lambda r: -self.kv.cached_prefix_len(r))
        self.waiting.clear()
        self.waiting.extend(ordered)

    def _reserve_decode_slots(self, decoding: list[Req]) -> list[Req]:
        """Preempts the newest requests until every remaining one can grow by one token."""
        while decoding and len(decoding) > self.kv.available():
            victim = self.running[-1]
            self.preempt(victim)
            if victim in decoding:
                decoding.remove(victim)
        return decoding

    def preempt(self, req: Req) -> None:
        self.running.remove(req)
        self._release(req, keep_cache=True)
        req.state = ReqState.WAITING
        req.preemptions += 1
        self.waiting.appendleft(req)
        for listener in self.preempt_listeners:
            listener(req)

    # --- cache bookkeeping ---
    def alloc_slots(self, count: int) -> list[int] | None:
        return self.kv.alloc(count)

    def free_slots(self, slots: list[int]) -> None:
        self.kv.free(slots)

    def available_slots(self) -> int:
        """Free KV slots, counting cached prefixes no running request holds (evicted on demand)."""
        return self.kv.available()

    def cached_slots(self) -> int:
        """KV slots the prefix cache holds (those running requests use included)."""
        return self.kv.tree.size if self.kv.tree is not None else 0

    def flush_cache(self) -> int:
        """Drops every cached prefix no running request holds; returns the slots freed."""
        return self.kv.flush()

    @contextlib.contextmanager
    def without_prefix_cache(self) -> Iterator[None]:
        """Runs the requests added meanwhile (e.g. the start-up warm-up's) uncached, as with
        --disable-radix-cache; the cache is kept as it was. Only while nobody runs."""
        if self.running or self.waiting:
            raise RuntimeError("the prefix cache can be set aside only while no request is queued or running")
        saved, self.kv = self.kv, KVLedger(self.pool, prefix_cache=False)
        try:
            yield
        finally:
            self.kv = saved

    def check_kv(self) -> None:
        """Raises AssertionError unless every KV slot is free, cached or held by one running (or parked) request."""
        self.kv.check(self.running + self.parked.reqs)

    def append_kv(self, reqs: list[Req], slot_lists: list[list[int]], write_table: bool = True) -> None:
        """The tokens at each request's next positions now live in its `slot_lists` entry,
        with one req_to_token write for the whole batch: a write per request costs a
        host-to-device copy and a kernel launch each, host time that grows with the batch
        (a millisecond or more per step at 64 requests). write_table=False: the entries are
        in the table already (a step launched ahead wrote them, or a verify step on the device)."""
        if not write_table:
            for req, kept in zip(reqs, slot_lists):
                req.kv_slots.extend(kept)
            return
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

    def finish(self, req: Req, reason: dict) -> bool:
        """The request is done; its slots join the cache now, or, where the ledger defers
        releases, with other finished requests (engine/parked.py). True: parked."""
        req.state = ReqState.FINISHED
        req.finish_reason = reason
        req.finish_time = time.perf_counter()
        if req in self.running:
            self.running.remove(req)
        if self.kv.defers_release:
            self.parked.park(req)
            return True
        self._release(req, keep_cache=True)
        return False

    def trim_kv(self, req: Req) -> None:
        """Restores the invariant kv_len <= num_tokens - 1 after a step that failed between
        committing KV slots and committing their tokens: the slots of tokens never committed go."""
        self.kv.trim(req, max(req.num_tokens - 1, 0))

    def _release(self, req: Req, keep_cache: bool) -> None:
        self.kv.release(req, keep=keep_cache)
        if req.row is not None:
            self.pool.free_row(req.row)
            req.row = None

