"""TrieDrafts: the pure-Python n-gram trie's proposals (trie_py.py), read from its nodes
(trie_py_nodes.py): the suffixes of a request's tokens that the trie has seen continued,
longest first, each expanded into a draft tree (BFS by ranked children, or PROB: the
likeliest paths), or one chain; an owner's own continuation ranked first."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence

from specserve.speculative.ngram.config import NgramConfig
from specserve.speculative.ngram.trie_py_nodes import TOKEN_BITS, TOKEN_MASK, Stream, TrieNodes, as_list


class TrieDrafts:
    def __init__(self, nodes: TrieNodes, config: NgramConfig):
        self.nodes, self.config = nodes, config
        self.max_window = config.max_window
        self.breadths = config.breadth_table()

    def propose(self, context: Sequence[int], num_draft_tokens: int, one_branch: bool, stream: Stream | None,
                epoch: int) -> tuple[list[int], list[int], int]:
        """As ``NgramTrie.propose`` (trie.py), with the longest suffix matched; ``stream``:
        the owner's, if any (its frontier read where still of this eviction ``epoch``)."""
        budget = num_draft_tokens - 1
        if budget <= 0:
            return [], [], 0
        window = as_list(context[-self.max_window:])
        follow = stream.follow if stream is not None else None
        current = stream if stream is not None and stream.epoch == epoch else None
        if one_branch:
            return self._chain(window, budget, current, follow)
        expand_prob = self.config.match_type == "PROB"
        tokens: list[int] = []
        parents: list[int] = []
        reorder, last_count, match_length = False, 0, 0
        count = self.nodes.count
        for node, length in self._matches(window, current):
            match_length = max(match_length, length)  # the first is the longest
            # A shorter suffix seen no more often than the last one expanded has the same
            # continuations (each of its occurrences extends one of the longer's), at most
            # one level deeper: not worth a second expansion.
            if count[node] <= last_count:
                continue
            last_count = count[node]
            if expand_prob:
                more = self._expand_prob(node, budget, follow)
            else:
                more = self._expand_bfs(node, length, budget, follow)
            if tokens:
                reorder |= merge(tokens, parents, *more, budget)
            else:
                tokens, parents = more
                reorder = expand_prob  # PROB comes in pop order, not BFS order
            if len(tokens) >= budget:
                break
        tokens, parents = bfs_order(tokens, parents) if reorder else (tokens, parents)
        return tokens, parents, match_length

    def _matches(self, window: list[int], stream: Stream | None = None):
        """(node, suffix length) for each suffix of ``window`` that has a continuation,
        longest first, lengths within [min_match_window, max_match_window]; ``stream``: one
        whose frontier is current."""
        n, children_of = len(window), self.nodes.children
        frontier = None
        if stream is not None:
            tail = stream.tail
            if len(tail) >= n and tail[len(tail) - n:] == window:
                frontier = stream.frontier  # frontier[k]: the node of window[-k:]
        for length in range(min(n, self.max_window), self.config.min_match_window - 1, -1):
            node = frontier[length] if frontier is not None else -1
            if node < 0:
                node = self.nodes.walk(window, n - length)
            if node is not None and children_of[node]:
                yield node, length

    def _ranked(self, node: int, follow: dict[int, int]) -> tuple[tuple[int, ...], int | None]:
        """A node with children: its ranking with the owner's own child (if any) first, and
        that child. Slice to the breadth wanted: the ranking can be one longer than top."""
        top = self.nodes.top[node]
        last = follow.get(node)
        if last is None or last >> TOKEN_BITS != self.nodes.gen[node]:  # none, or an old id
            return top, None
        own = self.nodes.children[node].get(last & TOKEN_MASK)
        if own is None or own == top[0]:
            return top, own
        return (own,) + tuple(child for child in top if child != own), own

    def _chain(self, window: list[int], budget: int, stream: Stream | None,
               follow: dict[int, int] | None) -> tuple[list[int], list[int], int]:
        top_of, token_of = self.nodes.top, self.nodes.token
        tokens: list[int] = []
        node, match_length = next(self._matches(window, stream), (None, 0))
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
                extended = (window + tokens)[-self.max_window:]
                node = next(self._matches(extended), (None, 0))[0]
        return tokens, list(range(-1, len(tokens) - 1)), match_length

    def _expand_bfs(self, match: int, match_length: int, budget: int,
                    follow: dict[int, int] | None) -> tuple[list[int], list[int]]:
        token_of, children_of, top_of = self.nodes.token, self.nodes.children, self.nodes.top
        tokens: list[int] = []
        parents: list[int] = []
        breadths = self.breadths[match_length]
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
        breadth, count, token_of, top_of = (self.config.max_bfs_breadth, self.nodes.count,
                                            self.nodes.token, self.nodes.top)
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


def merge(tokens: list[int], parents: list[int], more_tokens: list[int],
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


def bfs_order(tokens: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
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
