"""Verification (greedy identity, sampling losslessness), the filters, penalties at tree nodes,
and the counter-based random numbers they rely on."""
from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specserve.verify import random as srandom
from specserve.verify.filters import apply_sampling_filters
from specserve.verify import rules as verify_module
from specserve.verify.rules import apply_penalties_to_tree, plain_step_tokens, verify_greedy, verify_sampling
from specserve.verify.tree import DraftTrees

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
P_MIN = 1e-3


def chi_square_p(observed: np.ndarray, expected_probs: np.ndarray) -> float:
    """p-value of observed counts against exact probabilities; cells expected below 5 are pooled.
    Samples in a cell of probability 0 are an outright failure."""
    total = observed.sum()
    expected = expected_probs / expected_probs.sum() * total
    assert observed[expected_probs == 0].sum() == 0, "sampled a token of probability 0"
    small = expected < 5
    obs = np.append(observed[~small], observed[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp).pvalue)


def random_trees(rng: random.Random, bs: int, n: int, vocab: int, device: str = "cpu") -> DraftTrees:
    lists = []
    for _ in range(bs):
        size = rng.randint(1, n)
        lists.append(([rng.randrange(vocab) for _ in range(size)], [-1] + [rng.randrange(i) for i in range(1, size)]))
    return DraftTrees.from_lists(lists, n=n, device=device)


# --- counter-based random numbers -------------------------------------------------------------

def test_uniform_range_reproducible_and_batch_invariant() -> None:
    seeds, positions = torch.tensor([3, -7, 2 ** 62, 0]), torch.tensor([0, 5, 10 ** 9, 5])
    u = srandom.uniform(seeds, positions, 1, (5000,))
    assert u.dtype == torch.float32 and bool((u > 0).all()) and bool((u < 1).all())
    assert torch.equal(u, srandom.uniform(seeds, positions, 1, (5000,)))
    assert torch.equal(u[2:3], srandom.uniform(seeds[2:3], positions[2:3], 1, (5000,)))
    assert not torch.equal(u, srandom.uniform(seeds, positions, 2, (5000,)))
    index = torch.tensor([0, 4999, 17, 17])
    assert torch.equal(srandom.uniform_at(seeds, positions, 1, index), u.gather(1, index[:, None]).squeeze(1))
    # a (bs, n) position grid gives, per cell, what a (bs,) call at that position gives
    grid = srandom.uniform(seeds, torch.stack([positions, positions + 1], 1), 1, (7,))
    assert torch.equal(grid[:, 1], srandom.uniform(seeds, positions + 1, 1, (7,)))
    # moments of U(0,1) and no correlation between neighbouring keys
    flat = u.flatten().double()
    assert abs(flat.mean().item() - 0.5) < 0.01 and abs(flat.var().item() - 1 / 12) < 0.005
    assert abs(np.corrcoef(u[0].numpy(), u[3].numpy())[0, 1]) < 0.05


def test_exponential_race_follows_distribution() -> None:
    probs = torch.tensor([0.3, 0.0, 0.2, 0.15, 0.1, 0.1, 0.08, 0.05, 0.019, 0.001])
    bs = 50_000
    seeds = torch.arange(bs) * 7919 + 11
    samples = srandom.exponential_race(probs.expand(bs, -1) * 3.0, seeds, torch.full((bs,), 42))  # unnormalised
    observed = np.bincount(samples.numpy(), minlength=10)
    assert chi_square_p(observed, probs.double().numpy()) > P_MIN
    # batch invariance: a permuted subset draws the same tokens
    subset = torch.randperm(bs, generator=torch.Generator().manual_seed(0))[:1000]
    again = srandom.exponential_race(probs.expand(1000, -1) * 3.0, seeds[subset], torch.full((1000,), 42))
    assert torch.equal(again, samples[subset])


