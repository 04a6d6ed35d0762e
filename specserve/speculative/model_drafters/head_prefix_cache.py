"""An EAGLE head's rows in the prefix cache: the engine side of kv/draft_rows.py.

The ledger caches a request's positions only where its head has rows for them too. A
request's head is fed the target's states when it drafts (a catch-up, or the chain's first
step), so right after a prefill it holds no rows for the new tokens: the prefill is cached
once the request leaves (finish or preemption), when what the head still lacks is fed in
one catch-up forward from the states it kept (finished requests are released a few at a
time, engine/parked.py, and fed in one forward together). A second chat turn then finds the
first turn's prompt and answer cached for the target and the head alike.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from specserve.kv.draft_rows import DraftRows

if TYPE_CHECKING:
    from specserve.kv.ledger import KVLedger
    from specserve.request.req import Req
    from specserve.speculative.model_drafters.eagle import EagleDrafter


class HeadPrefixRows(DraftRows):
    def __init__(self, drafter: "EagleDrafter"):
        self.drafter = drafter
        self.kv = drafter.kv

    def adopt(self, req: "Req", slots: list[int]) -> None:
        self.kv.adopt(req, slots)

    def before_leaving(self, reqs: list["Req"]) -> None:
        # one catch-up forward for the requests released together: an engine whose policy holds
        # the head back feeds it every answer whole at the end, and a forward each (eager,
        # launch-bound) cost more at batch 64 than the plain steps themselves
        feedable = [req for req in reqs if self.drafter.can_feed(req)]
        if feedable:
            self.drafter.feed(feedable)

    def rows_to_cache(self, req: "Req", start: int, end: int, finishing: bool) -> list[int]:
        held = self.kv.held_rows(req, start, end)
        if finishing and start + len(held) < end and self.drafter.can_feed(req):
            self.drafter.feed([req])
            held = self.kv.held_rows(req, start, end)
        return held

    def share(self, req: "Req", start: int, slots: list[int], cached: int) -> None:
        self.kv.share(req, start, slots, cached)

    def detach(self, req: "Req") -> None:
        self.kv.detach(req)

    def own_slots(self) -> dict[str, list[int]]:
        return self.kv.own_slots()

    def cached_rows(self, req: "Req") -> list[int]:
        return self.kv.cached_rows(req)


def cache_head_rows(ledger: "KVLedger", drafter: "EagleDrafter") -> None:
    """The ledger's prefix cache (if on) keeps the drafter's head rows beside the target's KV."""
    ledger.keep_draft_rows(HeadPrefixRows(drafter), drafter.kv.pool)
