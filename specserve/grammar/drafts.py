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

# Greedy trees are pruned too while the step's constrained drafts are at most this many nodes:
# the walk then costs less than the verification of the nodes it cuts (H200, 1.5B, batch 1,
# 16-node chains under a schema: a step 2.45-2.54 ms unpruned, 2.22-2.28 ms pruned), while at
# 64 trees of 8-16 nodes it cost ~2-3 ms of host time a step, more than the nodes it cut
PRUNE_GREEDY_NODES = 64


def constrain_proposal(reqs: Sequence, proposal: TreeProposal, limits: Sequence[int],
                       masked: Sequence[bool]) -> TreeProposal:
    """The proposal a step verifies for these requests, some with a grammar: pruned where a
    request's verification masks every node (masked[i]: it samples), then forced chains where a
    tree is left with its root alone (limits: nodes per request). A greedy request's tree is
    pruned only where the step's constrained drafts are few (PRUNE_GREEDY_NODES); otherwise its
    path is kept to its grammar after an unmasked verification (greedy_paths.py), where a
    forbidden draft costs a verified node."""
    constrained = sum(int(proposal.num_nodes[row]) for row, req in enumerate(reqs) if req.grammar is not None)
    pruned = [True] * len(reqs) if constrained <= PRUNE_GREEDY_NODES else masked
    return add_forced_drafts(reqs, prune_proposal(reqs, proposal, pruned), limits)


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
