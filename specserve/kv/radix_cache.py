"""RadixCache: a radix tree over token ids whose nodes hold the KV slots of those tokens.

Requests that share a prefix share its slots (SGLang's RadixAttention): the scheduler matches
a new request's tokens against the tree and computes only the rest. A node is locked
(reference-counted) while a running request's cache goes through it; unlocked leaves are
evicted, least recently used first, when the allocator runs out of free slots. The tree
holds each of its slots exactly once, and never a free one: kv/ledger.py checks that every
slot is free, held by the tree, or held by one request.

Page size 1: a node's key and its slots have one entry per token, so a match may end
anywhere, splitting the node it ends in.

A tree that also caches a draft head's rows (kv/draft_rows.py) keeps, beside each entry's
KV slot, the slot of the head's row for it in the head's own pool (`draft_slots`): they are
inserted, matched, locked and evicted together, and an evicted leaf frees both.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Iterator

from specserve.kv.pool import SlotAllocator


class TreeNode:
    __slots__ = ("key", "slots", "draft_slots", "children", "parent", "lock_count", "last_access")

    def __init__(self, key: list[int], slots: list[int], parent: TreeNode | None,
                 draft_slots: list[int] | None = None):
        self.key = key                      # token ids of this edge
        self.slots = slots                  # their KV slots, one per token
        self.draft_slots = draft_slots      # the draft head's row of each (a tree with a draft allocator)
        self.children: dict[int, TreeNode] = {}   # by the child's first token
        self.parent = parent
        self.lock_count = 0                 # running requests whose cache ends in this subtree
        self.last_access = 0


@dataclass
class Inserted:
    """What `insert` found and added."""
    cached: int              # leading tokens that were in the tree already: their given slots were not taken
    slots: list[int]         # the tree's slots of all the inserted tokens
    node: TreeNode           # the node that ends them
    draft_slots: list[int] | None = None   # the tree's draft rows of them (a tree with a draft allocator)


class RadixCache:
    def __init__(self, allocator: SlotAllocator, draft_allocator: SlotAllocator | None = None):
        self.allocator = allocator           # evicted slots go back to it
        self.draft_allocator = draft_allocator   # evicted draft rows go back to it (None: no draft rows)
        self.root = TreeNode([], [], None, [] if draft_allocator is not None else None)
        self.root.lock_count = 1             # never evicted
        self.evictable_size = 0              # tokens in unlocked nodes
        self.locked_size = 0                 # tokens in locked nodes
        self._clock = itertools.count(1)     # access order: a counter, so that ties never depend on timing
        self._evictable_leaves: set[TreeNode] = set()

    @property
    def size(self) -> int:
        return self.evictable_size + self.locked_size

    # --- lookups ---
    def match_prefix(self, tokens: list[int], below: TreeNode | None = None) -> tuple[list[int], TreeNode]:
        """The slots of the longest cached prefix of `tokens` and the node it ends at (a node
        the match ends inside is split there, so a lock can hold exactly that prefix).
        below: `tokens` continue the path to this node (default: they start at the root)."""
        slots: list[int] = []
        node, position, now = below or self.root, 0, next(self._clock)
        node.last_access = now
        while position < len(tokens):
            child = node.children.get(tokens[position])
            if child is None:
                break
            length = _common_length(child.key, tokens, position)
            if length < len(child.key):
                child = self._split(child, length)
            child.last_access = now
            slots.extend(child.slots)
            node, position = child, position + length
        return slots, node

    def match_length(self, tokens: list[int]) -> int:
        """How many leading tokens are cached; changes nothing (no split, no access time)."""
        node, position = self.root, 0
        while position < len(tokens):
            child = node.children.get(tokens[position])
            if child is None:
                break
            length = _common_length(child.key, tokens, position)
            position += length
            if length < len(child.key):
                break
            node = child
        return position

    # --- changes ---
    def insert(self, tokens: list[int], slots: list[int], below: TreeNode | None = None,
               draft_slots: list[int] | None = None) -> Inserted:
        """Caches `slots` as the KV of `tokens` (and `draft_slots` as their draft rows, in a
        tree with a draft allocator). Where a prefix is cached already its slots stay and the
        given ones are not taken: the caller frees those it owns.

        below: `tokens` continue the path to this node, which the caller holds locked. If the
        caller alone holds it and nothing continues it, the node grows in place: a request
        whose prompt is cached chunk by chunk stays one node, not a chain of one per chunk."""
        if len(tokens) != len(slots):
            raise ValueError(f"insert: {len(tokens)} tokens but {len(slots)} slots")
        if (draft_slots is not None) != (self.draft_allocator is not None) or (
                draft_slots is not None and len(draft_slots) != len(slots)):
            raise ValueError("insert: draft_slots must name one draft row per token exactly when the tree keeps them")
        cached_slots, node = self.match_prefix(tokens, below)
        cached = len(cached_slots)
        new_drafts = draft_slots[cached:] if draft_slots is not None else None
        cached_drafts = self.path_draft_slots(node)[-cached:] if cached and draft_slots is not None else []
        if cached < len(tokens):
            if node is below and node is not self.root and not node.children and node.lock_count == 1:
                self._grow(node, tokens[cached:], slots[cached:], new_drafts)
            else:
                node = self._add_leaf(node, tokens[cached:], slots[cached:], new_drafts)
        drafts = cached_drafts + new_drafts if draft_slots is not None else None
        return Inserted(cached, cached_slots + slots[cached:], node, drafts)

    def lock(self, node: TreeNode) -> None:
        """A running request's cache ends at `node`: it and its ancestors are kept."""
        start = node
        while node is not self.root:
            if node.lock_count == 0:
                self.evictable_size -= len(node.key)
                self.locked_size += len(node.key)
            node.lock_count += 1
            node = node.parent
        self._refresh_leaf(start)

    def unlock(self, node: TreeNode) -> None:
        start = node
        while node is not self.root:
            if node.lock_count <= 0:
                raise RuntimeError("RadixCache.unlock: a node that is not locked")
            node.lock_count -= 1
            if node.lock_count == 0:
                self.locked_size -= len(node.key)
                self.evictable_size += len(node.key)
            node = node.parent
        self._refresh_leaf(start)

    def evict(self, num_tokens: int) -> int:
        """Frees at least `num_tokens` slots of unlocked leaves, least recently used first
        (fewer if not that many are unlocked); returns how many it freed."""
        order = itertools.count()   # tie-break: nodes themselves do not compare
        heap = [(leaf.last_access, next(order), leaf) for leaf in self._evictable_leaves]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            freed += self._remove_leaf(leaf)
            if parent in self._evictable_leaves:
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        return freed

    def clear(self) -> int:
        """Evicts every unlocked node; returns how many slots that freed."""
        return self.evict(self.evictable_size)

    def held_slots(self, draft: bool = False) -> Iterator[int]:
        """Every slot the tree holds (draft: every draft row), for the accounting check."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield from node.draft_slots if draft else node.slots
            stack.extend(node.children.values())

    def path_slots(self, node: TreeNode, draft: bool = False) -> list[int]:
        """The slots (draft: the draft rows) from the root down to `node`, in token order."""
        parts = []
        while node is not None:
            parts.append(node.draft_slots if draft else node.slots)
            node = node.parent
        return [slot for part in reversed(parts) for slot in part]

    def path_draft_slots(self, node: TreeNode) -> list[int]:
        return self.path_slots(node, draft=True)

    # --- structure ---
    def _split(self, child: TreeNode, length: int) -> TreeNode:
        """Cuts `child`'s edge after `length` tokens; returns the new upper part."""
        drafts = child.draft_slots
        upper = TreeNode(child.key[:length], child.slots[:length], child.parent,
                         drafts[:length] if drafts is not None else None)
        if drafts is not None:
            child.draft_slots = drafts[length:]
        upper.lock_count = child.lock_count   # a lock below also holds what is above it
        upper.last_access = child.last_access
        upper.children[child.key[length]] = child
        child.parent.children[child.key[0]] = upper
        child.key, child.slots, child.parent = child.key[length:], child.slots[length:], upper
        return upper

    def _add_leaf(self, parent: TreeNode, key: list[int], slots: list[int],
                  draft_slots: list[int] | None = None) -> TreeNode:
        leaf = TreeNode(list(key), list(slots), parent, list(draft_slots) if draft_slots is not None else None)
        leaf.last_access = next(self._clock)
        parent.children[key[0]] = leaf
        self.evictable_size += len(key)
        self._refresh_leaf(parent)
        self._refresh_leaf(leaf)
        return leaf

    def _grow(self, node: TreeNode, key: list[int], slots: list[int], draft_slots: list[int] | None = None) -> None:
        """Appends to a locked leaf's edge."""
        node.key.extend(key)
        node.slots.extend(slots)
        if draft_slots is not None:
            node.draft_slots.extend(draft_slots)
        self.locked_size += len(key)

    def _remove_leaf(self, leaf: TreeNode) -> int:
        self.allocator.free(leaf.slots)
        if leaf.draft_slots is not None:
            self.draft_allocator.free(leaf.draft_slots)
        self.evictable_size -= len(leaf.key)
        self._evictable_leaves.discard(leaf)
        parent = leaf.parent
        del parent.children[leaf.key[0]]
        self._refresh_leaf(parent)
        return len(leaf.key)

    def _refresh_leaf(self, node: TreeNode) -> None:
        """Keeps `_evictable_leaves` exact for `node`: an unlocked leaf other than the root."""
        if node is not self.root and not node.children and node.lock_count == 0:
            self._evictable_leaves.add(node)
        else:
            self._evictable_leaves.discard(node)


_BLOCK = 64   # tokens compared at once (list slices compare in C)


def _common_length(key: list[int], tokens: list[int], start: int) -> int:
    """How many leading tokens of `key` equal tokens[start:]."""
    end = start + len(key)
    if end <= len(tokens) and tokens[start:end] == key:
        return len(key)
    length, limit = 0, min(len(key), len(tokens) - start)
    while length + _BLOCK <= limit and key[length:length + _BLOCK] == tokens[start + length:start + length + _BLOCK]:
        length += _BLOCK
    while length < limit and key[length] == tokens[start + length]:
        length += 1
    return length
