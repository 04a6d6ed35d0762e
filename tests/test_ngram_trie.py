"""The n-gram trie drafter: matching, ranking, tree shape, eviction, owner priority."""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from specserve.speculative.ngram.trie import NgramConfig, NgramTrie
from specserve.speculative.ngram.trie_py import PythonNgramTrie as ReferenceTrie


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
    """Every live node is reachable once, and each ranking is the true top of its children;
    the C side's own structural check (hash table, lists, queue, free ids, frontiers) passes."""
    assert trie._check() == 0
    nodes = trie._nodes()  # id -> (token, parent, count, stamp)
    seen, stack = 0, [0]
    while stack:
        node = stack.pop()
        children = trie._children(node)
        for token, child in children.items():
            assert nodes[child][:2] == (token, node)
            assert trie._child(node, token) == child
        seen += len(children)
        stack.extend(children.values())
        if node and children:
            top = trie._top(node)
            rank = sorted(children.values(), key=lambda c: (nodes[c][2], nodes[c][3]),
                          reverse=True)
            assert list(top) == rank[:trie.config.max_bfs_breadth]
    assert seen == trie.num_nodes() == len(nodes)


def check_frontier_matches(trie: NgramTrie, history: list[int], owner: int) -> None:
    """Matching through the owner's frontier finds what walking from the root finds."""
    window = history[-trie._max_window:]
    assert trie._matches(window, owner) == trie._matches(window)
    frontier, tail, _ = trie._frontier(owner)
    assert tail == history[1 - trie.config.max_trie_depth:]
    assert len(frontier) == len(tail) + 1


def ngram_counts(sequences: list[list[int]], max_depth: int) -> Counter:
    counts: Counter = Counter()
    for seq in sequences:
        for start in range(len(seq)):
            for end in range(start + 1, min(len(seq), start + max_depth) + 1):
                counts[tuple(seq[start:end])] += 1
    return counts


def trie_counts(trie: NgramTrie) -> Counter:
    nodes = trie._nodes()
    counts: Counter = Counter()
    stack = [(0, ())]
    while stack:
        node, path = stack.pop()
        for token, child in trie._children(node).items():
            counts[path + (token,)] = nodes[child][2]
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


# ---------------------------------------------------------------- the C trie vs the reference
def reference_nodes(trie: ReferenceTrie) -> dict[int, tuple[int, int, int, int]]:
    """The reference's live nodes in NgramTrie._nodes's form: id -> (token, parent, count, stamp)."""
    nodes, stack = {}, [0]
    while stack:
        node = stack.pop()
        for token, child in (trie.nodes.children[node] or {}).items():
            nodes[child] = (token, node, trie.nodes.count[child], trie.nodes.stamp[child])
            stack.append(child)
    return nodes


def random_config(rng: random.Random) -> NgramConfig:
    depth = rng.randint(2, 9)
    min_window = rng.randint(1, 3)
    min_breadth = rng.randint(1, 3)
    return NgramConfig(
        capacity=rng.choice([1, 30, 120, 500, 100_000]), max_trie_depth=depth,
        min_match_window=min_window, max_match_window=rng.randint(min_window, depth + 1),
        min_bfs_breadth=min_breadth, max_bfs_breadth=rng.randint(min_breadth, 6),
        match_type=rng.choice(["BFS", "PROB"]), evict_to=rng.choice([0.0, 0.5, 0.9]),
        owner_priority=rng.random() < 0.8)