def test_two_level_race_follows_distribution_across_blocks() -> None:
    """A vocabulary of 2 full blocks and a partial one: the block race, then the race inside
    the winner, sample p exactly; the test tells p from p with 10% of one block's mass moved
    to another; the same row gives the same token in any batch shape."""
    vocab, bs = 2 * srandom.RACE_BLOCK + 88, 30_000
    gen = torch.Generator().manual_seed(3)
    probs = torch.full((vocab,), 1e-5)
    likely = torch.randperm(vocab, generator=gen)[:30]
    probs[likely] = torch.rand(30, generator=gen) + 0.2
    probs[vocab - 1] = 0.5                                      # the last token of the partial block
    probs[5] = 0.0
    seeds = torch.arange(bs) * 104_729 + 3
    samples = srandom.exponential_race(probs.expand(bs, -1), seeds, torch.full((bs,), 7))
    observed = np.bincount(samples.numpy(), minlength=vocab)
    exact = probs.double().numpy()
    assert chi_square_p(observed, exact) > P_MIN
    moved = exact.copy()
    first_block = slice(0, srandom.RACE_BLOCK)
    moved[first_block] *= 0.9
    moved[srandom.RACE_BLOCK:] *= 1 + 0.1 * exact[first_block].sum() / exact[srandom.RACE_BLOCK:].sum()
    assert chi_square_p(observed, moved) < 1e-6
    grid = srandom.exponential_race(probs.expand(100, 4, -1), seeds[:100], torch.full((100, 4), 7))
    assert torch.equal(grid[:, 2], samples[:100])
    one_hot = torch.zeros(3, vocab).scatter_(1, torch.tensor([[0], [300], [vocab - 1]]), 1.0)
    assert srandom.exponential_race(one_hot, seeds[:3], torch.zeros(3)).tolist() == [0, 300, vocab - 1]


# --- filters ---------------------------------------------------------------------------------

