"""A draft head's rows beside the target's KV in the prefix cache.

An EAGLE head (or MTP layer) keeps its own one-layer KV cache, whose row r reads the
target's state at position r and the token at r + 1. A prefix served from the prefix cache
has no target states, so the head cannot compute its rows there: the tree keeps them
instead. Each tree entry holds the target's KV slot of position p and the head's row p
(radix_cache.py: `draft_slots`), inserted, locked and evicted together.

Row p depends on the tokens up to p + 1, one past the target's KV of p, so such a tree is
keyed on bigrams: entry p is the pair (token p, token p + 1). A match of m entries gives
the target's KV of positions 0 .. m - 1 and the head's rows 0 .. m - 1; the request's
prefill computes the target from position m on, and the head is fed those states only.
A request's last token has no bigram: its KV is not cached (one token less than a token tree).

The engine side (speculative/model_drafters/head_prefix_cache.py) implements `DraftRows`: the ledger hands
a request the rows it matched, and asks it for the rows to cache beside the target's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

from specserve.kv.pool import SlotAllocator

if TYPE_CHECKING:
    from specserve.request.req import Req


class DraftRows(Protocol):
    """The draft head's side of a request's cached prefix."""

    def adopt(self, req: "Req", slots: list[int]) -> None:
        """The request starts with these cached rows (0 .. len - 1), held by the tree."""

    def before_leaving(self, reqs: list["Req"]) -> None:
        """These requests leave together (engine/parked.py): what their heads lack may be fed
        now in one forward, so that `rows_to_cache(finishing=True)` need not feed each alone."""

    def rows_to_cache(self, req: "Req", start: int, end: int, finishing: bool) -> list[int]:
        """The request's own head slots of rows start .. start + k - 1 (k <= end - start: as
        many as it holds), to be cached. finishing: the request is leaving (it may be fed
        what it lacks now, its target states being about to go)."""

    def share(self, req: "Req", start: int, slots: list[int], cached: int) -> None:
        """Rows start .. start + len - 1 are the tree's from now on, held in these slots: the
        first `cached` of them the copies of another request that cached them first (the
        request's own copies are freed), the others the request's own."""

    def detach(self, req: "Req") -> None:
        """The request leaves: its own rows are freed, the tree's stay."""

    def own_slots(self) -> dict[str, list[int]]:
        """Per request, the head slots it holds alone (for the accounting check)."""

    def cached_rows(self, req: "Req") -> list[int]:
        """The tree's rows the request holds (its first ones)."""


class EvictingSlots(SlotAllocator):
    """The head pool's allocator once the prefix cache keeps its rows: an allocation that
    finds too few free slots first evicts unlocked cached prefixes (which frees target
    slots and head rows alike). It takes over the pool's free list as it is."""

    def __init__(self, base: SlotAllocator, evict: Callable[[int], int]):
        self.size = base.size
        self._free = base._free
        self._evict = evict

    def alloc(self, count: int) -> list[int] | None:
        if count > len(self._free):
            self._evict(count - len(self._free))
        return super().alloc(count)


def bigrams(ids: list[int], start: int, end: int) -> list[int]:
    """Entries start .. end - 1 of a bigram key: (ids[p], ids[p + 1]) packed in one int (in
    numpy: a scheduler matches whole prompts, and a Python loop took ~1 ms per 8k tokens)."""
    pairs = np.asarray(ids[start:end + 1], dtype=np.int64)
    return ((pairs[:-1] << 32) | pairs[1:]).tolist()
