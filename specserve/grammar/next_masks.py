"""A plain greedy step of constrained requests, run unmasked and its tokens kept to each
request's grammar on the host once they are read.

The masked argmax of a step (the argmax over the tokens the grammar allows) is the model's
own argmax wherever the grammar allows that: no allowed token has larger logits, and torch's
argmax picks the first of tied maxima, so a tied allowed token earlier in the vocabulary would
have been the argmax itself. So on the overlap schedule (engine/overlap.py) a constrained
step is launched on the previous step's unmasked argmax, as an unconstrained one is, and no
mask is filled before a launch: filling the step's masks first (xgrammar: ~70-110 us a mask
inside a string with a maxLength on a 151k vocabulary, ~1 ms a step at 64 requests even on 8
threads on an H200's host) put that fill on the critical path of every step at 64. Once a
step's tokens are read, each constrained request's token is checked by its matcher (an
accept, ~2 us, which the commit then confirms); only where the grammar forbids it is that
request's mask filled, the masked argmax taken from the step's kept logits and committed
instead, and its row of the step launched ahead on the forbidden token cut (the caller's part).
This is greedy drafting's check (greedy_paths.py) on a tree of one node: the same code.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from specserve.grammar.greedy_paths import keep_to_grammar
from specserve.grammar.matcher import RequestGrammar


def keep_plain_to_grammar(grammars: Sequence[RequestGrammar | None], tokens: list[int],
                          logits_at: Callable[[list[int]], torch.Tensor]) -> list[int]:
    """Makes `tokens` (a plain greedy step's unmasked argmax, one per request) the step's masked
    argmax under each request's grammar, in place; logits_at(rows): those rows of the step's
    logits (m, vocab), on its device, asked for only where a grammar forbids its request's
    token. Returns the rows whose token changed."""
    # an allowed token (the common case) is taken ahead in one matcher call; the general walk,
    # several Python calls and arrays a row, runs only for the rows whose grammar forbids theirs
    strayed = [grammar if grammar is not None and not grammar.take_one(token) else None
               for grammar, token in zip(grammars, tokens)]
    if all(grammar is None for grammar in strayed):
        return []
    bs = len(tokens)
    paths = [[token] for token in tokens]
    keep_to_grammar(strayed, paths, np.zeros((bs, 1), dtype=np.int64), np.ones(bs, dtype=np.int64),
                    lambda rows, nodes: logits_at(rows), np.asarray(tokens, dtype=np.int64).reshape(bs, 1),
                    np.full((bs, 1), -1, dtype=np.int64), np.ones(bs, dtype=np.int64))
    changed = [row for row, (path, token) in enumerate(zip(paths, tokens)) if path[0] != token]
    for row in changed:
        tokens[row] = paths[row][0]
    return changed
