"""The n-gram trie drafter: matching, ranking, tree shape, eviction, owner priority."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from specserve.spec.ngram_trie import NgramConfig, NgramTrie


def make(**overrides) -> NgramTrie:
    return NgramTrie(NgramConfig(**overrides))


def check_tree(tokens: list[int], parents: list[int]) -> None:
    """Topological, BFS-ordered, and no path twice."""
    assert len(tokens) == len(parents)
    depth: list[int] = []
    for i, parent in enumerate(parents):
        assert -1 <= parent < i
        depth.append(0 if parent < 0 else depth[parent] + 1)
    assert depth == sorted(depth)
    assert len(set(zip(parents, tokens))) == len(tokens)


def check_invariants(trie: NgramTrie) -> None:
    """Every live node is reachable once, and each ranking is the true top of its children."""
    seen, stack = 0, [0]
    while stack:
        node = stack.pop()
        children = trie._children[node] or {}
        for token, child in children.items():
            assert trie._parent[child] == node and trie._token[child] == token
        seen += len(children)
        stack.extend(children.values())
        if node and children:
            top = trie._top[node]
            rank = sorted(children.values(), key=lambda c: (trie._count[c], trie._stamp[c]),
                          reverse=True)
            assert list(top) == rank[:trie.config.max_bfs_breadth]
    assert seen == trie.num_nodes()


def check_frontier_matches(trie: NgramTrie, history: list[int], owner: int) -> None:
    """Matching through the owner's frontier finds what walking from the root finds."""
    window = history[-trie._max_window:]
    assert list(trie._matches(window, trie._streams[owner])) == list(trie._matches(window))


def ngram_counts(sequences: list[list[int]], max_depth: int) -> Counter:
    counts: Counter = Counter()
    for seq in sequences:
        for start in range(len(seq)):
            for end in range(start + 1, min(len(seq), start + max_depth) + 1):
                counts[tuple(seq[start:end])] += 1
    return counts


def trie_counts(trie: NgramTrie) -> Counter:
    counts: Counter = Counter()
    stack = [(0, ())]
    while stack:
        node, path = stack.pop()
        for token, child in (trie._children[node] or {}).items():
            counts[path + (token,)] = trie._count[child]
            stack.append((child, path + (token,)))
    return counts


