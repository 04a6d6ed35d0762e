"""lab/sampled_accept_bias.py: per node, what rejection accepts (sum min(p, q)), what an
exact-match walk of a sampled draft counts (sum p q) and what an argmax draft gets
(p(argmax q)); a chain's tokens a step from them, each node given its parent's acceptance."""
from __future__ import annotations

import pytest
import torch

from lab.sampled_accept_bias import chain_tokens, node_probabilities


def test_a_head_that_matches_the_target_is_always_accepted_but_a_walk_counts_sum_p_squared():
    p = torch.tensor([[0.6, 0.3, 0.1], [0.5, 0.25, 0.25]])
    a, m, g = node_probabilities(p, p.clone()).unbind(1)
    assert a.tolist() == pytest.approx([1.0, 1.0])
    assert m.tolist() == pytest.approx([0.46, 0.375])
    assert g.tolist() == pytest.approx([0.6, 0.5])


def test_an_argmax_draft_gets_the_targets_probability_of_the_heads_top_token():
    p = torch.tensor([[0.9, 0.1]])
    q = torch.tensor([[0.45, 0.55]])
    assert node_probabilities(p, q)[0].tolist() == pytest.approx([0.55, 0.46, 0.1])


def test_a_chain_counts_each_node_given_its_parents_acceptance():
    per_node = torch.tensor([[[0.5, 0.5, 1.0], [0.5, 0.0, 1.0], [1.0, 1.0, 1.0]]])
    assert chain_tokens(per_node)[0].tolist() == pytest.approx([1 + 0.5 + 0.25 + 0.25, 1 + 0.5, 4.0])
