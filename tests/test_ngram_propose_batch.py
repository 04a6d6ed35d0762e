"""NgramTrie.propose_batch (one C call for a whole batch) gives, row by row, what propose gives
per request, root first; the pure-Python trie's propose_batch gives the same arrays; the
NGRAM drafter's proposals are built from it."""
from __future__ import annotations

import random

import numpy as np
import pytest

from specserve.speculative.ngram.drafter import NgramDrafter
from specserve.speculative.ngram.trie import NgramConfig, NgramTrie
from specserve.speculative.ngram.trie_py import PythonNgramTrie


def filled_tries(seed: int) -> tuple[NgramTrie, PythonNgramTrie, dict[int, list[int]]]:
    rng = random.Random(seed)
    config = NgramConfig(capacity=400, max_bfs_breadth=3, max_trie_depth=6)
    fast, reference = NgramTrie(config), PythonNgramTrie(config)
    streams: dict[int, list[int]] = {}
    for _ in range(40):
        owner = rng.randrange(6)
        tokens = [rng.randrange(12) for _ in range(rng.randint(1, 15))]
        for trie in (fast, reference):
            trie.insert(tokens, owner)
        streams[owner] = streams.get(owner, []) + tokens
    return fast, reference, streams


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("one_branch", [False, True])
def test_batch_rows_equal_single_proposals(seed, one_branch):
    fast, reference, streams = filled_tries(seed)
    rng = random.Random(100 + seed)
    owners = [rng.choice([None, 7, *streams]) for _ in range(9)]   # 7: an owner the trie never saw
    contexts = [(streams.get(o) or [rng.randrange(12)])[-rng.randint(1, 30):] for o in owners]
    budgets = [rng.choice([1, 2, 5, 8, 16]) for _ in owners]
    tokens, parents, num_nodes, lengths = fast.propose_batch(contexts, budgets, one_branch, owners)
    assert tokens.shape == parents.shape == (len(owners), max(budgets))
    for row, (context, budget, owner) in enumerate(zip(contexts, budgets, owners)):
        drafts, draft_parents = fast.propose(context, budget, one_branch, owner if owner in streams else None)
        count = len(drafts)
        assert num_nodes[row] == count + 1 <= budget
        assert tokens[row, :count + 1].tolist() == [context[-1], *drafts]
        assert parents[row, :count + 1].tolist() == [-1, *(p + 1 for p in draft_parents)]
        assert (tokens[row, count + 1:] == 0).all() and (parents[row, count + 1:] == -1).all()
        assert lengths[row] == fast.last_match_length
    expected = reference.propose_batch(contexts, budgets, one_branch, owners)
    for got, want in zip((tokens, parents, num_nodes, lengths), expected):
        np.testing.assert_array_equal(got, want)


def test_drafter_proposal_comes_from_the_batch_call():
    class Req:
        def __init__(self, rid, prompt):
            self.rid, self.prompt_ids, self.output_ids = rid, prompt, []

    drafter = NgramDrafter(NgramConfig(), one_branch=False)
    reqs = [Req("a", [1, 2, 3, 4, 5, 1, 2, 3]), Req("b", [9, 8, 7, 9, 8]), Req("c", [40])]
    for req in reqs:
        drafter.add_prompt(req)
    drafter.flush()
    limits = [8, 3, 8]
    proposal, num_nodes = drafter.propose(reqs, limits)
    for row, (req, limit) in enumerate(zip(reqs, limits)):
        drafts, parents = drafter.trie.propose(req.prompt_ids, limit, False, owner=drafter._owner(req))
        assert num_nodes[row] == 1 + len(drafts)
        assert proposal.tokens[row, :num_nodes[row]].tolist() == [req.prompt_ids[-1], *drafts]
        assert proposal.parents[row, :num_nodes[row]].tolist() == [-1, *(p + 1 for p in parents)]
    assert num_nodes[0] > 3 and num_nodes[1] == 3 and num_nodes[2] == 1   # b: 8 -> 7 9; c: never seen continued
    assert proposal.num_slots == max(num_nodes) and drafter.proposal_keys()[2] == 0