def test_counts_are_ngram_frequencies():
    rng = random.Random(0)
    sequences = [[rng.randrange(5) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
    trie = make(max_trie_depth=5)
    for seq in sequences:
        trie.insert(seq)
    assert trie_counts(trie) == ngram_counts(sequences, 5)
    check_invariants(trie)


def test_longest_suffix_wins_and_falls_back():
    trie = make(max_match_window=4)
    trie.insert([1, 2, 3, 4])
    trie.insert([9, 2, 3, 5])
    assert trie.propose([1, 2, 3], 2, True) == ([4], [-1])  # [1,2,3] beats [2,3]
    assert trie.propose([8, 9, 2, 3], 2, True) == ([5], [-1])
    # [7,2,3] is unknown; [2,3] has 4 and 5 once each: the most recent wins the tie
    assert trie.propose([7, 2, 3], 2, True) == ([5], [-1])
    # the longest match [1,2,3,4] has no continuation: fall back to [4]... none, then none
    trie.insert([4, 6])
    assert trie.propose([1, 2, 3, 4], 2, True) == ([6], [-1])


def test_frequency_orders_children():
    trie = make()
    for continuation in (8, 8, 7, 9, 9, 9):
        trie.insert([5, 1, continuation])
    tokens, parents = trie.propose([5, 1], 4, False)
    assert tokens == [9, 8, 7] and parents == [-1, -1, -1]
    trie.insert([5, 1, 7])  # 8 and 7 tie at 2; 7 is newer
    assert trie.propose([5, 1], 4, False)[0] == [9, 7, 8]


def test_bfs_breadth_limits():
    trie = make(min_bfs_breadth=1, max_bfs_breadth=3, max_match_window=4, max_trie_depth=6)
    for k in range(6):
        for _ in range(k + 1):
            trie.insert([1, 10 + k, 20 + k, 30 + k])
    # a one-token match is the weakest: max breadth at level 1, shrinking deeper
    tokens, parents = trie.propose([1], 16, False)
    check_tree(tokens, parents)
    assert tokens[:3] == [15, 14, 13] and parents[:3] == [-1, -1, -1]
    assert parents.count(-1) == 3
    assert trie._breadths[1][1:4] == [3, 1, 1]
    # a maximal-length match is the strongest: a single child per node
    trie = make(min_bfs_breadth=1, max_bfs_breadth=3, max_match_window=4, max_trie_depth=6)
    trie.insert([7, 8, 9, 1, 10])
    trie.insert([7, 8, 9, 1, 11])
    assert trie.propose([7, 8, 9, 1], 16, False) == ([11], [-1])
    assert trie.propose([1], 16, False) == ([11, 10], [-1, -1])


def test_prob_picks_likely_deep_nodes():
    for match_type, expected in (("PROB", ([2, 4], [-1, 0])), ("BFS", ([2, 3], [-1, -1]))):
        trie = make(match_type=match_type)
        for _ in range(9):
            trie.insert([1, 2, 4])
        trie.insert([1, 3])
        assert trie.propose([1], 3, False) == expected
    # PROB pops 2 (.9), 4 (.9), 3 (.1) but returns BFS order
    prob = make(match_type="PROB")
    for _ in range(9):
        prob.insert([1, 2, 4])
    prob.insert([1, 3])
    assert prob.propose([1], 4, False) == ([2, 3, 4], [-1, -1, 0])


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_num_draft_tokens_limit(match_type):
    rng = random.Random(1)
    trie = make(match_type=match_type)
    data = [rng.randrange(4) for _ in range(300)]
    trie.insert(data)
    for n in (0, 1):
        assert trie.propose(data, n, False) == ([], [])
        assert trie.propose(data, n, True) == ([], [])
    for n in range(2, 20):
        for one_branch in (True, False):
            tokens, parents = trie.propose(data, n, one_branch)
            assert 1 <= len(tokens) <= n - 1
            check_tree(tokens, parents)


def test_one_branch_is_a_chain():
    trie = make(max_trie_depth=8)
    trie.insert([1, 2, 3, 4, 5, 6, 7, 8, 9])
    trie.insert([1, 2, 3, 4, 0])
    tokens, parents = trie.propose([1, 2], 6, True)
    assert tokens == [3, 4, 0] and parents == [-1, 0, 1]  # 0 is newer than 5
    trie.insert([1, 2, 3, 4, 5])  # 5 now follows [1, 2, 3, 4] twice
    assert trie.propose([1, 2], 6, True)[0] == [3, 4, 5, 6, 7]


def test_one_branch_rematches_past_the_depth_limit():
    trie = make(max_trie_depth=4, max_match_window=3)
    seq = list(range(10, 30))
    trie.insert(seq)
    tokens, parents = trie.propose(seq[:3], 12, True)
    assert tokens == seq[3:14] and parents == list(range(-1, 10))


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_multi_branch_is_a_tree_holding_the_best_chain(match_type):
    rng = random.Random(2)
    trie = make(match_type=match_type, max_trie_depth=8, max_match_window=4)
    data = [rng.randrange(6) for _ in range(2000)]
    trie.insert(data)
    for end in range(10, 200, 7):
        context = data[:end]
        chain, _ = trie.propose(context, 8, True)
        tokens, parents = trie.propose(context, 8, False)
        check_tree(tokens, parents)
        assert tokens[0] == chain[0]
        assert len(tokens) == 7  # dense data: the budget fills


def test_capacity_bounds_nodes_and_keeps_recent_data():
    rng = random.Random(3)
    trie = make(capacity=500, max_trie_depth=6)
    streams: dict[int, list[int]] = {owner: [] for owner in range(7)}
    for step in range(300):
        tokens = [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
        trie.insert(tokens, owner=step % 7)
        streams[step % 7] += tokens
        assert trie.num_nodes() <= 500
        check_frontier_matches(trie, streams[step % 7], step % 7)
        if step % 50 == 0:
            check_invariants(trie)
    check_invariants(trie)
    # eviction (with node ids reused) never invents an n-gram or over-counts one
    true_counts = ngram_counts(list(streams.values()), 6)
    assert all(count <= true_counts[path] for path, count in trie_counts(trie).items())
    recent = [101, 102, 103, 104, 105]
    trie.insert(recent)
    assert trie.propose([101, 102], 4, True) == ([103, 104, 105], [-1, 0, 1])
    # a stream continuing across an eviction still indexes the n-grams spanning it
    trie.insert([200, 201], owner=42)
    epoch = trie._epoch
    while trie._epoch == epoch:  # one eviction, which the recent [200, 201] survives
        trie.insert([rng.randrange(50) for _ in range(10)])
    trie.insert([202], owner=42)
    assert trie.propose([200, 201], 2, True) == ([202], [-1])
    check_invariants(trie)


def test_eviction_keeps_what_is_used():
    rng = random.Random(5)
    trie = make(capacity=400, max_trie_depth=4)
    hot = [900, 901, 902, 903]
    trie.insert(hot)
    for step in range(200):
        trie.insert([rng.randrange(100) for _ in range(20)])
        if step % 5 == 0:
            trie.insert(hot)  # touched again and again: survives, though the oldest
        assert trie.num_nodes() <= 400
    assert trie._epoch > 10  # evicted many times
    assert trie.propose([900], 4, True) == ([901, 902, 903], [-1, 0, 1])
    check_invariants(trie)


def test_owner_prefers_its_own_continuation():
    for match_type in ("BFS", "PROB"):
        trie = make(match_type=match_type)
        trie.insert([1, 2, 3, 4, 5], owner=1)
        for _ in range(5):
            trie.insert([2, 3, 9, 9])
        assert trie.propose([7, 2, 3], 2, True) == ([9], [-1])
        assert trie.propose([7, 2, 3], 2, True, owner=1) == ([4], [-1])
        assert trie.propose([7, 2, 3], 4, True, owner=1)[0] == [4, 5]
        assert trie.propose([7, 2, 3], 8, False, owner=1)[0][0] == 4
        assert trie.propose([7, 2, 3], 8, False)[0][0] == 9
        assert trie.propose([7, 2, 3], 2, True, owner=2) == ([9], [-1])  # unknown owner
        trie.release(1)
        assert trie.propose([7, 2, 3], 2, True, owner=1) == ([9], [-1])
        assert 1 not in trie._streams


def test_owner_priority_can_be_disabled():
    trie = make(owner_priority=False)
    trie.insert([1, 2, 3, 4], owner=1)
    for _ in range(3):
        trie.insert([2, 3, 9])
    assert trie.propose([2, 3], 2, True, owner=1) == ([9], [-1])


def test_release_ends_the_stream():
    trie = make()
    trie.insert([1, 2, 3], owner=5)
    trie.release(5)
    trie.insert([4], owner=5)  # a new stream: (3, 4) is not an n-gram
    assert trie.propose([3], 2, True) == ([], [])
    trie.release(12345)  # unknown owners are fine


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_incremental_insert_equals_whole(match_type):
    rng = random.Random(4)
    data = [rng.randrange(8) for _ in range(600)]
    whole, pieces = make(match_type=match_type), make(match_type=match_type)
    whole.insert(data, owner=1)
    start = 0
    while start < len(data):
        size = rng.randrange(1, 6)
        pieces.insert(data[start:start + size], owner=1)
        start += size
        check_frontier_matches(pieces, data[:start], 1)
    assert whole.num_nodes() == pieces.num_nodes()
    assert trie_counts(whole) == trie_counts(pieces)
    for end in range(5, 600, 13):
        for n in (2, 4, 8, 16):
            for one_branch in (True, False):
                for owner in (None, 1):
                    args = (data[:end], n, one_branch, owner)
                    assert whole.propose(*args) == pieces.propose(*args)


def test_no_match_gives_empty_lists():
    trie = make(min_match_window=2)
    assert trie.propose([1, 2, 3], 8, False) == ([], [])
    trie.insert([1, 2, 3])
    assert trie.propose([], 8, False) == ([], [])
    assert trie.propose([5, 6], 8, True) == ([], [])
    assert trie.propose([2], 8, False) == ([], [])  # shorter than min_match_window
    assert trie.propose([1, 2], 8, False) == ([3], [-1])


def test_accepts_numpy_and_tuples():
    trie = make()
    trie.insert(np.array([1, 2, 3, 4], dtype=np.int64))
    assert trie.propose(np.array([1, 2]), 4, True) == ([3, 4], [-1, 0])
    assert trie.propose((1, 2), 4, False) == ([3, 4], [-1, 0])
    assert all(type(token) is int for token in trie.propose((1, 2), 4, False)[0])


def test_config_is_validated():
    with pytest.raises(ValueError):
        NgramConfig(match_type="DFS")
    with pytest.raises(ValueError):
        NgramConfig(min_match_window=5, max_match_window=3)
    with pytest.raises(ValueError):
        NgramConfig(min_bfs_breadth=0)


@pytest.mark.parametrize("one_branch", [False, True])
def test_propose_reports_the_longest_suffix_with_a_continuation(one_branch):
    trie = NgramTrie(NgramConfig())
    trie.insert([1, 2, 3, 4, 5])

    def match_length(context):
        trie.propose(context, 4, one_branch)
        return trie.last_match_length
    assert match_length([9, 2, 3]) == 2        # "2 3" continues with 4; "9 2 3" was never seen
    assert match_length([1, 2, 3]) == 3
    assert match_length([7, 5]) == 0           # 5 ends the text: no continuation
    assert match_length([8, 4]) == 1
