"""The pure-Python n-gram trie: the reference the compiled trie (trie.c) is tested
against (tests/test_ngram_trie.py), same behaviour to the node id, and the stand-in
`NgramTrie(config)` returns on a machine without a C compiler. Its ``_token``/``_parent``/...
lists are what the C file's node structs hold.

The data structure and its behaviour (incremental insertion by stream, ranked ``top``
children, CLOCK eviction, owner priority) are described in trie.py; ``gen`` here is
the C file's generation of a reused id.

Layout, for speed in pure Python: a node is an int id into flat lists (token, parent,
count, ...), its children a ``dict[token, id]`` and its ranking a tuple of ids. Containers
of ints only are not tracked by the cyclic garbage collector, so a trie of a million nodes
adds nothing to the collector's full passes (an object per node, parent and child pointing
at each other, made them scan every node and doubled the insertion cost).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Sequence

import numpy as np

from specserve.speculative.ngram.config import NgramConfig

_ROOT = 0
_TOKEN_BITS = 32  # owner follow maps hold (gen << _TOKEN_BITS) | token
_TOKEN_MASK = (1 << _TOKEN_BITS) - 1


class _Stream:
    """Insertion state of one token stream: an owner's history, or one anonymous insert."""

    __slots__ = ("frontier", "tail", "follow", "epoch")

    def __init__(self, epoch: int, with_follow: bool):
        # frontier[k]: node of the k-gram ending at the last token (-1: evicted; [0] = root)
        self.frontier: list[int] = [_ROOT]
        self.tail: list[int] = []  # last max_trie_depth - 1 tokens, to rebuild the frontier
        # node -> (gen << 32) | token that last followed that n-gram here (owner priority)
        self.follow: dict[int, int] | None = {} if with_follow else None
        self.epoch = epoch  # the trie's eviction epoch the frontier is valid for


