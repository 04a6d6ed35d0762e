"""KVLedger: who holds each KV slot: the free list, the prefix cache, or one running request.

The scheduler hands out and takes back every slot through it. A running request's
`kv_slots` are its cache by position: the first `cached_len` belong to the prefix cache
(kv/radix_cache.py; locked through `cache_node` while the request runs), the rest to the
request alone. With the prefix cache disabled (`--disable-radix-cache`) the first part is
always empty and the ledger is the plain allocator.

A request's tokens meet the cache at four points:
- admission (`attach`): the longest cached prefix of its tokens becomes the start of its
  cache, capped at all but the last token it must prefill: that token is always computed,
  since its logits give the next token;
- after each prefill chunk (`cache_prefill`): the tokens computed so far are inserted, so
  a request that arrives later (or one held back to share this one's prompt) finds them;
- finish and preemption (`release(keep=True)`): prompt + output tokens whose KV is written
  are inserted, then unlocked (evictable); a preempted request that comes back finds them;
- abort (`release(keep=False)`): what the request computed alone is freed, unread: the
  step that failed it may have left that half written.
When another request cached the same tokens first, the tree keeps its copy and the
request's own is freed (a running request switches to the tree's: its table row is rewritten).

Allocation evicts unlocked cached prefixes, least recently used first, when the free list
is short; `available()` counts them as room.

With a draft head that reads the target's states (`keep_draft_rows`), the tree keeps the
head's rows beside the target's KV, keyed on bigrams (kv/draft_rows.py): a request's
cached prefix then holds both, and only what the head has rows for is cached.
"""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Iterable

from specserve.kv.draft_rows import DraftRows, EvictingSlots, bigrams
from specserve.kv.pool import KVPool
from specserve.kv.radix_cache import RadixCache

if TYPE_CHECKING:
    from specserve.request.req import Req


