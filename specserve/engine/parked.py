"""Parked requests: finished requests whose release waits, to be released together.

With an EAGLE head and the prefix cache on, the cache keeps the head's rows beside the
target's KV (kv/draft_rows.py), so a request that leaves first has its head fed the rows it
lacks (KVLedger.defers_release): while the adaptive policy holds the head back, that is the
request's whole prompt and answer. A feed is an eager head forward whose cost is mostly
launches, the same for one request as for many: fed at each request's end, an EAGLE engine
held plain at 64 requests ran at 0.74-0.80x the plain engine (H200, 1.5B; 1.00x without the
prefix cache). So finished requests wait here, slots, head rows and kept states included,
and go together (one feed) when `due`.
"""
from __future__ import annotations

from typing import Callable

from specserve.request.req import Req

PARKED_AT_MOST = 16   # parked requests go together from this many


class ParkedRequests:
    def __init__(self):
        self.reqs: list[Req] = []
        self.listeners: list[Callable[[Req], None]] = []   # told of each request once it is released
        self._next_turn_waits = False   # a request that continues a parked one arrived

    def park(self, req: Req) -> None:
        self.reqs.append(req)

    def arrived(self, req: Req) -> None:
        """A new request: a chat's next turn should find the last one cached, so the parked
        request it continues goes before it is admitted."""
        self._next_turn_waits |= any(continues(req, parked) for parked in self.reqs)

    def due(self, running: bool, short_of_room: bool) -> bool:
        """They go when many wait, when no request runs (nothing to batch them with: the engine
        idles or a new wave starts), when the pool runs short, and when a next turn arrived."""
        return bool(self.reqs) and (len(self.reqs) >= PARKED_AT_MOST or not running or short_of_room
                                    or self._next_turn_waits)

    def release(self, before: Callable[[list[Req]], None], release_one: Callable[[Req], None]) -> None:
        """before(all), then release_one(each), then the listeners; the requests count as
        parked (work pending) until all of that is done."""
        parked = self.reqs
        try:
            try:
                before(parked)
            finally:
                for req in parked:
                    release_one(req)
            for req in parked:
                for listener in self.listeners:
                    listener(req)
        finally:
            self.reqs, self._next_turn_waits = [], False


def continues(req: Req, earlier: Req) -> bool:
    """Whether the request's prompt runs into an earlier request's answer: its next turn. Only
    the answer's first token need match: a chat client resends the answer as text, which the
    chat template tokenizes again, and that may split it otherwise than the model's tokens
    (then a whole-answer match fails and the turn is admitted with its last turn still parked,
    outside the cache)."""
    ids, done, n = req.prompt_ids, earlier.all_ids, len(earlier.prompt_ids) + 1
    return len(ids) > n and len(done) >= n and ids[n - 1] == done[n - 1] and ids[:n] == done[:n]
