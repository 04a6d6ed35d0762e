"""DraftTrees: derived tensors against a slow per-node reference."""
from __future__ import annotations

import random

import pytest
import torch

from specserve.verify.tree import DraftTrees

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def random_tree(rng: random.Random, size: int, vocab: int = 50) -> tuple[list[int], list[int]]:
    parents = [-1] + [rng.randrange(i) for i in range(1, size)]
    return [rng.randrange(vocab) for _ in range(size)], parents


def reference(tokens: list[int], parents: list[int], n: int, prefix_len: int):
    """Depth, ancestor mask, ordered children and positions of one tree, node by node."""
    size = len(tokens)
    depth, mask, children = [0] * n, [[i == j for j in range(n)] for i in range(n)], [[] for _ in range(n)]
    for i in range(1, size):
        children[parents[i]].append(i)
        j = i
        while parents[j] >= 0:
            j = parents[j]
            mask[i][j] = True
            depth[i] += 1
    return depth, mask, children, [prefix_len + d for d in depth]


def children_from_pointers(first_child: list[int], next_sibling: list[int], node: int) -> list[int]:
    out, child = [], first_child[node]
    while child >= 0:
        out.append(child)
        child = next_sibling[child]
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 17, 33])
def test_random_trees_match_reference(device: str, n: int) -> None:
    rng = random.Random(n)
    lists = [random_tree(rng, rng.randint(1, n)) for _ in range(12)]
    lists[0] = random_tree(rng, n)                     # one full-size tree
    trees = DraftTrees.from_lists(lists, n=n, device=device)
    trees.validate()
    prefix_lens = torch.tensor([rng.randrange(1000) for _ in lists], device=device)
    positions = trees.positions(prefix_lens).tolist()
    for b, (tokens, parents) in enumerate(lists):
        depth, mask, children, ref_positions = reference(tokens, parents, n, int(prefix_lens[b]))
        assert trees.depth[b].tolist() == depth
        assert trees.ancestor_mask[b].tolist() == mask
        assert positions[b] == ref_positions
        first, nxt = trees.first_child[b].tolist(), trees.next_sibling[b].tolist()
        for node in range(n):
            assert children_from_pointers(first, nxt, node) == children[node]
        assert trees.tokens[b, :len(tokens)].tolist() == tokens
        assert trees.parents[b].tolist() == parents + [-1] * (n - len(parents))
    assert trees.num_nodes.tolist() == [len(t) for t, _ in lists]


def test_deep_chain_and_wide_star() -> None:
    n = 40
    chain = DraftTrees.chain(torch.arange(2 * n).view(2, n))
    assert chain.depth.tolist() == [list(range(n))] * 2
    assert torch.equal(chain.ancestor_mask[0], torch.ones(n, n, dtype=torch.bool).tril())
    assert chain.first_child[0].tolist() == list(range(1, n)) + [-1]
    assert chain.next_sibling.eq(-1).all()
    star = DraftTrees.from_lists([(list(range(n)), [-1] + [0] * (n - 1))])
    assert star.depth[0].tolist() == [0] + [1] * (n - 1)
    assert star.first_child[0].tolist() == [1] + [-1] * (n - 1)
    assert star.next_sibling[0].tolist() == [-1] + list(range(2, n)) + [-1]


def test_chain_with_padding_and_root_only() -> None:
    trees = DraftTrees.chain(torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), num_nodes=torch.tensor([4, 2]))
    assert trees.depth.tolist() == [[0, 1, 2, 3], [0, 1, 0, 0]]
    assert trees.parents.tolist() == [[-1, 0, 1, 2], [-1, 0, -1, -1]]
    assert trees.ancestor_mask[1].tolist() == [[True, False, False, False], [True, True, False, False],
                                               [False, False, True, False], [False, False, False, True]]
    assert trees.first_child[1].tolist() == [1, -1, -1, -1]
    root = DraftTrees.root_only(torch.tensor([3, 9]))
    assert root.tokens.tolist() == [[3], [9]] and root.depth.tolist() == [[0], [0]]
    assert root.ancestor_mask.all() and root.first_child.tolist() == [[-1], [-1]]
    assert root.positions(torch.tensor([7, 0])).tolist() == [[7], [0]]


def test_validate_rejects_bad_parents() -> None:
    tokens = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError):
        DraftTrees.build(tokens, torch.tensor([[-1, 0, 2]]), torch.tensor([3])).validate()
    with pytest.raises(ValueError):
        DraftTrees.from_lists([([1, 2], [-1, 0])], n=1)
