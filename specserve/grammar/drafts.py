"""A drafting step's trees under the requests' grammars: drafts a grammar forbids cut before
the step (tree_masks.prune_proposal), and drafts the grammar writes itself: where a
constrained request's tree holds only its root (the drafter had nothing, or the grammar
forbade all it had), the tokens the grammar forces next (a JSON key, `": "`, a closing
brace) become a chain to verify. They cost a verify node each and are accepted wherever the
model would have written them anyway."""
from __future__ import annotations

from typing import Sequence

from specserve.grammar.tree_masks import prune_proposal
from specserve.verify.tree import TreeProposal


def constrain_proposal(reqs: Sequence, proposal: TreeProposal, limits: Sequence[int],
                       masked: Sequence[bool]) -> TreeProposal:
    """The proposal a step verifies for these requests, some with a grammar: pruned where a
    request's verification masks every node (masked[i]: it samples), then forced chains where a
    tree is left with its root alone (limits: nodes per request). A greedy request's tree is
    not pruned: its path is kept to its grammar after an unmasked verification
    (greedy_paths.py), where a forbidden draft costs a verified node, less than the walk that
    finds it (~2-3 ms of host time a step at 64 trees of 8 nodes)."""
    return add_forced_drafts(reqs, prune_proposal(reqs, proposal, masked), limits)


def add_forced_drafts(reqs: Sequence, proposal: TreeProposal, limits: Sequence[int]) -> TreeProposal:
    """The proposal with forced chains in the root-only trees of grammar requests, each at
    most limits[i] nodes, root included."""
    rows, changed = [], False
    for row, req in enumerate(reqs):
        count = int(proposal.num_nodes[row])
        tokens, parents = proposal.tokens[row, :count].tolist(), proposal.parents[row, :count].tolist()
        if req.grammar is not None and count == 1 and limits[row] > 1:
            forced = req.grammar.forced_tokens()[:limits[row] - 1]
            tokens += forced
            parents += list(range(len(forced)))   # a chain: node i's parent is i - 1
            changed = changed or bool(forced)
        rows.append((tokens, parents))
    return TreeProposal.from_lists(rows, n=max(len(tokens) for tokens, _ in rows)) if changed else proposal
