"""The pure-Python n-gram trie's nodes (trie_py.py inserts and evicts them, trie_py_drafts.py
proposes from them): flat lists by node id, what the C file's node structs hold, and the
insertion state of one token stream.

Layout, for speed in pure Python: a node is an int id into flat lists (token, parent,
count, ...), its children a ``dict[token, id]`` and its ranking a tuple of ids. Containers
of ints only are not tracked by the cyclic garbage collector, so a trie of a million nodes
adds nothing to the collector's full passes (an object per node, parent and child pointing
at each other, made them scan every node and doubled the insertion cost).
"""

from __future__ import annotations

ROOT = 0
TOKEN_BITS = 32  # owner follow maps hold (gen << TOKEN_BITS) | token
TOKEN_MASK = (1 << TOKEN_BITS) - 1


class TrieNodes:
    """Per node id; the root is id 0 and is never evicted."""

    __slots__ = ("token", "parent", "count", "stamp", "queued", "gen", "children", "top")

    def __init__(self) -> None:
        self.token: list[int] = [-1]
        self.parent: list[int] = [-1]
        self.count: list[int] = [0]
        self.stamp: list[int] = [0]  # clock of the last count increment (LRU, tie-break)
        self.queued: list[int] = [0]  # clock when (re)queued for eviction
        self.gen: list[int] = [0]  # incarnation of a reused id
        self.children: list[dict[int, int] | None] = [{}]
        self.top: list[tuple[int, ...] | None] = [None]  # the root keeps no ranking

    def walk(self, tokens: list[int], start: int) -> int | None:
        """The node of the n-gram ``tokens[start:]``, None if the trie lacks it."""
        node, children_of = ROOT, self.children
        for i in range(start, len(tokens)):
            children = children_of[node]
            if not children:
                return None
            node = children.get(tokens[i])
            if node is None:
                return None
        return node


class Stream:
    """Insertion state of one token stream: an owner's history, or one anonymous insert."""

    __slots__ = ("frontier", "tail", "follow", "epoch")

    def __init__(self, epoch: int, with_follow: bool):
        # frontier[k]: node of the k-gram ending at the last token (-1: evicted; [0] = root)
        self.frontier: list[int] = [ROOT]
        self.tail: list[int] = []  # last max_trie_depth - 1 tokens, to rebuild the frontier
        # node -> (gen << 32) | token that last followed that n-gram here (owner priority)
        self.follow: dict[int, int] | None = {} if with_follow else None
        self.epoch = epoch  # the trie's eviction epoch the frontier is valid for


def as_list(tokens) -> list[int]:
    if isinstance(tokens, list):
        return tokens
    to_list = getattr(tokens, "tolist", None)  # numpy / torch: plain ints hash faster
    return to_list() if to_list is not None else list(tokens)
