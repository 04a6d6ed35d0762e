"""Forecast drafts: a verify step N + 1 launched before step N's outcome is read, its drafts
picked on the device from a table the host made while N ran.

A drafting step's next drafts continue the tokens it commits, so they are normally proposed
once its outcome is on the host: the read, the commit, the proposal and the launch then lie
between two steps on the GPU. A drafter whose proposals are cheap (the n-gram trie) can
instead propose, while N runs, for each way N may end: its last accepted node j (the
context is then N's root path to j) and the target's token after it (its bonus token,
which is none of j's children: they were rejected), the drafter's likeliest bonus tokens
each with the tree that would follow it. N's outcome picks the entry on the device; where
none matches the bonus token, step N + 1 verifies its root alone (one token, at a verify
step's cost).

The table, (bs, R, C, 2n + 1) int64 for R = N's nodes, C candidates a node and next trees of
up to n nodes (root included); entry [b, j, c]:
    [0]            the bonus token it is for (the next tree's root); -1: no entry
    [1 .. n-1]     the next tree's drafts (nodes 1 .. n - 1), 0 past its nodes
    [n .. 2n-2]    their parents (the root is node 0), -1 past its nodes
    [2n - 1]       the next tree's nodes, root included (1 .. n)
    [2n]           the drafter's evidence class for it (its proposal key)
The first matching candidate wins, on the device (`select_on_device`) and on the host
(`pick`) alike.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specserve.kv.pool import PADDING_SLOT
from specserve.runner.tree_step import TreeStepInputs
from specserve.verify.tree import TreeProposal

NO_ENTRY = -1


def table_width(nodes: int) -> int:
    """An entry's int64 fields for next trees of up to `nodes` nodes."""
    return 2 * nodes + 1


def empty_table(batch: int, rows: int, candidates: int, nodes: int) -> np.ndarray:
    """A table with no entries."""
    table = np.zeros((batch, rows, candidates, table_width(nodes)), dtype=np.int64)
    table[..., 0] = NO_ENTRY
    table[..., nodes:2 * nodes - 1] = -1
    table[..., 2 * nodes - 1] = 1
    return table


def set_entry(table: np.ndarray, b: int, j: int, c: int, root: int, tokens, parents, key: int) -> None:
    """Entry [b, j, c]: bonus token `root`, then the tree's drafts (tokens, parents counted
    from the root as node 0), at most n - 1 of them."""
    n = (table.shape[-1] - 1) // 2
    count = len(tokens)
    if count > n - 1:
        raise ValueError(f"a forecast tree holds at most {n - 1} drafts, got {count}")
    entry = table[b, j, c]
    entry[0] = root
    entry[1:1 + count] = tokens
    entry[n:n + count] = parents
    entry[2 * n - 1] = 1 + count
    entry[2 * n] = key


def has_entries(table: np.ndarray) -> bool:
    """Whether any outcome would find an entry (else every tree the table gives is a root)."""
    return bool((table[..., 0] != NO_ENTRY).any())


@dataclass
class Picked:
    """The trees N's outcome picked, on the host: the table's (`full`, what the drafter
    proposes: the adaptive policy's shadows) and their first `nodes` nodes each (`verified`,
    what step N + 1 verifies)."""
    full: TreeProposal          # (bs, table's n)
    verified: TreeProposal      # (bs, nodes)
    keys: list[int]
    found: np.ndarray           # (bs,) bool: whether the request's bonus token had an entry


