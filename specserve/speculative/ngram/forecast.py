"""The n-gram trie's forecast for the step after a verify step (runner/forecast_step.py's
table), made while that step runs: for every node j of each request's tree (the context is
then the request's tokens and the tree's path to j) the trie's likeliest next tokens other
than j's children (had one of them been the target's token, j would not be the last node
accepted), each with the tree the trie would propose after it. The compiled trie makes the
table in one C call (trie.c's ngt_forecast); `forecast_table` is the same in Python over
two batched proposals (the candidates, then their trees), for the pure-Python trie and as
the C call's reference.

Replayed without a model (`lab.ngram_forecast`, greedy answers of code edits and ShareGPT
second turns, chains of 4-8 drafts, 2 candidates): the outcome found its entry in 77-94% of
steps on code edits and ~20% on chat, and the forecast committed 83-98% of the tokens a step
that proposals made after the read did.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from specserve.runner.forecast_step import empty_table, set_entry
from specserve.verify.tree import TreeProposal

# nodes asked of the trie per first-level candidate wanted: after a long match the trie expands
# that match's one continuation in depth before the shorter suffixes' alternatives (the bonus
# token after a rejected draft is one of those), so a budget of one node a candidate finds none
CANDIDATE_SPAN = 4


class BatchProposals(Protocol):
    """What the forecast asks of a trie (trie.py's and trie_py.py's, which import this file)."""

    def propose_batch(self, contexts: Sequence[Sequence[int]], budgets: Sequence[int], one_branch: bool,
                      owners: Sequence[int | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]: ...


def forecast_table(trie: BatchProposals, contexts: Sequence[Sequence[int]], owners: Sequence[int],
                   proposal: TreeProposal, nodes: int, candidates: int, one_branch: bool,
                   key_cap: int) -> np.ndarray:
    """The table for the step after `proposal`'s (contexts[b]: request b's last tokens, its
    root last), next trees of up to `nodes` nodes, `candidates` bonus tokens a node. The
    caller holds the trie's lock and has drained its writer."""
    bs, m = proposal.tokens.shape
    table = empty_table(bs, m, candidates, nodes)
    places, after, budgets, excluded = [], [], [], []   # one per (request, node)
    for b in range(bs):
        tokens, parents = proposal.tokens[b].tolist(), proposal.parents[b].tolist()
        count = int(proposal.num_nodes[b])
        paths: list[list[int]] = [[]]
        children: list[set[int]] = [set() for _ in range(count)]
        for j in range(1, count):
            paths.append(paths[parents[j]] + [tokens[j]])
            children[parents[j]].add(tokens[j])
        for j in range(count):
            places.append((b, j))
            after.append(list(contexts[b]) + paths[j])
            excluded.append(children[j])
            budgets.append(1 + CANDIDATE_SPAN * (candidates + len(children[j])))
    found = trie.propose_batch(after, budgets, False, [owners[b] for b, _ in places])
    cand_tokens, cand_parents, cand_counts = (array.tolist() for array in found[:3])   # lists: fast to walk
    firsts = []   # (row of `after`, b, j, c, bonus token)
    for row, (b, j) in enumerate(places):
        chosen, tokens, parents = 0, cand_tokens[row], cand_parents[row]
        for i in range(1, cand_counts[row]):
            token = tokens[i]
            if parents[i] == 0 and token not in excluded[row]:
                firsts.append((row, b, j, chosen, token))
                chosen += 1
                if chosen == candidates:
                    break
    if not firsts:
        return table
    trees = trie.propose_batch([after[row] + [token] for row, *_, token in firsts],
                               [nodes] * len(firsts), one_branch, [owners[b] for _, b, *_ in firsts])
    tree_tokens, tree_parents, tree_counts, match_lengths = trees
    for row, (_, b, j, c, token) in enumerate(firsts):
        count = int(tree_counts[row])
        set_entry(table, b, j, c, token, tree_tokens[row, 1:count], tree_parents[row, 1:count],
                  min(int(match_lengths[row]), key_cap))
    return table
