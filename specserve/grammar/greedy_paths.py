"""Greedy verification under grammars without a mask at every node.

Plain constrained decoding picks the argmax of the logits over the tokens the grammar
allows. Where the model's own argmax is allowed, that is the same token (ties included:
an allowed token tied with it and earlier in the vocabulary would have been the argmax).
So a greedy step of constrained requests verifies its trees on the device as unconstrained
steps do, unmasked (and can be launched ahead like them), and the host then walks each
request's accepted path with its matcher. Where the grammar allows the whole path, it
stands: no mask was filled. At the first token it forbids (the model strays), the node's
masked argmax is taken instead: the one token its mask allows (a forced key or brace, no
logits needed), else the argmax of its logits under the mask; if a child of that node
drafted this token, the walk goes on down the tree with the children's unmasked argmaxes,
as the device's verification would have with masks. The output is plain constrained
decoding's, token for token; masks are filled only where a request strays, and the
device is read again only for strays whose mask allows several tokens (once for all of
them at each depth).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch

from specserve.grammar.apply import apply_grammar_bitmask
from specserve.grammar.matcher import RequestGrammar

# (rows, nodes) -> (m, vocab) the logits of those requests' nodes, on the step's device
LogitsAt = Callable[[list[int], list[int]], torch.Tensor]


@dataclass
class _Stray:
    """A request's path from where the grammar forbade the model's pick: nodes accepted so far
    (the last one's next token still to pick), the tokens committed before that pick."""
    row: int
    grammar: RequestGrammar
    nodes: list[int]
    tokens: list[int]
    mask: torch.Tensor            # (1, words) what the grammar allows after `tokens`
    pick: int | None = None       # the masked argmax at nodes[-1], once known
    argmaxes: list[int] = field(default_factory=list)   # the request's unmasked argmax at every node


def keep_to_grammar(grammars: Sequence[RequestGrammar | None], tokens: list[list[int]], accepted: np.ndarray,
                    accept_lens: np.ndarray, logits_at: LogitsAt, tree_tokens: np.ndarray,
                    tree_parents: np.ndarray, num_nodes: np.ndarray) -> bool:
    """Makes each constrained request's greedy path (tokens: committed per request, accepted
    drafts then the bonus; accepted (bs, n) its nodes, root first, -1 after; accept_lens (bs,))
    the one masked verification of its tree (tree_*: the step's proposal on the host) gives.
    Changes the three in place; no host sync unless a request strayed from its grammar.
    Returns whether a path took nodes the device's did not (the KV table the device wrote for
    the accepted nodes is then wrong there); a path cut short leaves it right up to its end."""
    strays, rewritten = [], False
    for row, grammar in enumerate(grammars):
        if grammar is None:
            continue
        check = grammar.check_path(tokens[row], keep=True)   # a path it allows: its commit confirms it
        if check.mask is not None:
            position = check.allowed
            strays.append(_Stray(row, grammar, accepted[row, :position + 1].tolist(), tokens[row][:position],
                                 check.mask))
    if not strays:
        return False
    first_nodes = {s.row: len(s.nodes) for s in strays}
    # root-only trees (a plain step's) have no children to walk down: a pick the mask forces
    # needs no read of the device then
    slots = tree_tokens.shape[1]
    _read_picks(strays, logits_at, num_slots=slots if slots > 1 else 0)
    while strays:
        for stray in strays:
            _walk_down(stray, tree_tokens[stray.row], tree_parents[stray.row], int(num_nodes[stray.row]))
        for stray in (s for s in strays if s.mask is None):
            _settle(stray, tokens, accepted, accept_lens)
            rewritten = rewritten or len(stray.nodes) > first_nodes[stray.row]
        strays = [s for s in strays if s.mask is not None]
        _read_picks(strays, logits_at)
    return rewritten


def _read_picks(strays: list[_Stray], logits_at: LogitsAt, num_slots: int = 0) -> None:
    """Each stray's masked argmax at its last node: the mask's one token where it allows one,
    else from the logits (one read of the device for all); with num_slots, also every node's
    unmasked argmax of the strays' trees, in the same read."""
    for stray in strays:
        stray.pick = _only_token(stray.mask)
    reads = [s for s in strays if s.pick is None] if not num_slots else strays
    if not reads:
        return
    logits = logits_at([s.row for s in reads], [s.nodes[-1] for s in reads])
    picks = apply_grammar_bitmask(logits, torch.cat([s.mask for s in reads]).to(logits.device)).argmax(-1, keepdim=True)
    if num_slots:   # the trees' argmaxes: what the device's verification compared the drafts with
        rows = [s.row for s in reads for _ in range(num_slots)]
        argmaxes = logits_at(rows, list(range(num_slots)) * len(reads)).argmax(-1).view(len(reads), num_slots)
        picks = torch.cat([picks, argmaxes], 1)
    for stray, row in zip(reads, picks.tolist()):
        stray.pick = row[0] if stray.pick is None else stray.pick
        stray.argmaxes = row[1:] or stray.argmaxes


def _walk_down(stray: _Stray, tree_tokens: np.ndarray, tree_parents: np.ndarray, num_nodes: int) -> None:
    """Commits the stray's pick and goes down to the child that drafted it, and on while the
    grammar allows the children's argmaxes; stops at the path's end (mask None, pick None) or
    where the grammar forbids an argmax again (a new mask, its pick perhaps still unknown)."""
    while stray.pick is not None:
        stray.tokens.append(stray.pick)
        child = _child_with(stray.nodes[-1], stray.pick, tree_tokens, tree_parents, num_nodes)
        stray.pick, stray.mask = None, None
        if child is None:
            return
        stray.nodes.append(child)
        check = stray.grammar.check_path(stray.tokens + [stray.argmaxes[child]])
        if check.ended and check.allowed == len(stray.tokens):   # the request ends within the path
            stray.nodes.pop()
            return
        if check.mask is None:   # the model's pick is allowed: the masked argmax too
            stray.pick = stray.argmaxes[child]
        else:
            stray.mask = check.mask
            stray.pick = _only_token(check.mask)


def _settle(stray: _Stray, tokens: list[list[int]], accepted: np.ndarray, accept_lens: np.ndarray) -> None:
    row, k = stray.row, len(stray.nodes)
    stray.grammar.take_ahead(stray.tokens)
    tokens[row] = stray.tokens
    accepted[row, :k] = stray.nodes
    accepted[row, k:] = -1
    accept_lens[row] = k


def _child_with(node: int, token: int, tree_tokens: np.ndarray, tree_parents: np.ndarray, num_nodes: int) -> int | None:
    for child in range(node + 1, num_nodes):   # a child comes after its parent
        if tree_parents[child] == node and tree_tokens[child] == token:
            return child
    return None


def _only_token(mask: torch.Tensor) -> int | None:
    """The token a (1, words) mask allows where it allows exactly one, else None."""
    words = mask.numpy().reshape(-1).view(np.uint32)
    set_words = np.flatnonzero(words)
    if len(set_words) != 1:
        return None
    word = int(words[set_words[0]])
    if word & (word - 1):
        return None
    return 32 * int(set_words[0]) + word.bit_length() - 1
