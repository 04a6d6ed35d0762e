"""DraftTrees: a batch of draft trees, one per request, all padded to n nodes.

Conventions:
- node 0 is the root: the last committed token. It is NOT in the KV cache yet (it was
  sampled by the previous step), so the verify forward runs all n nodes, root included.
- parents are topological: parents[b, i] < i, parents[b, 0] = -1.
- nodes num_nodes[b] .. n-1 of row b are padding: parent -1, depth 0, they see only
  themselves, have no children and are no one's child.
- positions: the root sits at position prefix_len (the number of tokens already in the
  KV cache); a node at depth d sits at prefix_len + d.
- children of a node are ordered by node index (drafters put their best guess first);
  verification tries them in that order.

Derived tensors are built once, vectorised over batch and nodes: the only loops run
log2(n) pointer-doubling rounds. A drafter hands out a `TreeProposal` (the raw tokens and
parents, host numpy arrays): building the derived tensors costs a hundred microseconds of
torch dispatch on a host, so a verify step builds them on the device, inside its graph.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Sequence

import numpy as np
import torch


class _BatchOfTrees:
    """Shape accessors shared by the host and device forms (both have a (bs, n) `tokens`)."""
    tokens: np.ndarray | torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_slots(self) -> int:
        """n: nodes per tree, padding included."""
        return self.tokens.shape[1]


@dataclass(frozen=True)
class TreeProposal(_BatchOfTrees):
    """A batch of draft trees as a drafter proposes them, on the host: what one packed copy
    sends to a verify step. Same conventions as DraftTrees (padding: token 0, parent -1)."""
    tokens: np.ndarray      # (bs, n) int64
    parents: np.ndarray     # (bs, n) int64, -1 for the root and padding
    num_nodes: np.ndarray   # (bs,) int64, real nodes including the root
    # (bs, n, vocab) on the device, for drafts sampled from a distribution: [b, i] is the q
    # node i's children were drawn from (verify_sampling's draft_probs); None: deterministic drafts
    draft_probs: torch.Tensor | None = None

    @classmethod
    def from_lists(cls, rows: Sequence[tuple[Sequence[int], Sequence[int]]], n: int | None = None) -> TreeProposal:
        """From per-request (tokens, parents) lists, padded to n (default: the largest tree)."""
        sizes = [len(tokens) for tokens, _ in rows]
        n = max(sizes) if n is None else n
        if min(sizes) < 1 or max(sizes) > n:
            raise ValueError(f"tree sizes {sizes} must be in [1, {n}]")
        tokens = np.zeros((len(rows), n), dtype=np.int64)
        parents = np.full((len(rows), n), -1, dtype=np.int64)
        for row, (tok, par) in enumerate(rows):
            if len(par) != len(tok):
                raise ValueError(f"tree {row}: {len(tok)} tokens but {len(par)} parents")
            tokens[row, :len(tok)] = tok
            parents[row, :len(par)] = par
        return cls(tokens, parents, np.asarray(sizes, dtype=np.int64))

    @classmethod
    def root_only(cls, root_tokens: Sequence[int]) -> TreeProposal:
        tokens = np.asarray(root_tokens, dtype=np.int64).reshape(-1, 1)
        return cls(tokens, np.full_like(tokens, -1), np.ones(tokens.shape[0], dtype=np.int64))

    def cut(self, num_nodes: Sequence[int]) -> TreeProposal:
        """Tree i cut to its first num_nodes[i] nodes (1: its root alone; still trees: parents
        precede children), the width to the largest; the nodes cut off become padding
        (DraftTrees.build ignores them)."""
        nodes = np.minimum(self.num_nodes, np.asarray(num_nodes, dtype=np.int64))
        width = int(nodes.max())
        probs = None if self.draft_probs is None else self.draft_probs[:, :width]
        return TreeProposal(self.tokens[:, :width], self.parents[:, :width], nodes, probs)

    def rows(self, rows: Sequence[int]) -> TreeProposal:
        """The trees of these requests (indices into the batch), in that order."""
        index = np.asarray(rows, dtype=np.int64)
        probs = None if self.draft_probs is None else self.draft_probs[torch.from_numpy(index).to(self.draft_probs.device)]
        return TreeProposal(self.tokens[index], self.parents[index], self.num_nodes[index], probs)

    def keep(self, kept: np.ndarray) -> TreeProposal:
        """The trees with only the nodes `kept` (bs, n) bool marks, in their order (a kept
        node's parent must be kept: a cut removes whole subtrees), the width to the largest."""
        nodes = kept.sum(axis=1).astype(np.int64)
        width = int(nodes.max())
        old = np.zeros((self.batch_size, width), dtype=np.int64)       # [b, new node] = its old index
        for row in range(self.batch_size):
            old[row, :nodes[row]] = np.flatnonzero(kept[row])
        new_index = np.cumsum(kept, axis=1) - 1                          # [b, old node] = its new index
        rows = np.arange(self.batch_size)[:, None]
        real = np.arange(width)[None, :] < nodes[:, None]
        tokens = np.where(real, self.tokens[rows, old], 0)
        old_parents = self.parents[rows, old]
        parents = np.where(real & (old_parents >= 0), new_index[rows, np.maximum(old_parents, 0)], -1)
        probs = None if self.draft_probs is None else self.draft_probs[torch.from_numpy(rows), torch.from_numpy(old)]
        return TreeProposal(tokens, parents, nodes, probs)

    def trees(self, device: torch.device | str | None = None) -> DraftTrees:
        """The derived tensors (see DraftTrees.build), on `device`."""
        as_tensor = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(device)
        return DraftTrees.build(as_tensor(self.tokens), as_tensor(self.parents), as_tensor(self.num_nodes))


@dataclass(frozen=True)
class DraftTrees(_BatchOfTrees):
    tokens: torch.Tensor          # (bs, n) int64
    parents: torch.Tensor         # (bs, n) int64, -1 for the root and padding
    num_nodes: torch.Tensor       # (bs,) int64, real nodes including the root
    depth: torch.Tensor           # (bs, n) int64, root 0, padding 0
    ancestor_mask: torch.Tensor   # (bs, n, n) bool, [b, i, j] = j is i or an ancestor of i
    first_child: torch.Tensor     # (bs, n) int64, lowest-index child, -1 if none
    next_sibling: torch.Tensor    # (bs, n) int64, next child of the same parent, -1 if none

    @classmethod
    def build(cls, tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor) -> DraftTrees:
        """Derives depth, ancestor mask and child order from (tokens, parents, num_nodes).

        Parents of the root and of padding nodes are normalised to -1. Does not check that
        parents are topological (that needs a host sync): see `validate`. On CUDA, one
        Triton kernel (verify/tree_kernels.py) computes what the torch code below does.
        """
        bs, n = tokens.shape
        device = tokens.device
        if tokens.is_cuda:
            from specserve.verify import tree_kernels   # lazily: CPU-only installs never import Triton
            if n <= tree_kernels.MAX_NODES:
                num_nodes = num_nodes.to(device=device, dtype=torch.int64)
                parents, depth, mask, first_child, next_sibling = tree_kernels.build_trees(parents, num_nodes)
                return cls(tokens.to(torch.int64), parents, num_nodes, depth, mask, first_child, next_sibling)
        node = torch.arange(n, device=device)
        num_nodes = num_nodes.to(device=device, dtype=torch.int64)
        is_child = (node > 0) & (node < num_nodes.unsqueeze(1))          # (bs, n): real, not root
        parents = torch.where(is_child, parents.to(torch.int64), torch.full_like(parents, -1, dtype=torch.int64))

        # Pointer doubling: `jump` is each node's 2**k-th ancestor (the root and padding point
        # to themselves); after round k, mask[i] holds the ancestors within distance 2**k.
        jump = torch.where(is_child, parents, node.expand(bs, n))
        mask = torch.eye(n, dtype=torch.bool, device=device).expand(bs, n, n).clone()
        mask.scatter_(2, jump.unsqueeze(2), True)
        reach = 1
        while reach < n - 1:
            mask |= mask.gather(1, jump.unsqueeze(2).expand(bs, n, n))
            jump = jump.gather(1, jump)
            reach *= 2
        depth = mask.sum(dim=2) - 1

        # first child: the lowest child index per parent (scatter-min; non-children send n to row 0)
        sentinel = torch.full((bs, n), n, dtype=torch.int64, device=device)
        child_index = torch.where(is_child, node.expand(bs, n), sentinel)
        first_child = sentinel.scatter_reduce(1, parents.clamp(min=0), child_index, "amin")
        # next sibling: the lowest later node with the same parent
        same_parent = ((parents.unsqueeze(2) == parents.unsqueeze(1))
                       & is_child.unsqueeze(2) & is_child.unsqueeze(1)
                       & (node.view(1, 1, n) > node.view(1, n, 1)))              # (bs, i, j)
        next_sibling = torch.where(same_parent, node.view(1, 1, n), n).amin(dim=2)
        first_child = torch.where(first_child == n, -1, first_child)
        next_sibling = torch.where(next_sibling == n, -1, next_sibling)
        return cls(tokens.to(torch.int64), parents, num_nodes, depth, mask, first_child, next_sibling)

    @classmethod
    def from_lists(cls, trees: Sequence[tuple[Sequence[int], Sequence[int]]], n: int | None = None,
                   device: torch.device | str | None = None) -> DraftTrees:
        """From per-request (tokens, parents) lists; pads to n (default: the largest tree)
        with token 0 and parent -1."""
        return TreeProposal.from_lists(trees, n).trees(device)

    @classmethod
    def chain(cls, tokens: torch.Tensor, num_nodes: torch.Tensor | None = None) -> DraftTrees:
        """Chains: node i's parent is i - 1. tokens (bs, n), tokens[:, 0] the roots."""
        bs, n = tokens.shape
        parents = (torch.arange(n, device=tokens.device) - 1).expand(bs, n)
        if num_nodes is None:
            num_nodes = torch.full((bs,), n, dtype=torch.int64, device=tokens.device)
        return cls.build(tokens, parents, num_nodes)

    @classmethod
    def root_only(cls, root_tokens: torch.Tensor) -> DraftTrees:
        """n = 1 trees: a plain decode step. Built directly: every decode step makes one."""
        tokens = root_tokens.view(-1, 1).to(torch.int64)
        bs, device = tokens.shape[0], tokens.device
        minus_one = torch.full((bs, 1), -1, dtype=torch.int64, device=device)
        return cls(tokens, minus_one, torch.ones(bs, dtype=torch.int64, device=device),
                   torch.zeros((bs, 1), dtype=torch.int64, device=device),
                   torch.ones((bs, 1, 1), dtype=torch.bool, device=device), minus_one, minus_one)

    def positions(self, prefix_lens: torch.Tensor) -> torch.Tensor:
        """(bs, n) positions: prefix_lens[b] (tokens already in the KV cache, = the root's
        position) + depth. Padding nodes get the root's position."""
        return prefix_lens.to(torch.int64).unsqueeze(1) + self.depth

    def head(self, bs: int, n: int) -> DraftTrees:
        """The first bs trees, each cut to its first n nodes, when nodes n.. of those trees
        are padding (nothing refers to them)."""
        if (bs, n) == tuple(self.tokens.shape):
            return self
        return DraftTrees(self.tokens[:bs, :n], self.parents[:bs, :n], self.num_nodes[:bs], self.depth[:bs, :n],
                          self.ancestor_mask[:bs, :n, :n], self.first_child[:bs, :n], self.next_sibling[:bs, :n])

    def to(self, device: torch.device | str) -> DraftTrees:
        return DraftTrees(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def validate(self) -> None:
        """Checks the invariants (syncs with the host: for tests and debugging)."""
        n = self.num_slots
        node = torch.arange(n, device=self.tokens.device)
        real = node < self.num_nodes.unsqueeze(1)
        if bool(((self.num_nodes < 1) | (self.num_nodes > n)).any()):
            raise ValueError("num_nodes must be in [1, n]")
        child = real & (node > 0)
        if bool((child & ((self.parents < 0) | (self.parents >= node))).any()):
            raise ValueError("parents must satisfy 0 <= parents[i] < i for real non-root nodes")


def smallest_level(levels: list[int], requests: int, nodes: int) -> int:
    """The smallest of `levels` (sorted tokens per request) whose requests * level tokens
    hold `nodes`; the largest if none does."""
    for level in levels:
        if nodes <= requests * level:
            return level
    return levels[-1]