class PythonNgramTrie:
    def __init__(self, config: NgramConfig):
        self.config = config
        # Per node id; the root is id 0 and is never evicted.
        self._token: list[int] = [-1]
        self._parent: list[int] = [-1]
        self._count: list[int] = [0]
        self._stamp: list[int] = [0]  # clock of the last count increment (LRU, tie-break)
        self._queued: list[int] = [0]  # clock when (re)queued for eviction
        self._gen: list[int] = [0]  # incarnation of a reused id
        self._children: list[dict[int, int] | None] = [{}]
        self._top: list[tuple[int, ...] | None] = [None]  # the root keeps no ranking
        self._free: list[int] = []
        self._queue: deque[int] = deque()  # CLOCK eviction order
        self._num_nodes = 0
        self._clock = 0  # ticks once per inserted token
        self._epoch = 0  # bumped by each eviction: frontiers of older epochs are stale
        self._streams: dict[int, _Stream] = {}
        self.last_match_length = 0  # of the last propose: its longest suffix with a continuation
        self._max_window = config.max_window
        # Tokens fed between capacity checks: bounds the overshoot to capacity / 2.
        self._chunk = max(1, config.capacity // (2 * config.max_trie_depth))
        self._breadths = config.breadth_table()

    # ---------------------------------------------------------------- insertion
    def insert_many(self, streams: Sequence[tuple[int | None, Sequence[int]]]) -> None:
        """As ``NgramTrie.insert_many`` (trie.py)."""
        for owner, tokens in streams:
            self.insert(tokens, owner)

    def insert(self, tokens: Sequence[int], owner: int | None = None) -> None:
        """As ``NgramTrie.insert`` (trie.py)."""
        tokens = _as_list(tokens)
        if owner is None:
            stream = _Stream(self._epoch, with_follow=False)
        else:
            stream = self._streams.get(owner)
            if stream is None:
                stream = self._streams[owner] = _Stream(self._epoch, self.config.owner_priority)
        for start in range(0, len(tokens), self._chunk):
            chunk = tokens[start:start + self._chunk]
            if stream.epoch != self._epoch:
                self._refind_frontier(stream)
            self._feed(stream, chunk)
            stream.tail = (stream.tail + chunk)[1 - self.config.max_trie_depth:]
            if self._num_nodes > self.config.capacity:
                self._evict()

    def _feed(self, stream: _Stream, tokens: list[int]) -> None:
        token_of, parent_of, count, stamp = self._token, self._parent, self._count, self._stamp
        queued, gen, children_of, top_of = self._queued, self._gen, self._children, self._top
        free, queue_append, follow = self._free, self._queue.append, stream.follow
        max_depth, breadth = self.config.max_trie_depth, self.config.max_bfs_breadth
        frontier, clock, created = stream.frontier, self._clock, 0
        for token in tokens:
            clock += 1
            next_frontier = [_ROOT]
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
                        follow[node] = (gen[node] << _TOKEN_BITS) | token
                next_frontier.append(child)
            if len(next_frontier) > max_depth:  # an n-gram of max_depth is not extended
                next_frontier.pop()
            frontier = next_frontier
        stream.frontier = frontier
        self._clock = clock
        self._num_nodes += created

    def _refind_frontier(self, stream: _Stream) -> None:
        """After an eviction, look the stream's frontier up again from its last tokens.
        An n-gram whose node was evicted is not extended any more (-1)."""
        tail = stream.tail
        frontier = [_ROOT]
        for length in range(1, len(tail) + 1):
            node = self._walk(tail, len(tail) - length)
            frontier.append(-1 if node is None else node)
        stream.frontier = frontier
        stream.epoch = self._epoch

    # ---------------------------------------------------------------- eviction
    def _evict(self) -> None:
        """CLOCK over leaves: take the oldest queue entries, newest first (in creation order a
        child follows its parent, so a cold chain goes leaf first and its parent is a leaf by
        its turn); evict a leaf not touched since queued, requeue everything else."""
        target = int(self.config.capacity * self.config.evict_to)
        queue, stamp, queued = self._queue, self._stamp, self._queued
        children_of, top_of, parent_of, token_of = (self._children, self._top, self._parent,
                                                    self._token)
        while self._num_nodes > target and queue:
            batch = [queue.popleft() for _ in range(min(len(queue), self._num_nodes - target))]
            for node in reversed(batch):
                if stamp[node] > queued[node] or children_of[node]:
                    queued[node] = self._clock
                    queue.append(node)
                    continue
                parent = parent_of[node]
                siblings = children_of[parent]
                del siblings[token_of[node]]
                top = top_of[parent]
                if top is not None and node in top:
                    top_of[parent] = self._rank_children(siblings) if siblings else None
                children_of[node] = top_of[node] = None
                self._free.append(node)
                self._num_nodes -= 1
        self._epoch += 1

    def _rank_children(self, children: dict[int, int]) -> tuple[int, ...]:
        count, stamp = self._count, self._stamp
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

    def propose(self, context: Sequence[int], num_draft_tokens: int, one_branch: bool,
                owner: int | None = None) -> tuple[list[int], list[int]]:
        """As ``NgramTrie.propose`` (trie.py)."""
        budget = num_draft_tokens - 1
        self.last_match_length = 0
        if budget <= 0:
            return [], []
        window = _as_list(context[-self._max_window:])
        stream = self._streams.get(owner) if owner is not None else None
        follow = stream.follow if stream is not None else None
        if one_branch:
            return self._chain(window, budget, stream)
        expand_prob = self.config.match_type == "PROB"
        tokens: list[int] = []
        parents: list[int] = []
        reorder, last_count = False, 0
        for node, length in self._matches(window, stream):
            self.last_match_length = max(self.last_match_length, length)  # the first is the longest
            # A shorter suffix seen no more often than the last one expanded has the same
            # continuations (each of its occurrences extends one of the longer's), at most
            # one level deeper: not worth a second expansion.
            if self._count[node] <= last_count:
                continue
            last_count = self._count[node]
            if expand_prob:
                more = self._expand_prob(node, budget, follow)
            else:
                more = self._expand_bfs(node, length, budget, follow)
            if tokens:
                reorder |= _merge(tokens, parents, *more, budget)
            else:
                tokens, parents = more
                reorder = expand_prob  # PROB comes in pop order, not BFS order
            if len(tokens) >= budget:
                break
        return _bfs_order(tokens, parents) if reorder else (tokens, parents)

    def _walk(self, tokens: list[int], start: int) -> int | None:
        node, children_of = _ROOT, self._children
        for i in range(start, len(tokens)):
            children = children_of[node]
            if not children:
                return None
            node = children.get(tokens[i])
            if node is None:
                return None
        return node

    def _matches(self, window: list[int], stream: _Stream | None = None):
        """(node, suffix length) for each suffix of ``window`` that has a continuation,
        longest first, lengths within [min_match_window, max_match_window]."""
        n, children_of = len(window), self._children
        frontier = None
        if stream is not None and stream.epoch == self._epoch:
            tail = stream.tail
            if len(tail) >= n and tail[len(tail) - n:] == window:
                frontier = stream.frontier  # frontier[k]: the node of window[-k:]
        for length in range(min(n, self._max_window), self.config.min_match_window - 1, -1):
            node = frontier[length] if frontier is not None else -1
            if node < 0:
                node = self._walk(window, n - length)
            if node is not None and children_of[node]:
                yield node, length

    def _ranked(self, node: int, follow: dict[int, int]) -> tuple[tuple[int, ...], int | None]:
        """A node with children: its ranking with the owner's own child (if any) first, and
        that child. Slice to the breadth wanted: the ranking can be one longer than top."""
        top = self._top[node]
        last = follow.get(node)
        if last is None or last >> _TOKEN_BITS != self._gen[node]:  # none, or an old id
            return top, None
        own = self._children[node].get(last & _TOKEN_MASK)
        if own is None or own == top[0]:
            return top, own
        return (own,) + tuple(child for child in top if child != own), own

    def _chain(self, window: list[int], budget: int,
               stream: _Stream | None) -> tuple[list[int], list[int]]:
        top_of, token_of = self._top, self._token
        follow = stream.follow if stream is not None else None
        tokens: list[int] = []
        node, self.last_match_length = next(self._matches(window, stream), (None, 0))
        while node is not None and len(tokens) < budget:
            best = top_of[node]
            if best is not None and follow is not None:
                best = self._ranked(node, follow)[0]
            if best:
                node = best[0]
                tokens.append(token_of[node])
            else:
                # Stalled (a leaf or the depth limit): re-match on the context extended by
                # the chain; a match has children, so the next turn appends.
                extended = (window + tokens)[-self._max_window:]
                node = next(self._matches(extended), (None, 0))[0]
        return tokens, list(range(-1, len(tokens) - 1))

    def _expand_bfs(self, match: int, match_length: int, budget: int,
                    follow: dict[int, int] | None) -> tuple[list[int], list[int]]:
        token_of, children_of, top_of = self._token, self._children, self._top
        tokens: list[int] = []
        parents: list[int] = []
        breadths = self._breadths[match_length]
        level_nodes, level_index, level = [match], [-1], 1
        while level_nodes:
            breadth = breadths[level]
            next_nodes, next_index = [], []
            for node, index in zip(level_nodes, level_index):
                ranked = top_of[node] if follow is None else self._ranked(node, follow)[0]
                for child in ranked[:breadth]:
                    tokens.append(token_of[child])
                    parents.append(index)
                    if len(tokens) == budget:
                        return tokens, parents
                    if children_of[child]:
                        next_nodes.append(child)
                        next_index.append(len(tokens) - 1)
            level_nodes, level_index, level = next_nodes, next_index, level + 1
        return tokens, parents

    def _expand_prob(self, match: int, budget: int,
                     follow: dict[int, int] | None) -> tuple[list[int], list[int]]:
        """The ``budget`` likeliest nodes by P(path) = prod count(child) / count(parent), in
        pop order (topological); count(parent) also counts the occurrences that ended there
        (or are the context itself). A node's children are ranked, so their probabilities
        fall with rank: the heap holds one entry per node with unpicked children, its next."""
        breadth, count, token_of, top_of = (self.config.max_bfs_breadth, self._count,
                                            self._token, self._top)
        tokens: list[int] = []
        parents: list[int] = []
        heap: list = []
        pushes = itertools.count()  # ties: the earlier push (parents before children) first

        def push_first_child(node: int, prob: float, index: int) -> None:
            kids, own = (top_of[node], None) if follow is None else self._ranked(node, follow)
            push(node, prob, kids[:breadth], own, 0, index)

        def push(parent: int, parent_prob: float, kids: tuple[int, ...], own: int | None,
                 rank: int, parent_index: int) -> None:
            kid = kids[rank]
            prob = parent_prob if kid == own else parent_prob * count[kid] / count[parent]
            heapq.heappush(heap, (-prob, next(pushes), kid, parent, parent_prob, kids, own, rank,
                                  parent_index))

        push_first_child(match, 1.0, -1)
        while heap and len(tokens) < budget:
            (neg_prob, _, node, parent, parent_prob, kids, own, rank,
             parent_index) = heapq.heappop(heap)
            tokens.append(token_of[node])
            parents.append(parent_index)
            if rank + 1 < len(kids):
                push(parent, parent_prob, kids, own, rank + 1, parent_index)
            if top_of[node] is not None:
                push_first_child(node, -neg_prob, len(tokens) - 1)
        return tokens, parents

    # ---------------------------------------------------------------- bookkeeping
    def release(self, owner: int) -> None:
        """As ``NgramTrie.release`` (trie.py)."""
        self._streams.pop(owner, None)

    def num_nodes(self) -> int:
        """Live nodes, the root not counted."""
        return self._num_nodes


def _as_list(tokens: Sequence[int]) -> list[int]:
    if isinstance(tokens, list):
        return tokens
    to_list = getattr(tokens, "tolist", None)  # numpy / torch: plain ints hash faster
    return to_list() if to_list is not None else list(tokens)


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


def _merge(tokens: list[int], parents: list[int], more_tokens: list[int],
           more_parents: list[int], budget: int) -> bool:
    """Add the nodes of another draft tree (topological order) whose paths are not in
    ``tokens``/``parents`` yet, while there is budget. Returns whether any was added."""
    index_of = {(parent, token): i for i, (token, parent) in enumerate(zip(tokens, parents))}
    mapped: list[int | None] = []  # index in the merged tree, None when left out
    added = False
    for token, parent in zip(more_tokens, more_parents):
        if parent >= 0:
            parent = mapped[parent]
            if parent is None:
                mapped.append(None)
                continue
        index = index_of.get((parent, token))
        if index is None and len(tokens) < budget:
            index = index_of[(parent, token)] = len(tokens)
            tokens.append(token)
            parents.append(parent)
            added = True
        mapped.append(index)
    return added


def _bfs_order(tokens: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
    """Reorder a tree given in topological order into BFS order (stable within a level)."""
    depth: list[int] = []
    for parent in parents:
        depth.append(0 if parent < 0 else depth[parent] + 1)
    order = sorted(range(len(tokens)), key=depth.__getitem__)
    new_index = [0] * len(tokens)
    for new, old in enumerate(order):
        new_index[old] = new
    return ([tokens[old] for old in order],
            [-1 if parents[old] < 0 else new_index[parents[old]] for old in order])