def reference_filter(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    x = np.array(logits, dtype=np.float64)
    if temperature == 0:
        out = np.zeros_like(x)
        out[int(np.argmax(x))] = 1.0
        return out
    p = np.exp(x / temperature - np.max(x / temperature))
    p /= p.sum()
    order = sorted(range(len(x)), key=lambda i: -p[i])
    keep = set(order[:top_k] if 0 < top_k < len(x) else order)
    mass = sum(p[i] for i in keep)
    kept, cumulative = set(), 0.0
    for i in order:
        if i in keep and (cumulative < top_p * mass or not kept or top_p >= 1):
            kept.add(i)
            cumulative += p[i]
    out = np.array([p[i] if i in kept else 0.0 for i in range(len(x))])
    out[out < out.max() * min_p] = 0.0
    return out / out.sum()


def test_filters_match_reference() -> None:
    rng = np.random.default_rng(0)
    params = [(1.0, 0, 1.0, 0.0), (0.7, 0, 0.8, 0.0), (1.3, 3, 1.0, 0.0), (1.0, 5, 0.5, 0.0), (0.5, 0, 1.0, 0.2),
              (0.0, 4, 0.3, 0.5), (1.0, 1, 1.0, 0.0), (2.0, 100, 0.95, 0.05), (1.0, 0, 1e-6, 0.0)]
    logits = torch.tensor(rng.normal(size=(len(params), 3, 12)) * 2)
    temps, top_ks, top_ps, min_ps = (torch.tensor(col) for col in zip(*params))
    probs = apply_sampling_filters(logits.float(), temps, top_ks, top_ps, min_ps)
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    for b, (t, k, p, m) in enumerate(params):
        for i in range(3):
            expected = reference_filter(logits[b, i].tolist(), t, k, p, m)
            np.testing.assert_allclose(probs[b, i].double().numpy(), expected, atol=1e-6)
    plain = apply_sampling_filters(logits[:, 0], temps, top_ks, top_ps, min_ps)     # (bs, V) works too
    np.testing.assert_allclose(plain.numpy(), probs[:, 0].double().numpy(), atol=1e-6)


def test_prefix_mass_is_a_cumulative_sum_whose_prefixes_do_not_depend_on_what_follows() -> None:
    """The chunked scan (filters.prefix_mass) over lengths that fill their last chunk or not:
    the cumulative sum, and a row's first r sums the same bits whether the row goes on or not
    (a top-k selection's masses are the sort's)."""
    from specserve.verify.filters import MASS_CHUNK, prefix_mass
    gen = torch.Generator().manual_seed(3)
    for length in (1, MASS_CHUNK - 1, MASS_CHUNK, 3 * MASS_CHUNK + 5):
        ranked = torch.rand(4, 2, length, generator=gen).sort(dim=-1, descending=True).values
        mass = prefix_mass(ranked)
        assert mass.shape == ranked.shape
        torch.testing.assert_close(mass, ranked.double().cumsum(-1).float(), rtol=1e-6, atol=1e-6)
        for cut in {1, length // 2 + 1, length}:
            assert torch.equal(prefix_mass(ranked[..., :cut].contiguous()), mass[..., :cut])


def test_top_k_selection_equals_the_sort_even_with_ties() -> None:
    """max_top_k ranks only the likeliest tokens (topk) instead of sorting: the same
    probabilities, also when tokens tie at the top-k or top-p boundary (kept: the lowest ids)."""
    gen = torch.Generator().manual_seed(11)
    bs, vocab = 12, 300
    logits = torch.randn(bs, 2, vocab, generator=gen) * 2
    top_ks = torch.tensor([3, 5, 8, 20, 1, 40] * 2)
    top_ps = torch.tensor([1.0] * 6 + [0.5, 0.8, 0.9, 0.95, 0.3, 0.99])
    temps, min_ps = torch.full((bs,), 0.9), torch.zeros(bs)
    # eleven tokens tied right at each row's top-k boundary (ranks top_k - 2 to top_k + 8)
    for b in range(bs):
        for i in range(2):
            order = logits[b, i].argsort(descending=True)
            logits[b, i, [5, *range(200, 210)]] = logits[b, i, order[max(int(top_ks[b]) - 2, 0)]].item()
    sorted_probs = apply_sampling_filters(logits, temps, top_ks, top_ps, min_ps)
    selected = apply_sampling_filters(logits, temps, top_ks, top_ps, min_ps, max_top_k=40)
    assert torch.equal(selected, sorted_probs)
    for b in range(bs):
        for i in range(2):
            expected = reference_filter(logits[b, i].tolist(), 0.9, int(top_ks[b]), float(top_ps[b]), 0.0)
            np.testing.assert_allclose(selected[b, i].double().numpy(), expected, atol=1e-6)
    tied = selected[:, :, [5, *range(200, 210)]] > 0
    assert (tied.any(-1) & ~tied.all(-1)).any(), "no row cut through the tied tokens"


# --- greedy ----------------------------------------------------------------------------------

def reference_greedy(tokens: list[int], parents: list[int], num_nodes: int, argmax: list[int]):
    path, current = [0], 0
    while True:
        children = [c for c in range(1, num_nodes) if parents[c] == current]
        match = [c for c in children if tokens[c] == argmax[current]]
        if not match:
            break
        current = match[0]
        path.append(current)
    committed = [tokens[c] for c in path[1:]] + [argmax[current]]
    return path, committed


@pytest.mark.parametrize("device", DEVICES)
def test_verify_greedy_matches_reference(device: str) -> None:
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for n, vocab in [(1, 5), (4, 3), (8, 4), (16, 3), (9, 50)]:
        bs = 64
        trees = random_trees(rng, bs, n, vocab, device)
        logits = torch.randn(bs, n, vocab, generator=gen).to(device)
        result = verify_greedy(trees, logits)
        argmax = logits.argmax(-1).tolist()
        for b in range(bs):
            size = int(trees.num_nodes[b])
            path, committed = reference_greedy(trees.tokens[b].tolist(), trees.parents[b].tolist(), size, argmax[b])
            assert result.accepted_nodes[b].tolist() == path + [-1] * (n - len(path))
            assert result.accept_lens[b].item() == len(path)
            assert result.bonus_tokens[b].item() == committed[-1]
            assert result.committed_tokens[b].tolist() == committed + [-1] * (n - len(committed))


def test_verify_greedy_chain_accepts_argmax_path_and_rejects_mismatch() -> None:
    bs, n, vocab = 5, 6, 20
    logits = torch.randn(bs, n, vocab, generator=torch.Generator().manual_seed(1))
    argmax = logits.argmax(-1)
    tokens = torch.cat([torch.tensor([[7]] * bs), argmax[:, :-1]], dim=1)   # node i+1 = argmax at node i
    result = verify_greedy(DraftTrees.chain(tokens), logits)
    assert result.accept_lens.tolist() == [n] * bs
    assert torch.equal(result.committed_tokens, argmax)
    assert result.accepted_nodes.tolist() == [list(range(n))] * bs
    wrong = tokens.clone()
    wrong[:, 1] = (argmax[:, 0] + 1) % vocab
    result = verify_greedy(DraftTrees.chain(wrong), logits)
    assert result.accept_lens.tolist() == [1] * bs
    assert torch.equal(result.bonus_tokens, argmax[:, 0])
    assert result.committed_tokens[:, 1:].eq(-1).all()


@pytest.mark.parametrize("rule,with_q", [("coupled", False), ("rejection", False), ("rejection", True)])
def test_sampling_temperature_zero_rows_equal_greedy(rule: str, with_q: bool) -> None:
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    bs, n, vocab = 256, 8, 3                     # a tiny vocabulary so that drafts often match
    trees = random_trees(rng, bs, n, vocab)
    logits = torch.randn(bs, n, vocab, generator=gen)
    temps = torch.where(torch.arange(bs) % 2 == 0, 0.0, 1.0)
    q = torch.softmax(torch.randn(bs, n, vocab, generator=gen), -1) if with_q else None
    sampled = verify_sampling(trees, logits, temps, torch.full((bs,), 2), torch.full((bs,), 0.9),
                              torch.full((bs,), 0.1), torch.arange(bs), torch.full((bs,), 9), q, rule=rule)
    greedy = verify_greedy(trees, logits)
    even = slice(0, bs, 2)
    for name in ("accepted_nodes", "accept_lens", "bonus_tokens", "committed_tokens"):
        assert torch.equal(getattr(sampled, name)[even], getattr(greedy, name)[even]), name
    assert (greedy.accept_lens[even] > 1).any()


# --- sampling is lossless: residual rejection here, the coupled rule in test_verify_coupled.py -

VOCAB = 8
FILTERS = {"t1": (1.0, 0, 1.0, 0.0), "t0.7_p0.8": (0.7, 0, 0.8, 0.0), "k3": (1.0, 3, 1.0, 0.0),
           "minp0.15": (1.2, 0, 1.0, 0.15)}


class MarkovTarget:
    """A target 'model' whose logits depend on the last token only: logits[t] = table[t]."""

    def __init__(self, filters: tuple, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.randn(VOCAB, VOCAB, generator=gen) * 1.5
        self.draft_table = self.table + torch.randn(VOCAB, VOCAB, generator=gen)   # a different q
        t, k, p, m = filters
        one = torch.ones(VOCAB)
        self.filters = (one * t, (one * k).long(), one * p, one * m)
        self.probs = apply_sampling_filters(self.table, *self.filters).double()      # (V, V) next given last

    def exact(self, root: int, length: int) -> np.ndarray:
        """Exact joint distribution of the next `length` tokens, flattened."""
        dist = self.probs[root]                                  # (V,)
        for _ in range(length - 1):
            # p(t_1..t_j) * p(t_j+1 | t_j): the target depends on the last token only
            dist = dist.unsqueeze(-1) * self.probs.view(*([1] * (dist.dim() - 1)), VOCAB, VOCAB)
        return dist.flatten().numpy()


def draft_trees(target: MarkovTarget, roots: torch.Tensor, kind: str, gen: torch.Generator, n: int = 7):
    """Random tree shapes; tokens drawn per node from a distribution given the parent's token,
    independently of the verifier's random numbers. Returns (trees, draft_probs or None)."""
    bs = roots.shape[0]
    parents = torch.full((bs, n), -1, dtype=torch.long)
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (bs,), generator=gen)
    num_nodes = torch.randint(1, n + 1, (bs,), generator=gen)
    if kind.startswith("q"):
        num_nodes = torch.full((bs,), n)
    probs = target.probs.float()
    tables = {"uniform": torch.full((VOCAB, VOCAB), 1.0 / VOCAB),
              "unlikely": (probs <= probs.median(dim=1, keepdim=True).values).float(),   # the least likely half
              "q_iid": torch.softmax(target.draft_table, -1), "q_is_p": probs,
              # a sparse q: the draft's two likeliest tokens only, so p has mass where q has none
              "q_sparse": apply_sampling_filters(target.draft_table, *(f.new_full((VOCAB,), v) for f, v in
                                                                       zip(target.filters, (1.0, 2, 1.0, 0.0))))}
    by_rank = probs.argsort(dim=1, descending=True, stable=True)     # (V, V): [token, r] = r-th likeliest next
    tokens = torch.zeros((bs, n), dtype=torch.long)
    tokens[:, 0] = roots
    for i in range(1, n):
        parent_tokens = tokens.gather(1, parents[:, i:i + 1]).squeeze(1)
        if kind == "top":         # deterministic: the k-th child is the k-th likeliest token
            rank = (parents[:, 1:i] == parents[:, i:i + 1]).sum(1).clamp(max=VOCAB - 1)
            tokens[:, i] = by_rank[parent_tokens, rank]
        else:
            tokens[:, i] = torch.multinomial(tables[kind][parent_tokens], 1, generator=gen).squeeze(1)
    trees = DraftTrees.build(tokens, parents, num_nodes)
    draft_probs = tables[kind][tokens] if kind.startswith("q") else None
    return trees, draft_probs


def sample_sequences(target: MarkovTarget, kind: str, length: int, bs: int, seed: int,
                     rule: str = "rejection") -> torch.Tensor:
    """Runs verify steps until every row has `length` committed tokens; returns (bs, length).
    The coupled rule gets no draft distribution (it needs none, whatever drew the drafts)."""
    gen = torch.Generator().manual_seed(seed)
    roots = torch.zeros(bs, dtype=torch.long)
    positions = torch.full((bs,), 100)
    seeds = torch.arange(bs) + seed * 1_000_000
    out = torch.full((bs, length), -1, dtype=torch.long)
    count = torch.zeros(bs, dtype=torch.long)
    for _ in range(length):
        trees, draft_probs = draft_trees(target, roots, kind, gen)
        logits = target.table[trees.tokens]                     # (bs, n, V): next-token logits per node
        temps, top_ks, top_ps, min_ps = (f[0].expand(bs) for f in target.filters)
        if rule == "coupled":
            draft_probs = None
        result = verify_sampling(trees, logits, temps, top_ks, top_ps, min_ps, seeds, positions, draft_probs, rule=rule)
        for j in range(length):
            slot = count + j
            take = (j < result.accept_lens) & (slot < length)
            out[take, slot[take]] = result.committed_tokens[take, j]
        count = (count + result.accept_lens).clamp(max=length)
        roots, positions = result.bonus_tokens, positions + result.accept_lens
    assert bool((out >= 0).all())
    return out


def joint_p_value(target: MarkovTarget, kind: str, length: int = 2, bs: int = 20_000, seed: int = 1,
                  rule: str = "rejection") -> float:
    samples = sample_sequences(target, kind, length, bs, seed, rule)
    flat = sum(samples[:, j] * VOCAB ** (length - 1 - j) for j in range(length))
    observed = np.bincount(flat.numpy(), minlength=VOCAB ** length)
    return chi_square_p(observed, target.exact(0, length))


LOSSLESS_CASES = ([("t1", kind) for kind in ("top", "unlikely", "uniform", "q_iid", "q_is_p", "q_sparse")]
                  + [(f, kind) for f in ("t0.7_p0.8", "k3", "minp0.15") for kind in ("top", "uniform", "q_iid")]
                  + [("k3", "q_is_p")])


@pytest.mark.parametrize("filters,kind", LOSSLESS_CASES)
def test_rejection_sampling_is_lossless(filters: str, kind: str) -> None:
    assert joint_p_value(MarkovTarget(FILTERS[filters]), kind) > P_MIN


def test_rejection_sampling_is_lossless_three_tokens() -> None:
    target = MarkovTarget(FILTERS["t1"], seed=3)
    assert joint_p_value(target, "top", length=3, seed=2) > P_MIN
    assert joint_p_value(target, "q_iid", length=3, seed=3) > P_MIN


def test_chi_square_rejects_a_wrong_rejection_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Power check (residual rejection): accepting every child of nonzero probability biases
    towards the drafts."""
    monkeypatch.setattr(verify_module, "_accept", lambda u, residual_x, mass, q_x: residual_x > 0)
    assert joint_p_value(MarkovTarget(FILTERS["t1"]), "top") < 1e-6
    assert joint_p_value(MarkovTarget(FILTERS["t1"]), "uniform") < 1e-6


def test_chi_square_rejects_the_deterministic_rule_on_sampled_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Power check: drafts drawn from q need min(1, r/q); accepting with probability r(x) is wrong."""
    monkeypatch.setattr(verify_module, "_accept", lambda u, residual_x, mass, q_x: u * mass < residual_x)
    assert joint_p_value(MarkovTarget(FILTERS["t1"]), "q_iid") < 1e-6


@pytest.mark.parametrize("rule", ["coupled", "rejection"])
def test_sampling_reproducible_and_batch_invariant(rule: str) -> None:
    rng = random.Random(2)
    bs, n, vocab = 64, 8, 4
    trees = random_trees(rng, bs, n, vocab)
    logits = torch.randn(bs, n, vocab, generator=torch.Generator().manual_seed(2))
    args = (torch.ones(bs), torch.zeros(bs, dtype=torch.long), torch.ones(bs), torch.zeros(bs),
            torch.arange(bs) * 31, torch.arange(bs) + 5)
    full = verify_sampling(trees, logits, *args, rule=rule)
    again = verify_sampling(trees, logits, *args, rule=rule)
    assert torch.equal(full.committed_tokens, again.committed_tokens)
    rows = torch.tensor([5, 17, 3])
    sub_trees = DraftTrees.build(trees.tokens[rows], trees.parents[rows], trees.num_nodes[rows])
    sub = verify_sampling(sub_trees, logits[rows], *(a[rows] for a in args), rule=rule)
    assert torch.equal(sub.committed_tokens, full.committed_tokens[rows])


@pytest.mark.parametrize("rule", ["coupled", "rejection"])
def test_root_only_sampling_equals_plain_sampler(rule: str) -> None:
    bs, vocab = 32, 50
    logits = torch.randn(bs, 1, vocab, generator=torch.Generator().manual_seed(4))
    temps, top_ks, top_ps, min_ps = torch.full((bs,), 0.8), torch.full((bs,), 10), torch.full((bs,), 0.9), torch.zeros(bs)
    seeds, prefix = torch.arange(bs), torch.arange(bs) * 3
    result = verify_sampling(DraftTrees.root_only(torch.zeros(bs, dtype=torch.long)), logits,
                             temps, top_ks, top_ps, min_ps, seeds, prefix, rule=rule)
    probs = apply_sampling_filters(logits[:, 0], temps, top_ks, top_ps, min_ps)
    plain = srandom.exponential_race(probs, seeds, prefix + 1, srandom.SALT_TOKEN)
    assert torch.equal(result.bonus_tokens, plain) and result.accept_lens.eq(1).all()


def test_a_plain_steps_tokens_are_the_root_only_verifys() -> None:
    """plain_step_tokens (a plain decode step's sampling, the tree bookkeeping left out) commits
    verify_sampling's token for roots alone: greedy rows, each filter, large seeds and positions."""
    bs, vocab = 40, 700   # three race blocks, the last partial
    logits = torch.randn(bs, vocab, generator=torch.Generator().manual_seed(5)) * 3
    temps = torch.tensor([0.0, 0.7, 1.0, 1.3] * 10)
    top_ks = torch.tensor([0, 5, vocab, 40, 0] * 8)
    top_ps, min_ps = torch.tensor([1.0, 0.9, 0.5, 1.0] * 10), torch.tensor([0.0, 0.0, 0.0, 0.0, 0.2] * 8)
    seeds, positions = torch.arange(bs) * 1_000_003 - 2**40, torch.arange(bs) * 7 + 2**33
    roots = DraftTrees.root_only(torch.zeros(bs, dtype=torch.long))
    for kwargs in ({}, {"need_min_p": False, "top_ks": torch.zeros(bs, dtype=torch.long)},
                   {"max_top_k": 40, "top_ks": torch.full((bs,), 40)}):
        args = dict(temperatures=temps, top_ks=top_ks, top_ps=top_ps, min_ps=min_ps, seeds=seeds, positions=positions)
        args.update(kwargs)
        if "need_min_p" in args:
            args["min_ps"] = torch.zeros(bs)
        verified = verify_sampling(roots, logits.unsqueeze(1), **args).committed_tokens[:, 0]
        assert torch.equal(plain_step_tokens(logits, **args), verified), kwargs


# --- penalties at tree nodes -----------------------------------------------------------------

def reference_penalties(logits: list[float], history: list[int], prompt: set[int], rep: float, freq: float,
                        pres: float) -> list[float]:
    counts = Counter(history)
    out = []
    for token, x in enumerate(logits):
        if token in prompt or counts[token] > 0:
            x = x / rep if x > 0 else x * rep
        x -= freq * counts[token] + pres * (counts[token] > 0)
        out.append(x)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_penalties_at_tree_nodes_match_explicit_history(device: str) -> None:
    rng = random.Random(7)
    bs, n, vocab = 6, 9, 12
    trees = random_trees(rng, bs, n, vocab, device)
    logits = torch.randn(bs, n, vocab, generator=torch.Generator().manual_seed(7), dtype=torch.float64).to(device)
    prompts = [set(rng.sample(range(vocab), 3)) for _ in range(bs)]
    outputs = [[rng.randrange(vocab) for _ in range(rng.randint(0, 5))] + [int(trees.tokens[b, 0])] for b in range(bs)]
    base_counts = torch.zeros(bs, vocab, dtype=torch.long)
    prompt_mask = torch.zeros(bs, vocab, dtype=torch.bool)
    for b in range(bs):
        for token in outputs[b]:                       # committed output, the root included
            base_counts[b, token] += 1
        prompt_mask[b, list(prompts[b])] = True
    rep, freq, pres = torch.tensor([1.0, 1.3, 0.8, 1.5, 1.2, 2.0]), torch.linspace(-0.5, 1.0, bs), torch.linspace(1.0, -1.0, bs)
    out = apply_penalties_to_tree(logits, trees, base_counts.to(device), prompt_mask.to(device),
                                  rep.to(device), freq.to(device), pres.to(device)).cpu()
    for b in range(bs):
        tokens, parents = trees.tokens[b].tolist(), trees.parents[b].tolist()
        for i in range(n):
            path = []
            if i < int(trees.num_nodes[b]):
                node = i
                while node > 0:                         # node i and its ancestors, the root excluded
                    path.append(tokens[node])
                    node = parents[node]
            expected = reference_penalties(logits[b, i].tolist(), outputs[b] + path[::-1], prompts[b],
                                           float(rep[b]), float(freq[b]), float(pres[b]))
            np.testing.assert_allclose(out[b, i].numpy(), expected, rtol=1e-12, atol=1e-12)
