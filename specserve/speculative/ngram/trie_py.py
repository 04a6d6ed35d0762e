"""The pure-Python n-gram trie: the reference the compiled trie (trie.c) is tested
against (tests/test_ngram_trie.py), same behaviour to the node id, and the stand-in
`NgramTrie(config)` returns on a machine without a C compiler. Its nodes are flat lists
(trie_py_nodes.py: what the C file's node structs hold); this file inserts and evicts
them, trie_py_drafts.py proposes from them.

The data structure and its behaviour (incremental insertion by stream, ranked ``top``
children, CLOCK eviction, owner priority) are described in trie.py; ``gen`` here is
the C file's generation of a reused id.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence

import numpy as np

from specserve.speculative.ngram.config import NgramConfig
from specserve.speculative.ngram.forecast import forecast_table
from specserve.speculative.ngram.trie_py_drafts import TrieDrafts
from specserve.speculative.ngram.trie_py_nodes import ROOT, TOKEN_BITS, Stream, TrieNodes, as_list
from specserve.verify.tree import TreeProposal


class PythonNgramTrie:
    def __init__(self, config: NgramConfig):
        self.config = config
        self.nodes = TrieNodes()
        self._free: list[int] = []
        self._queue: deque[int] = deque()  # CLOCK eviction order
        self._num_nodes = 0
        self._clock = 0  # ticks once per inserted token
        self._epoch = 0  # bumped by each eviction: frontiers of older epochs are stale
        self._streams: dict[int, Stream] = {}
        self.last_match_length = 0  # of the last propose: its longest suffix with a continuation
        # Tokens fed between capacity checks: bounds the overshoot to capacity / 2.
        self._chunk = max(1, config.capacity // (2 * config.max_trie_depth))
        self._drafts = TrieDrafts(self.nodes, config)

    # ---------------------------------------------------------------- insertion
    def insert_many(self, streams: Sequence[tuple[int | None, Sequence[int]]]) -> None:
        """As ``NgramTrie.insert_many`` (trie.py)."""
        for owner, tokens in streams:
            self.insert(tokens, owner)

    def insert(self, tokens: Sequence[int], owner: int | None = None) -> None:
        """As ``NgramTrie.insert`` (trie.py)."""
        tokens = as_list(tokens)
        if owner is None:
            stream = Stream(self._epoch, with_follow=False)
        else:
            stream = self._streams.get(owner)
            if stream is None:
                stream = self._streams[owner] = Stream(self._epoch, self.config.owner_priority)
        for start in range(0, len(tokens), self._chunk):
            chunk = tokens[start:start + self._chunk]
            if stream.epoch != self._epoch:
                self._refind_frontier(stream)
            self._feed(stream, chunk)
            stream.tail = (stream.tail + chunk)[1 - self.config.max_trie_depth:]
            if self._num_nodes > self.config.capacity:
                self._evict()

    def _feed(self, stream: Stream, tokens: list[int]) -> None:
        nodes = self.nodes
        token_of, parent_of, count, stamp = nodes.token, nodes.parent, nodes.count, nodes.stamp
        queued, gen, children_of, top_of = nodes.queued, nodes.gen, nodes.children, nodes.top
        free, queue_append, follow = self._free, self._queue.append, stream.follow
        max_depth, breadth = self.config.max_trie_depth, self.config.max_bfs_breadth
        frontier, clock, created = stream.frontier, self._clock, 0
        for token in tokens:
            clock += 1
            next_frontier = [ROOT]
            for node in frontier:
                if node < 0:
                    next_frontier.append(-1)
                    continue
                children = children_of[node]
                if children is None:
                    children = children_of[node] = {}
                child = children.get(token)
                if child is None:
                    if free:
                        child = free.pop()
                        token_of[child], parent_of[child], count[child] = token, node, 1
                        stamp[child] = queued[child] = clock
                        gen[child] += 1
                    else:
                        child = len(token_of)
                        token_of.append(token)
                        parent_of.append(node)
                        count.append(1)
                        stamp.append(clock)
                        queued.append(clock)
                        gen.append(0)
                        children_of.append(None)
                        top_of.append(None)
                    children[token] = child
                    queue_append(child)
                    created += 1
                else:
                    count[child] += 1
                    stamp[child] = clock
                if node:  # the root keeps no ranking and no follow: no match stops there
                    top = top_of[node]
                    if top is None or top[0] != child:
                        top_of[node] = _promoted(top, child, count, breadth)
                    if follow is not None:
                        follow[node] = (gen[node] << TOKEN_BITS) | token
                next_frontier.append(child)
            if len(next_frontier) > max_depth:  # an n-gram of max_depth is not extended
                next_frontier.pop()
            frontier = next_frontier
        stream.frontier = frontier
        self._clock = clock
        self._num_nodes += created

    def _refind_frontier(self, stream: Stream) -> None:
        """After an eviction, look the stream's frontier up again from its last tokens.
        An n-gram whose node was evicted is not extended any more (-1)."""
        tail = stream.tail
        frontier = [ROOT]
        for length in range(1, len(tail) + 1):
            node = self.nodes.walk(tail, len(tail) - length)
            frontier.append(-1 if node is None else node)
        stream.frontier = frontier
        stream.epoch = self._epoch

    # ---------------------------------------------------------------- eviction
    def _evict(self) -> None:
        """CLOCK over leaves: take the oldest queue entries, newest first (in creation order a
        child follows its parent, so a cold chain goes leaf first and its parent is a leaf by
        its turn); evict a leaf not touched since queued, requeue everything else."""
        target = int(self.config.capacity * self.config.evict_to)
        nodes, queue = self.nodes, self._queue
        stamp, queued, children_of, top_of = nodes.stamp, nodes.queued, nodes.children, nodes.top
        while self._num_nodes > target and queue:
            batch = [queue.popleft() for _ in range(min(len(queue), self._num_nodes - target))]
            for node in reversed(batch):
                if stamp[node] > queued[node] or children_of[node]:
                    queued[node] = self._clock
                    queue.append(node)
                    continue
                parent = nodes.parent[node]
                siblings = children_of[parent]
                del siblings[nodes.token[node]]
                top = top_of[parent]
                if top is not None and node in top:
                    top_of[parent] = self._rank_children(siblings) if siblings else None
                children_of[node] = top_of[node] = None
                self._free.append(node)
                self._num_nodes -= 1
        self._epoch += 1

    def _rank_children(self, children: dict[int, int]) -> tuple[int, ...]:
        count, stamp = self.nodes.count, self.nodes.stamp
        return tuple(heapq.nlargest(self.config.max_bfs_breadth, children.values(),
                                    key=lambda child: (count[child], stamp[child])))

    # ---------------------------------------------------------------- proposal
    def propose_batch(self, contexts: Sequence[Sequence[int]], budgets: Sequence[int], one_branch: bool,
                      owners: Sequence[int | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """As ``NgramTrie.propose_batch`` (trie.py): ``propose`` per request."""
        batch, width = len(contexts), max(budgets)
        tokens, parents = np.zeros((batch, width), dtype=np.int64), np.full((batch, width), -1, dtype=np.int64)
        num_nodes, match_lengths = np.ones(batch, dtype=np.int64), np.zeros(batch, dtype=np.int64)
        for row, (context, budget, owner) in enumerate(zip(contexts, budgets, owners)):
            drafts, draft_parents = self.propose(context, budget, one_branch, owner)
            tokens[row, 0] = context[-1]
            tokens[row, 1:1 + len(drafts)] = drafts
            parents[row, 1:1 + len(drafts)] = np.asarray(draft_parents, dtype=np.int64) + 1
            num_nodes[row] += len(drafts)
            match_lengths[row] = self.last_match_length
        return tokens, parents, num_nodes, match_lengths

    def forecast(self, contexts: Sequence[Sequence[int]], owners: Sequence[int], proposal: TreeProposal,
                 nodes: int, candidates: int, one_branch: bool, key_cap: int) -> np.ndarray:
        """As ``NgramTrie.forecast`` (trie.py): forecast.py's loops over propose_batch."""
        return forecast_table(self, contexts, owners, proposal, nodes, candidates, one_branch, key_cap)

    def propose(self, context: Sequence[int], num_draft_tokens: int, one_branch: bool,
                owner: int | None = None) -> tuple[list[int], list[int]]:
        """As ``NgramTrie.propose`` (trie.py)."""
        stream = self._streams.get(owner) if owner is not None else None
        tokens, parents, self.last_match_length = self._drafts.propose(context, num_draft_tokens, one_branch,
                                                                        stream, self._epoch)
        return tokens, parents

    # ---------------------------------------------------------------- bookkeeping
    def release(self, owner: int) -> None:
        """As ``NgramTrie.release`` (trie.py)."""
        self._streams.pop(owner, None)

    def num_nodes(self) -> int:
        """Live nodes, the root not counted."""
        return self._num_nodes


def _promoted(top: tuple[int, ...] | None, child: int, count: list[int],
              breadth: int) -> tuple[int, ...]:
    """``top`` after ``child``'s count grew by one. ``child`` is the most recently updated,
    so it goes before every child of equal count."""
    if top is None:
        return (child,)
    child_count = count[child]
    if child in top:
        rest = [other for other in top if other != child]
    elif len(top) < breadth:
        rest = list(top)
    elif count[top[-1]] > child_count:
        return top
    else:
        rest = list(top[:-1])
    i = 0
    for other in rest:
        if count[other] <= child_count:
            break
        i += 1
    rest.insert(i, child)
    return tuple(rest)
