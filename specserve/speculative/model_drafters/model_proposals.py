"""Turning a model drafter's device output into the TreeProposal a verify step takes: chains
(STANDALONE, EAGLE with top-k 1) and EAGLE-2 trees, each cut to what its request may
still commit; and which requests get sampled drafts."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from specserve.verify.tree import TreeProposal

if TYPE_CHECKING:
    from specserve.request.req import Req


def chain_proposal(max_nodes: list[int], roots: list[int], drafted: list[int], drafts: list[list[int]],
                   probs: torch.Tensor | None, num_steps: int) -> tuple[TreeProposal, list[int]]:
    """Chains of up to K + 1 nodes (the root, then the drafts) for the requests `drafted`
    (indices into the batch), each cut to its max_nodes; the others' roots alone. probs:
    the drafted rows' q (len(drafted), K + 1, V), or None."""
    bs = len(roots)
    if not drafted:
        return TreeProposal.root_only(roots), [1] * bs
    n = num_steps + 1
    tokens = np.zeros((bs, n), dtype=np.int64)
    tokens[:, 0] = roots
    num_nodes = np.ones(bs, dtype=np.int64)
    tokens[drafted, 1:] = drafts
    num_nodes[drafted] = np.minimum(n, np.asarray(max_nodes)[drafted])
    real = np.arange(n) < num_nodes[:, None]
    tokens = np.where(real, tokens, 0)               # padding nodes: token 0, parent -1
    parents = np.where(real, np.arange(n) - 1, -1)
    if probs is not None and len(drafted) < bs:      # rows without drafts: no q
        full = probs.new_zeros((bs, *probs.shape[1:]))
        full[torch.tensor(drafted, device=probs.device)] = probs
        probs = full
    return TreeProposal(tokens, parents, num_nodes, probs), num_nodes.tolist()


def tree_proposal(max_nodes: list[int], roots: list[int], drafted: list[int], trees: list[list[int]],
                  num_nodes: int) -> tuple[TreeProposal, list[int]]:
    """Trees of up to num_nodes nodes for the requests `drafted`: trees[i] is draft_tree's
    row (num_nodes - 1 tokens, then their parents as node numbers), best first, so each is
    cut to its max_nodes by keeping its first nodes."""
    bs = len(roots)
    if not drafted:
        return TreeProposal.root_only(roots), [1] * bs
    packed = np.asarray(trees, dtype=np.int64).reshape(len(drafted), 2, num_nodes - 1)
    tokens = np.zeros((bs, num_nodes), dtype=np.int64)
    parents = np.full((bs, num_nodes), -1, dtype=np.int64)
    tokens[:, 0] = roots
    tokens[drafted, 1:] = packed[:, 0]
    parents[drafted, 1:] = packed[:, 1]
    sizes = np.ones(bs, dtype=np.int64)
    sizes[drafted] = np.minimum(num_nodes, np.asarray(max_nodes)[drafted])
    real = np.arange(num_nodes) < sizes[:, None]
    return TreeProposal(np.where(real, tokens, 0), np.where(real, parents, -1), sizes), sizes.tolist()


def draft_temperature(req: "Req") -> float:
    """The temperature a request's drafts are sampled at; 0: argmax drafts (greedy requests,
    and seeded ones, which the coupled rule verifies; see the module docstring)."""
    params = req.params
    if params.greedy or params.seed is not None:
        return 0.0
    return params.temperature
