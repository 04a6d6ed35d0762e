"""The grammar's bitmasks for a step's draft trees, and the pruning of drafts it forbids.

Every node's logits predict the token after the path root -> node, so each node is masked
by the matcher state after that path (RequestGrammar.fill_tree walks the tree with accept
and roll back). Sampled verification then draws from the masked distribution (greedy
verification needs no mask per node: greedy_paths.py). A draft token the grammar forbids at
its parent can never be accepted: `prune_proposal` cuts it and its subtree before the step
runs, so it costs neither a KV slot nor a forward position. Pruning asks the matcher about
each draft token only (an accept and a roll back, microseconds), not for a node's mask (a
pass over the vocabulary, ~10-70 us inside a JSON schema).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from specserve.grammar.matcher import bitmask_words
from specserve.verify.tree import TreeProposal

ALL_ALLOWED = -1   # an int32 word with every bit set


def grammar_bitmask(reqs: Sequence, tokens: np.ndarray, parents: np.ndarray, num_nodes: np.ndarray,
                    vocab_size: int, pinned: bool = False) -> torch.Tensor:
    """(bs, n, words) int32 on the host: the tokens allowed after each node. Requests without
    a grammar, padding nodes, nodes the grammar forbids (never accepted: their parent's mask
    excludes them) and nodes after the grammar's end (never committed: the request ends
    there) allow every token, so that no row of logits is masked out entirely."""
    bs, n = tokens.shape
    out = torch.full((bs, n, bitmask_words(vocab_size)), ALL_ALLOWED, dtype=torch.int32, pin_memory=pinned)
    for row, req in enumerate(reqs):
        if req.grammar is not None:
            masks = _tree_masks(req.grammar, tokens[row], parents[row], int(num_nodes[row]), out.shape[-1])
            nothing_allowed = ~masks.any(dim=1)
            masks[nothing_allowed] = ALL_ALLOWED
            out[row, :len(masks)] = masks
    return out


def prune_proposal(reqs: Sequence, proposal: TreeProposal, rows: Sequence[bool] | None = None) -> TreeProposal:
    """The proposal without the draft nodes a request's grammar forbids (each cut with its
    subtree), in the trees of `rows` (default: all); trees of requests without a grammar are
    kept whole."""
    keep = np.arange(proposal.num_slots)[None, :] < proposal.num_nodes[:, None]     # (bs, n)
    for row, req in enumerate(reqs):
        k = int(proposal.num_nodes[row])
        if req.grammar is not None and k > 1 and (rows is None or rows[row]):
            keep[row, :k] = allowed_nodes(req.grammar, proposal.tokens[row], proposal.parents[row], k)
    if keep.sum() == proposal.num_nodes.sum():
        return proposal
    return proposal.keep(keep)


def allowed_nodes(grammar, tokens: np.ndarray, parents: np.ndarray, num_nodes: int) -> np.ndarray:
    """(num_nodes,) bool: whether the grammar allows every token on the path root -> node
    (the root's is committed already; nothing after the grammar's end). The matcher's state
    is unchanged: the walk accepts each path's tokens and rolls them back."""
    first_child, next_sibling = child_links(parents, num_nodes)
    keep = np.zeros(num_nodes, dtype=bool)
    keep[0] = True
    stack = [int(first_child[0])]   # the next child to try at each depth of the path
    while stack:
        node = stack[-1]
        if node < 0:   # every child of this depth's parent tried: back to it
            stack.pop()
            if stack:
                grammar.rollback(1)
                stack[-1] = int(next_sibling[stack[-1]])
        elif grammar.terminated:   # nothing follows the grammar's end
            stack[-1] = -1
        elif grammar.accept(int(tokens[node])):
            keep[node] = True
            stack.append(int(first_child[node]))
        else:
            stack[-1] = int(next_sibling[node])
    return keep


def token_allowed(mask: np.ndarray, token: int) -> bool:
    """Whether bit `token` of an int32 bitmask row is set."""
    return token < 32 * len(mask) and bool((int(mask[token >> 5]) >> (token & 31)) & 1)


def _tree_masks(grammar, tokens: np.ndarray, parents: np.ndarray, num_nodes: int, words: int) -> torch.Tensor:
    """(num_nodes, words) of one tree, nodes the walk does not reach all zero."""
    first_child, next_sibling = child_links(parents, num_nodes)
    masks = torch.zeros((num_nodes, words), dtype=torch.int32)
    grammar.fill_tree(np.asarray(tokens[:num_nodes]), first_child, next_sibling, masks)
    return masks


def child_links(parents: np.ndarray, num_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    """(first_child, next_sibling) of one tree's first num_nodes nodes, -1 for none; children
    in node order (the order verification tries them)."""
    first_child = np.full(num_nodes, -1, dtype=np.int64)
    next_sibling = np.full(num_nodes, -1, dtype=np.int64)
    last_child = {}
    for node in range(1, num_nodes):
        parent = int(parents[node])
        if parent in last_child:
            next_sibling[last_child[parent]] = node
        else:
            first_child[parent] = node
        last_child[parent] = node
    return first_child, next_sibling
