"""The coupled sampling rule (verify_sampling's default): with a seed, speculative decoding
commits exactly the tokens plain decoding samples, whatever the drafts, tree shapes, draft
sizes or batch; those tokens follow the target (chi-square, with a power control); and for
deterministic drafts it accepts as often as residual rejection."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specserve.verify import random as srandom
from specserve.verify import rules as verify_module
from specserve.verify.rules import verify_sampling
from specserve.verify.tree import DraftTrees
from tests.test_verify import FILTERS, P_MIN, MarkovTarget, draft_trees, joint_p_value

# a vocabulary of two full race blocks and a partial one; peaked rows, so drafts of likely
# tokens are often right
VOCAB = 2 * srandom.RACE_BLOCK + 88
LENGTH = 24
TABLE = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0)) * 3.0   # next-token logits
LIKELIEST = TABLE.argsort(dim=1, descending=True)[:, :3]                               # (V, 3)


def likely_trees(roots: torch.Tensor, n: int, gen: torch.Generator) -> DraftTrees:
    """Random shapes of up to n nodes; each child is one of the 3 likeliest tokens after its
    parent's token, picked at random: drafts that the target often accepts, and that change
    from one call to the next like a trie's."""
    bs = roots.shape[0]
    parents = torch.full((bs, n), -1, dtype=torch.long)
    tokens = torch.zeros((bs, n), dtype=torch.long)
    tokens[:, 0] = roots
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (bs,), generator=gen)
        parent_tokens = tokens.gather(1, parents[:, i:i + 1]).squeeze(1)
        tokens[:, i] = LIKELIEST[parent_tokens, torch.randint(0, 3, (bs,), generator=gen)]
    return DraftTrees.build(tokens, parents, torch.randint(1, n + 1, (bs,), generator=gen))


def generate(filters: tuple, seeds: torch.Tensor, tree_size, rule: str = "coupled",
             gen: torch.Generator | None = None) -> tuple[torch.Tensor, int]:
    """Decodes LENGTH tokens per row of TABLE's Markov chain from root token 0 at position 50;
    tree_size(step) is the step's draft size (1: a plain step). Returns ((bs, LENGTH) tokens,
    accepted draft tokens)."""
    bs = seeds.shape[0]
    roots, positions = torch.zeros(bs, dtype=torch.long), torch.full((bs,), 50)
    out = torch.full((bs, LENGTH + 16), -1, dtype=torch.long)
    count = torch.zeros(bs, dtype=torch.long)
    accepted, step = 0, 0
    while int(count.min()) < LENGTH:
        n = tree_size(step)
        trees = DraftTrees.root_only(roots) if n == 1 else likely_trees(roots, n, gen)
        result = verify_sampling(trees, TABLE[trees.tokens], *filters, seeds, positions, rule=rule)
        for j in range(result.committed_tokens.shape[1]):
            take = j < result.accept_lens
            out[take, (count + j)[take].clamp(max=out.shape[1] - 1)] = result.committed_tokens[take, j]
        accepted += int((result.accept_lens - 1).sum())
        count, positions = count + result.accept_lens, positions + result.accept_lens
        roots, step = result.bonus_tokens, step + 1
    return out[:, :LENGTH], accepted


def batch_filters(bs: int) -> tuple[torch.Tensor, ...]:
    """Per-row temperature / top-k / top-p / min-p, cycling through mixed settings."""
    rows = [(0.3, 0, 1.0, 0.0), (0.8, 40, 0.9, 0.0), (1.2, 0, 0.95, 0.05), (1.0, 0, 1.0, 0.0), (0.0, 0, 1.0, 0.0)]
    t, k, p, m = zip(*(rows[b % len(rows)] for b in range(bs)))
    return torch.tensor(t), torch.tensor(k), torch.tensor(p), torch.tensor(m)


def test_speculative_output_equals_plain_output_whatever_the_drafts() -> None:
    bs = 12
    seeds = torch.arange(bs) * 7_919 + 1
    filters = batch_filters(bs)
    plain, _ = generate(filters, seeds, lambda step: 1)
    for sizes, draft_seed in [((2, 4), 1), ((16,), 2), ((1, 8, 3, 16, 5), 3)]:
        gen = torch.Generator().manual_seed(draft_seed)
        spec, accepted = generate(filters, seeds, lambda step: sizes[step % len(sizes)], gen=gen)
        assert accepted > bs * 4, "too few drafts accepted for the test to mean anything"
        assert torch.equal(spec, plain), f"sizes {sizes}: rows {(spec != plain).any(1).nonzero().flatten().tolist()}"
    # a row alone, or in another batch, gets the same tokens
    rows = torch.tensor([7, 3, 10])
    sub_filters = tuple(f[rows] for f in filters)
    alone, _ = generate(sub_filters, seeds[rows], lambda step: 6, gen=torch.Generator().manual_seed(5))
    assert torch.equal(alone, plain[rows])


