"""NGRAM / LOOKAHEAD drafter: draft trees from the shared n-gram trie (model-free).

The trie is fed every prompt when it arrives and every committed token; each request is an
owner of its own stream, so its own prompt and output rank first when it is drafted for.
Prompts and committed tokens are queued and indexed in `flush`, which the engine calls
right after launching a forward: indexing costs ~2-5 us per token of host time (at 64
requests, milliseconds per step; a batch of long prompts, more than their prefill), so it
runs while the GPU computes, in chunks, for as long as the GPU is busy, and what is left
waits for the next step (a finished request's stream is let go once its tokens are in). A
proposal therefore misses at least the tokens of the step just before it, which have no
continuation to offer yet anyway. Plain steps that do not probe skip the flush (adaptive.py),
so a request's tokens queue up over several steps: they are queued per request and indexed
in one trie call each (one call costs about as much as indexing a few tokens).
"""
from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Callable

import numpy as np

from specserve.speculative.drafter import Drafter
from specserve.speculative.ngram_trie import NgramConfig, NgramTrie
from specserve.speculative.tree import TreeProposal

if TYPE_CHECKING:
    from specserve.args import ServerArgs
    from specserve.engine.request import Req


MATCH_KEY_CAP = 6         # suffix matches this long or longer count as one evidence class
FLUSH_CHUNK = 32          # tokens indexed between two checks of whether the GPU is still busy
MAX_BACKLOG = 65536       # queued tokens beyond which flush indexes everything at once


class NgramDrafter(Drafter):
    def __init__(self, config: NgramConfig, one_branch: bool):
        self.config = config
        self.trie = NgramTrie(config)
        self.one_branch = one_branch
        self.window = config.max_match_window
        self._owners: dict[str, int] = {}
        self._next_owner = itertools.count()
        # owner -> its tokens not indexed yet, in order (an owner's stream must be fed in
        # order); owners in the order their oldest queued token arrived
        self._pending: dict[int, list[int]] = {}
        self._pending_tokens = 0
        self._finished: set[int] = set()    # owners released while tokens of theirs were queued
        self._keys: list[int] = []

    @classmethod
    def from_args(cls, args: "ServerArgs") -> "NgramDrafter":
        config = NgramConfig(
            capacity=args.speculative_ngram_capacity,
            min_match_window=args.speculative_ngram_min_match_window_size,
            max_match_window=args.speculative_ngram_max_match_window_size,
            min_bfs_breadth=args.speculative_ngram_min_bfs_breadth,
            max_bfs_breadth=args.speculative_ngram_max_bfs_breadth,
            max_trie_depth=args.speculative_ngram_max_trie_depth,
            match_type=args.speculative_ngram_match_type)
        return cls(config, args.speculative_one_branch)

    def scratch(self) -> "NgramDrafter":
        """An empty trie of the same configuration."""
        return NgramDrafter(self.config, self.one_branch)

    def add_prompt(self, req: "Req") -> None:
        self._queue(self._owner(req), req.prompt_ids)

    def propose(self, reqs: list["Req"], max_nodes: list[int]) -> tuple[TreeProposal, list[int]]:
        """One trie call for the whole batch (a call per request costs more than drafting)."""
        window = self.window
        contexts = [_tail(req, window) for req in reqs]
        owners = [self._owner(req) for req in reqs]
        tokens, parents, num_nodes, match_lengths = self.trie.propose_batch(contexts, max_nodes, self.one_branch, owners)
        self._keys = np.minimum(match_lengths, MATCH_KEY_CAP).tolist()
        n = int(num_nodes.max())
        # copies: the trie reuses its output buffers
        proposal = TreeProposal(tokens[:, :n].copy(), parents[:, :n].copy(), num_nodes.copy())
        return proposal, num_nodes.tolist()

    def proposal_keys(self) -> list[int]:
        """The length of each proposal's matched suffix (capped): a one-token match is weak
        evidence, a long one strong."""
        return self._keys

    def observe(self, req: "Req", committed: list[int]) -> None:
        self._queue(self._owner(req), committed)

    def _queue(self, owner: int, tokens: list[int]) -> None:
        if not tokens:
            return
        queued = self._pending.get(owner)
        if queued is None:
            self._pending[owner] = list(tokens)   # a copy: the caller's list may grow (a prompt's)
        else:
            queued.extend(tokens)
        self._pending_tokens += len(tokens)

    def flush(self, busy: Callable[[], bool] | None = None) -> None:
        """Indexes queued tokens: all of them, or, given `busy`, chunk by chunk until it
        returns False (at least one chunk, and all once the backlog grows too long)."""
        while self._pending:
            owner, tokens = next(iter(self._pending.items()))
            chunk = tokens if busy is None or len(tokens) <= FLUSH_CHUNK else tokens[:FLUSH_CHUNK]
            self.trie.insert(chunk, owner=owner)
            self._pending_tokens -= len(chunk)
            if len(chunk) < len(tokens):
                del tokens[:len(chunk)]   # the owner keeps its place in the queue
            else:
                del self._pending[owner]
                self._indexed_all(owner)
            if busy is not None and not busy() and self._pending_tokens < MAX_BACKLOG:
                return

    def _indexed_all(self, owner: int) -> None:
        """The owner's queued tokens are in: a finished owner's stream can go."""
        if owner in self._finished:
            self._finished.discard(owner)
            self.trie.release(owner)

    def release(self, req: "Req") -> None:
        """Its stream is let go now, or once its queued tokens are indexed (they continue it)."""
        owner = self._owners.pop(req.rid, None)
        if owner is None:
            return
        if owner in self._pending:
            self._finished.add(owner)
        else:
            self.trie.release(owner)

    def _owner(self, req: "Req") -> int:
        owner = self._owners.get(req.rid)
        if owner is None:
            owner = self._owners[req.rid] = next(self._next_owner)
        return owner


def _tail(req: "Req", length: int) -> list[int]:
    """The last `length` tokens of prompt + output, without copying the whole history."""
    output = req.output_ids
    if len(output) >= length:
        return output[-length:]
    return req.prompt_ids[len(output) - length:] + output