def pick(table: np.ndarray, accept_lens: np.ndarray, accepted: np.ndarray, tokens: list[list[int]],
         nodes: int | None = None) -> Picked:
    """What `select_on_device` picks, from N's outcome on the host (GreedyOutcome's fields:
    accept lengths, accepted nodes, committed tokens per request), for a step of `nodes`
    nodes a request (default: the table's n)."""
    bs, _, _, width = table.shape
    n = (width - 1) // 2
    out_tokens = np.zeros((bs, n), dtype=np.int64)
    parents = np.full((bs, n), -1, dtype=np.int64)
    num_nodes, keys, found = [1] * bs, [0] * bs, np.zeros(bs, dtype=bool)
    for b in range(bs):
        bonus = tokens[b][-1]
        out_tokens[b, 0] = bonus
        last = int(accepted[b, int(accept_lens[b]) - 1])
        for entry in table[b, last]:
            if entry[0] == bonus:
                count = int(entry[2 * n - 1])
                out_tokens[b, 1:count] = entry[1:count]
                parents[b, 1:count] = entry[n:n - 1 + count]
                num_nodes[b], keys[b], found[b] = count, int(entry[2 * n]), True
                break
    full = TreeProposal(out_tokens, parents, np.asarray(num_nodes, dtype=np.int64))
    nodes = n if nodes is None else nodes
    if nodes == n:
        return Picked(full, full, keys, found)
    verified = TreeProposal(out_tokens[:, :nodes].copy(), parents[:, :nodes].copy(), np.minimum(full.num_nodes, nodes))
    return Picked(full, verified, keys, found)


def select_on_device(inputs: TreeStepInputs, outcome: torch.Tensor, table: torch.Tensor,
                     node_slots: torch.Tensor) -> None:
    """Rewrites the first bs requests of `inputs` (filled by the host for step N + 1: its
    table rows, N's prefix lengths, padding past its nodes) from N's greedy outcome (bs, 1 +
    2m: tree_step.commit_path's) and the forecast table (bs, R, C, 2n + 1): the picked trees'
    first `nodes` nodes (node_slots: (bs, nodes), nodes <= n; a tree's first nodes are a tree:
    parents precede children), their tokens, parents and node counts, the node slots of their
    real nodes (PADDING_SLOT past them), and prefix lengths longer by what N commits. No host
    sync. On CUDA one Triton kernel (forecast_kernel.py) instead of ~25 small torch kernels."""
    if table.is_cuda:
        from specserve.runner import forecast_kernel   # lazily: CPU-only installs never import Triton
        forecast_kernel.select(inputs.tokens, inputs.parents, inputs.out_slots, inputs.num_nodes, inputs.prefix_lens,
                               outcome, table, node_slots, PADDING_SLOT)
    else:
        select_with_torch(inputs, outcome, table, node_slots)


def select_with_torch(inputs: TreeStepInputs, outcome: torch.Tensor, table: torch.Tensor,
                      node_slots: torch.Tensor) -> None:
    """select_on_device in torch ops: the CPU's, and the kernel's reference."""
    bs, _, candidates, width = table.shape
    n, nodes = (width - 1) // 2, node_slots.shape[1]
    m = (outcome.shape[1] - 1) // 2
    last_index = (outcome[:, :1] - 1).clamp(min=0)                       # (bs, 1)
    bonus = outcome[:, 1 + m:].gather(1, last_index)                    # (bs, 1) N's last committed token
    last_node = outcome[:, 1:1 + m].gather(1, last_index).clamp(min=0)   # N's last accepted node
    rows = table.gather(1, last_node.view(bs, 1, 1, 1).expand(bs, 1, candidates, width)).squeeze(1)   # (bs, C, W)
    hit = rows[:, :, 0] == bonus                                          # (bs, C)
    first = hit.to(torch.int32).argmax(dim=1)                             # the first hit (0 where none)
    entry = rows.gather(1, first.view(bs, 1, 1).expand(bs, 1, width)).squeeze(1)   # (bs, W)
    count = torch.where(hit.any(dim=1), entry[:, 2 * n - 1], 1).clamp(max=nodes)   # (bs,)
    real = torch.arange(nodes, device=count.device).unsqueeze(0) < count.unsqueeze(1)   # (bs, nodes)
    drafts = torch.where(real[:, 1:], entry[:, 1:nodes], 0)
    parents = torch.where(real[:, 1:], entry[:, n:n + nodes - 1], -1)
    inputs.tokens[:bs, :nodes] = torch.cat([bonus, drafts], dim=1)
    inputs.parents[:bs, :nodes] = torch.cat([parents.new_full((bs, 1), -1), parents], dim=1)
    inputs.out_slots[:bs, :nodes] = torch.where(real, node_slots, PADDING_SLOT)
    inputs.num_nodes[:bs] = count
    inputs.prefix_lens[:bs] += outcome[:, 0]