class KVLedger:
    def __init__(self, pool: KVPool, prefix_cache: bool):
        self.pool = pool
        self.allocator = pool.slots
        self.tree = RadixCache(pool.slots) if prefix_cache else None
        self.draft: DraftRows | None = None

    def keep_draft_rows(self, draft: DraftRows, draft_pool: KVPool) -> None:
        """From now on the tree caches the draft head's rows (in `draft_pool`) beside the
        target's KV, and an allocation of head rows evicts cached prefixes when short.
        Only while the tree is empty."""
        if self.tree is None:
            return
        if self.tree.size:
            raise RuntimeError("the prefix cache can keep draft rows only from its start")
        self.draft = draft
        self.tree = RadixCache(self.allocator, draft_allocator=draft_pool.slots)
        draft_pool.slots = self.tree.draft_allocator = EvictingSlots(draft_pool.slots, self.tree.evict)

    def _key(self, req: Req, start: int, end: int) -> list[int]:
        """The tree's key of the request's positions start .. end - 1."""
        return req.all_ids[start:end] if self.draft is None else bigrams(req.all_ids, start, end)

    def _cacheable_end(self, req: Req, end: int) -> int:
        """Positions before `end` the tree can key: with draft rows, a bigram needs the next token."""
        return end if self.draft is None else min(end, len(req.all_ids) - 1)

    # --- room ---
    def available(self) -> int:
        """Slots an allocation can get: free ones, and cached ones no running request holds."""
        return self.allocator.available() + (self.tree.evictable_size if self.tree is not None else 0)

    def alloc(self, count: int) -> list[int] | None:
        shortfall = count - self.allocator.available()
        if shortfall > 0 and self.tree is not None:
            self.tree.evict(shortfall)
        return self.allocator.alloc(count)

    def free(self, slots: list[int]) -> None:
        self.allocator.free(slots)

    def flush(self) -> int:
        """Drops every cached prefix no running request holds; returns the slots freed."""
        return self.tree.clear() if self.tree is not None else 0

    # --- a request's cache ---
    @staticmethod
    def match_limit(req: Req) -> int:
        return max(req.prefill_target - 1, 0)

    def cached_prefix_len(self, req: Req) -> int:
        """How much of the request's cache `attach` would find now (changes nothing)."""
        if self.tree is None:
            return 0
        return self.tree.match_length(self._key(req, 0, self.match_limit(req)))

    def attach(self, req: Req) -> None:
        """Admission (the request has its table row, no slots yet)."""
        if req.kv_slots:
            raise RuntimeError(f"request {req.rid} is admitted with {req.kv_len} KV slots already")
        if self.tree is None:
            return
        slots, node = self.tree.match_prefix(self._key(req, 0, self.match_limit(req)))
        self.tree.lock(node)
        req.kv_slots, req.cached_len, req.cache_node = slots, len(slots), node
        if slots:
            self._write_table(req, 0, slots)
        if self.draft is not None:
            self.draft.adopt(req, self.tree.path_draft_slots(node))
        if req.preemptions == 0:
            req.cached_tokens = len(slots)

    def cache_prefill(self, req: Req) -> None:
        """After a prefill chunk: the request's computed tokens join the tree, under its lock."""
        if self.tree is None or req.kv_len <= req.cached_len:
            return
        start, length = req.cached_len, self._cacheable_end(req, req.kv_len)
        drafts = None
        if self.draft is not None:
            drafts = self.draft.rows_to_cache(req, start, length, finishing=False)
            length = start + len(drafts)
        if length <= start:
            return
        inserted = self._insert(req, start, length, drafts)
        if inserted.cached:   # another request cached some of these tokens first: use its copy
            end = start + inserted.cached
            duplicates = req.kv_slots[start:end]
            req.kv_slots[start:end] = inserted.slots[:inserted.cached]
            self._write_table(req, start, inserted.slots[:inserted.cached])
            self.free(duplicates)
        if inserted.node is not req.cache_node:
            self.tree.lock(inserted.node)
            self.tree.unlock(req.cache_node)
        req.cached_len, req.cache_node = length, inserted.node

    @property
    def defers_release(self) -> bool:
        """Whether finished requests should be released a few at a time (engine/parked.py):
        where the tree keeps draft rows, a release may first feed the head what it lacks, and
        one feed for many requests costs what one for a single request does."""
        return self.tree is not None and self.draft is not None

    def before_release(self, reqs: list[Req]) -> None:
        """These requests are about to be released together, keeping their KV: their draft
        rows (if the tree keeps them) are made ready in one go (DraftRows.before_leaving)."""
        if self.tree is not None and self.draft is not None and reqs:
            self.draft.before_leaving(reqs)

    def release(self, req: Req, keep: bool) -> None:
        """Takes back all of the request's slots: with keep, its written KV joins the tree."""
        own_from = start = req.cached_len
        # a verify step may have written drafts a stop cut off
        written = self._cacheable_end(req, min(req.kv_len, req.num_tokens))
        drafts = None
        if keep and self.draft is not None and written > start:
            drafts = self.draft.rows_to_cache(req, start, written, finishing=True)
            written = start + len(drafts)
        if keep and self.tree is not None and written > start:
            inserted = self._insert(req, start, written, drafts)
            self.free(req.kv_slots[start:start + inserted.cached])   # another request's copy was cached first
            own_from = written
        self.free(req.kv_slots[own_from:])
        if self.draft is not None:
            self.draft.detach(req)
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        req.kv_slots, req.cached_len, req.cache_node = [], 0, None

    def _insert(self, req: Req, start: int, end: int, drafts: list[int] | None):
        """Positions start .. end - 1 of the request join the tree under its lock (with its head
        rows, which are the tree's from now on)."""
        inserted = self.tree.insert(self._key(req, start, end), req.kv_slots[start:end], below=req.cache_node,
                                    draft_slots=drafts)
        if drafts is not None:
            self.draft.share(req, start, inserted.draft_slots, inserted.cached)
        return inserted

    def trim(self, req: Req, length: int) -> None:
        """Frees the request's slots from position `length` on (its own, never the tree's)."""
        if length < req.cached_len:
            raise RuntimeError(f"trimming request {req.rid} to {length} tokens would free cached ones")
        excess = req.kv_slots[length:]
        if excess:
            del req.kv_slots[length:]
            self.free(excess)

    def _write_table(self, req: Req, start: int, slots: list[int]) -> None:
        self.pool.write_entries_async([req.row] * len(slots), list(range(start, start + len(slots))), slots)

    # --- the invariant ---
    def check(self, running: Iterable[Req]) -> None:
        """Raises AssertionError unless every slot is in exactly one place (free, in the tree,
        or held by one running request), each request's table row names its slots, and the
        tree's locks and sizes agree with the requests that hold them."""
        owners: dict[int, str] = {}

        def claim(slots: Iterable[int], owner: str) -> None:
            for slot in slots:
                if slot in owners:
                    raise AssertionError(f"KV slot {slot} is both {owners[slot]} and {owner}")
                owners[slot] = owner

        claim(self.allocator.free_list(), "free")
        if self.tree is not None:
            claim(self.tree.held_slots(), "in the prefix cache")
        running = list(running)
        for req in running:
            claim(req.kv_slots[req.cached_len:], f"held by request {req.rid}")
            table = self.pool.req_to_token[req.row, :req.kv_len].tolist() if req.row is not None else []
            if table != req.kv_slots:
                raise AssertionError(f"request {req.rid}: req_to_token row {req.row} does not name its KV slots")
        expected = set(range(1, self.pool.size + 1))
        if owners.keys() != expected:
            raise AssertionError(f"KV slots lost: {sorted(expected - owners.keys())[:10]}, "
                                 f"unknown: {sorted(owners.keys() - expected)[:10]}")
        self._check_tree(running)
        if self.draft is not None:
            self._check_draft_rows(running)

    def _check_tree(self, running: list[Req]) -> None:
        if self.tree is None:
            if any(req.cached_len or req.cache_node is not None for req in running):
                raise AssertionError("a request holds cached slots but the prefix cache is disabled")
            return
        locks: collections.Counter = collections.Counter()
        for req in running:
            if self.tree.path_slots(req.cache_node) != req.kv_slots[:req.cached_len]:
                raise AssertionError(f"request {req.rid}: its cached slots are not its tree path's")
            node = req.cache_node
            while node is not self.tree.root:
                locks[id(node)] += 1
                node = node.parent
        stack, sizes = [self.tree.root], {"locked": 0, "evictable": 0}
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node is self.tree.root:
                continue
            if node.lock_count != locks[id(node)]:
                raise AssertionError(f"a tree node has {node.lock_count} locks, {locks[id(node)]} requests hold it")
            sizes["locked" if node.lock_count else "evictable"] += len(node.key)
        if (sizes["locked"], sizes["evictable"]) != (self.tree.locked_size, self.tree.evictable_size):
            raise AssertionError(f"tree sizes {sizes} disagree with its counters "
                                 f"({self.tree.locked_size} locked, {self.tree.evictable_size} evictable)")

    def _check_draft_rows(self, running: list[Req]) -> None:
        """Every head slot is free, in the tree, or held by one request alone; each running
        request's cached head rows are its tree path's."""
        pool_slots = self.tree.draft_allocator
        owners: dict[int, str] = {}
        for owner, slots in [("free", pool_slots.free_list()), ("in the prefix cache", self.tree.held_slots(draft=True)),
                             *((f"held by request {rid}", own) for rid, own in self.draft.own_slots().items())]:
            for slot in slots:
                if slot in owners:
                    raise AssertionError(f"head slot {slot} is both {owners[slot]} and {owner}")
                owners[slot] = owner
        expected = set(range(1, pool_slots.size + 1))
        if owners.keys() != expected:
            raise AssertionError(f"head slots lost: {sorted(expected - owners.keys())[:10]}, "
                                 f"unknown: {sorted(owners.keys() - expected)[:10]}")
        for req in running:
            if self.draft.cached_rows(req) != self.tree.path_draft_slots(req.cache_node):
                raise AssertionError(f"request {req.rid}: its cached head rows are not its tree path's")