def test_residual_rejection_output_depends_on_the_drafts() -> None:
    """What the coupled rule fixes: with residual rejection the drafts change a seeded output."""
    bs = 12
    seeds, filters = torch.arange(bs) * 7_919 + 1, batch_filters(bs)
    plain, _ = generate(filters, seeds, lambda step: 1, rule="rejection")
    spec, _ = generate(filters, seeds, lambda step: 8, rule="rejection", gen=torch.Generator().manual_seed(1))
    assert (spec != plain).any(dim=1).sum() > bs // 4


COUPLED_CASES = [("t1", "top"), ("t1", "uniform"), ("t1", "q_iid"), ("t0.7_p0.8", "top"), ("k3", "uniform"),
                 ("minp0.15", "unlikely")]


@pytest.mark.parametrize("filters,kind", COUPLED_CASES)
def test_coupled_sampling_is_lossless(filters: str, kind: str) -> None:
    assert joint_p_value(MarkovTarget(FILTERS[filters]), kind, rule="coupled") > P_MIN


def test_coupled_sampling_is_lossless_three_tokens() -> None:
    assert joint_p_value(MarkovTarget(FILTERS["t1"], seed=3), "top", length=3, seed=2, rule="coupled") > P_MIN


def test_chi_square_rejects_a_coupled_rule_that_reuses_the_root_position(monkeypatch: pytest.MonkeyPatch) -> None:
    """Power check: a verifier that keys every node's numbers by the root's position (so the
    tokens of an accepted path share their noise) does not sample the target."""
    race = srandom.exponential_race

    def root_position_race(probs, seeds, positions, salt=srandom.SALT_TOKEN):
        return race(probs, seeds, positions[:, :1].expand_as(positions), salt)

    monkeypatch.setattr(verify_module, "exponential_race", root_position_race)
    assert joint_p_value(MarkovTarget(FILTERS["t1"]), "top", rule="coupled") < 1e-6


def test_coupled_accepts_as_often_as_residual_rejection() -> None:
    """Deterministic drafts: a node's children are accepted with probability sum_j p(x_j)
    under both rules. Checked on one step of the same trees: the rate of accepting a child of
    the root against that exact value (z < 5 for each rule), and the mean accept lengths."""
    target, bs = MarkovTarget(FILTERS["t0.7_p0.8"]), 20_000
    gen = torch.Generator().manual_seed(8)
    roots = torch.randint(0, 8, (bs,), generator=gen)
    trees, _ = draft_trees(target, roots, "uniform", gen)
    temps, top_ks, top_ps, min_ps = (f[0].expand(bs) for f in target.filters)
    args = (trees, target.table[trees.tokens], temps, top_ks, top_ps, min_ps, torch.arange(bs) * 3 + 1,
            torch.full((bs,), 20))
    children = (trees.parents == 0)
    first_tokens = torch.where(children, trees.tokens, -1)
    root_probs = target.probs[roots]                                                 # (bs, V)
    distinct = torch.zeros_like(root_probs).scatter_(1, first_tokens.clamp(min=0), children.double())
    exact = (root_probs * (distinct > 0)).sum(1).mean().item()
    lengths = {}
    for rule in ("coupled", "rejection"):
        result = verify_sampling(*args, rule=rule)
        rate = (result.accept_lens > 1).double().mean().item()
        assert abs(rate - exact) < 5 * (exact * (1 - exact) / bs) ** 0.5, (rule, rate, exact)
        lengths[rule] = result.accept_lens.double()
    difference = lengths["coupled"].mean() - lengths["rejection"].mean()
    spread = ((lengths["coupled"].var() + lengths["rejection"].var()) / bs).sqrt()
    assert abs(difference) < 5 * spread, (lengths["coupled"].mean(), lengths["rejection"].mean())


def test_rule_errors_name_the_field() -> None:
    trees = DraftTrees.root_only(torch.zeros(2, dtype=torch.long))
    args = (trees, torch.zeros(2, 1, 5), torch.ones(2), torch.zeros(2, dtype=torch.long), torch.ones(2),
            torch.zeros(2), torch.arange(2), torch.arange(2))
    with pytest.raises(ValueError, match="rule must be one of"):
        verify_sampling(*args, rule="typo")
    with pytest.raises(ValueError, match="draft_probs"):
        verify_sampling(*args, torch.full((2, 1, 5), 0.2))
    assert np.array_equal(verify_sampling(*args, torch.full((2, 1, 5), 0.2), rule="rejection").accept_lens, [1, 1])
