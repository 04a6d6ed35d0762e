"""VERIFY mode is exact: a draft tree run in one forward gives, at every node, the logits of
running that node's root-to-node path token by token with decode steps; after committing a
path (its KV kept, the rest freed), the next decode step matches the sequential run too.

Tiny random models of every architecture, fp32, through ModelRunner's real forward paths
(tests/model_fixtures.RunnerDriver); trees are random (duplicate tokens among siblings included).
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from specserve.verify.tree import TreeProposal
from tests.model_fixtures import ARCHITECTURES, RunnerDriver, tiny_hf_model

ATOL = 1e-5
VOCAB = 97


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def model(request):
    return tiny_hf_model(request.param, seed=3)


def random_tree(rng: random.Random, size: int) -> tuple[list[int], list[int]]:
    """Random topological parents; tokens from a small range so siblings sometimes repeat a token."""
    parents = [-1] + [rng.randrange(i) for i in range(1, size)]
    return [rng.randrange(VOCAB) for _ in range(size)], parents


def path_to(parents: list[int], node: int) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def sequential_logits(model, prefix: list[int], tokens: list[int]) -> torch.Tensor:
    """(len(tokens), V): a fresh driver prefills `prefix`, then decodes `tokens` one step each."""
    driver = RunnerDriver.from_hf(model)
    driver.prefill(prefix)
    return torch.stack([driver.decode(token) for token in tokens])


def leaves(parents: list[int]) -> list[int]:
    has_child = {p for p in parents if p >= 0}
    return [i for i in range(len(parents)) if i not in has_child]


@pytest.mark.parametrize("size", [2, 5, 9, 16])
def test_tree_logits_equal_sequential_paths(model, size):
    rng = random.Random(size)
    prefix = [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 20))]
    tokens, parents = random_tree(rng, size)
    driver = RunnerDriver.from_hf(model)
    driver.prefill(prefix)
    tree_logits = driver.verify_tree(tokens, parents, commit_path=[0])
    assert tree_logits.shape == (size, VOCAB)
    checked = set()
    # every node lies on the path to some leaf: one sequential run per leaf covers them all
    for leaf in leaves(parents):
        path = path_to(parents, leaf)
        reference = sequential_logits(model, prefix, [tokens[node] for node in path])
        for depth, node in enumerate(path):
            torch.testing.assert_close(tree_logits[node], reference[depth], atol=ATOL, rtol=0,
                                       msg=f"node {node} (depth {depth}) of {parents}")
            checked.add(node)
    assert checked == set(range(size))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_committed_path_then_decode_equals_sequential(model, seed):
    """Commit a random root-to-node path of a verified tree; the next decode steps read the
    accepted nodes' KV at the right positions and nothing of the rejected ones."""
    rng = random.Random(100 + seed)
    prefix = [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 20))]
    tokens, parents = random_tree(rng, 12)
    accepted = path_to(parents, rng.randrange(12))
    bonus, after = rng.randrange(VOCAB), rng.randrange(VOCAB)

    driver = RunnerDriver.from_hf(model)
    driver.prefill(prefix)
    free_before = driver.runner.pool.slots.available()
    tree_logits = driver.verify_tree(tokens, parents, commit_path=accepted)
    assert driver.kv_len == len(prefix) + len(accepted)
    assert driver.runner.pool.slots.available() == free_before - len(accepted)   # rejected nodes freed
    # a second tree on top of the committed path, then a plain decode step
    next_tokens, next_parents = random_tree(rng, 6)
    next_tokens[0] = bonus
    next_accepted = path_to(next_parents, 5)
    next_logits = driver.verify_tree(next_tokens, next_parents, commit_path=next_accepted)
    last_logits = driver.decode(after)

    path_tokens = [tokens[node] for node in accepted]
    reference = sequential_logits(model, prefix, path_tokens + [next_tokens[n] for n in next_accepted] + [after])
    for depth, node in enumerate(accepted):
        torch.testing.assert_close(tree_logits[node], reference[depth], atol=ATOL, rtol=0)
    for depth, node in enumerate(next_accepted):
        torch.testing.assert_close(next_logits[node], reference[len(accepted) + depth], atol=ATOL, rtol=0)
    torch.testing.assert_close(last_logits, reference[-1], atol=ATOL, rtol=0)


def test_batched_trees_of_different_sizes_equal_sequential(model):
    """Several requests in one verify forward, different prefix lengths and tree sizes (padded
    rows), the way the engine batches them; each request's nodes equal its own sequential run."""
    rng = random.Random(7)
    driver = RunnerDriver.from_hf(model)
    runner = driver.runner
    prefixes = [[rng.randrange(VOCAB) for _ in range(length)] for length in (4, 17, 9)]
    trees = [random_tree(rng, size) for size in (7, 1, 4)]
    reqs = []
    for prefix in prefixes:
        req = SimpleNamespace(all_ids=list(prefix), kv_slots=[], row=runner.pool.alloc_row())
        req.kv_len = 0
        slots = runner.pool.slots.alloc(len(prefix))
        runner.extend([req], [len(prefix)], slots, [True])
        req.kv_slots = slots
        runner.pool.req_to_token[req.row, :len(slots)] = torch.tensor(slots, dtype=torch.int32)
        req.kv_len = len(prefix)
        reqs.append(req)
    num_nodes = [len(tokens) for tokens, _ in trees]
    logits = runner.run_trees(reqs, TreeProposal.from_lists(trees), runner.pool.slots.alloc(sum(num_nodes))).logits
    assert logits.shape == (3, 7, VOCAB)
    for prefix, (tokens, parents), rows in zip(prefixes, trees, logits):
        for leaf in leaves(parents):
            path = path_to(parents, leaf)
            reference = sequential_logits(model, prefix, [tokens[node] for node in path])
            for depth, node in enumerate(path):
                torch.testing.assert_close(rows[node], reference[depth], atol=ATOL, rtol=0)