@pytest.mark.parametrize("seed", range(48))
def test_matches_the_reference_on_random_streams(seed):
    """Random streams over a small vocabulary (n-grams repeat), several owners, releases, and
    capacities small enough that eviction (and id reuse) runs all the time: after every
    operation both tries propose the same trees and match lengths and count the same nodes,
    evictions and streams; every 50 operations and at the end they hold the same nodes, to
    the id, count and stamp."""
    rng = random.Random(seed)
    config = random_config(rng)
    fast, reference = NgramTrie(config), ReferenceTrie(config)
    vocab = rng.choice([2, 4, 8, 30])
    history: dict[int | None, list[int]] = {None: []}
    for step in range(250):
        action = rng.random()
        owner = rng.choice([None, 0, 1, 2, 3])
        if action < 0.45:
            source = history[rng.choice(list(history))]
            if source and rng.random() < 0.4:  # repeat a stretch already seen: long matches
                start = rng.randrange(len(source))
                tokens = source[start:start + rng.randint(1, 15)]
            else:
                tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 12))]
            fast.insert(tokens, owner)
            reference.insert(tokens, owner)
            if owner is not None:
                history[owner] = history.get(owner, []) + tokens
            history[None] = tokens
        elif action < 0.5:
            fast.release(owner)
            reference.release(owner)
            if owner is not None:
                history.pop(owner, None)
        else:
            known = history.get(owner) or history[None]
            if known and rng.random() < 0.7:  # the owner's own tokens: its frontier applies
                context = known[-rng.randint(1, 20):] if rng.random() < 0.3 else known
            else:
                context = [rng.randrange(vocab) for _ in range(rng.randint(0, 10))]
            args = (context, rng.randint(0, 24), rng.random() < 0.4, owner)
            assert fast.propose(*args) == reference.propose(*args), (step, args)
            assert fast.last_match_length == reference.last_match_length
        assert fast.num_nodes() == reference.num_nodes()
        assert fast._epoch == reference._epoch
        assert set(fast._streams) == set(reference._streams)
        if step % 50 == 0:
            assert fast._nodes() == reference_nodes(reference)
            assert fast._check() == 0
    assert fast._nodes() == reference_nodes(reference)
    check_invariants(fast)


@pytest.mark.parametrize("match_type", ["BFS", "PROB"])
def test_matches_the_reference_on_a_long_text(match_type):
    """Zipf-distributed tokens from a 30k vocabulary with repeated phrases, the default shape
    of the trie, a capacity that evicts: a serving-like stream."""
    rng = random.Random(7)
    config = NgramConfig(capacity=20_000, match_type=match_type)
    fast, reference = NgramTrie(config), ReferenceTrie(config)
    phrases = [[min(int(rng.paretovariate(1.1)), 30_000) for _ in range(rng.randint(3, 30))]
               for _ in range(300)]
    for owner in range(6):
        text = [token for _ in range(40) for token in rng.choice(phrases)]
        for start in range(0, len(text), 200):
            fast.insert(text[start:start + 200], owner)
            reference.insert(text[start:start + 200], owner)
            context = text[:start + 200]
            for one_branch in (True, False):
                args = (context, 16, one_branch, owner)
                assert fast.propose(*args) == reference.propose(*args)
                assert fast.last_match_length == reference.last_match_length
        fast.release(owner)
        reference.release(owner)
    assert fast._epoch == reference._epoch > 0
    assert fast._nodes() == reference_nodes(reference)


def test_the_trie_is_freed_with_its_owner():
    trie = make()
    trie.insert([1, 2, 3], owner=1)
    finalizer = trie._finalizer
    assert finalizer.alive
    del trie
    assert not finalizer.alive


def test_no_compiler_is_a_clear_error(monkeypatch, tmp_path):
    from specserve.speculative.ngram import trie as ngram_trie
    monkeypatch.setenv("CC", "")
    monkeypatch.setenv("PATH", str(tmp_path))  # no cc, gcc or clang there
    with pytest.raises(RuntimeError, match="no C compiler"):
        ngram_trie._compile(tmp_path / "trie.so", list(ngram_trie._CFLAGS))
    assert not list(tmp_path.iterdir())


def test_rejects_token_ids_beyond_int32():
    trie = make()
    with pytest.raises(OverflowError):
        trie.insert([1, 2**31])
    assert trie.num_nodes() == 0


def test_concurrent_first_uses_build_one_library(tmp_path):
    """Processes starting together with an empty cache each compile to a temporary name and
    rename: every one loads a whole library, and no temporary is left."""
    import os
    import subprocess
    import sys
    script = ("from specserve.speculative.ngram.trie import NgramConfig, NgramTrie\n"
              "t = NgramTrie(NgramConfig()); t.insert([1, 2, 3]); print(t.propose([1, 2], 4, True))")
    env = {**os.environ, "SPECSERVE_CACHE_DIR": str(tmp_path)}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = [subprocess.Popen([sys.executable, "-c", script], env=env, cwd=root, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    for run in runs:
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
        assert out.strip() == "([3], [-1])"
    assert [p.name for p in tmp_path.iterdir()] == [p.name for p in tmp_path.glob("ngram_trie-*.so")]
    assert len(list(tmp_path.iterdir())) == 1
