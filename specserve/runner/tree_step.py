"""The device side of a decode or verify step: one packed input buffer, the target's
forward over every draft-tree node, and greedy verification with the KV-table commit of
the accepted path, so that a step costs one host-to-device copy, one forward and one
device-to-host copy of the outcome.

The host sends only what a drafter proposes (tokens, parents, node counts) and where the
nodes go (KV slots, table rows, prefix lengths); depth, positions and the ancestor mask
are derived on the device (`DraftTrees.build`: a hundred microseconds of torch dispatch on
a host, one Triton kernel on a GPU, as is the greedy commit after the argmax: see
tree_kernels.py). The same functions run eagerly (CPU, batches larger than the graphs) and
inside a CUDA graph per (batch bucket, draft size), see cuda_graph.py.

Padding: rows past the batch are requests with one node (token 0, KV slot PADDING_SLOT,
prefix 0, table row `KVPool.scratch_row`); nodes past a tree's node count are padding nodes
(see DraftTrees). Neither is ever accepted, and their table writes land in the scratch row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from specserve.attention.base import ForwardBatch, ForwardMode
from specserve.kv.pool import PADDING_SLOT, KVPool
from specserve.model.hidden_capture import HiddenCapture
from specserve.speculative.tree import DraftTrees, TreeProposal
from specserve.speculative.verify import VerifyResult, verify_greedy


@dataclass
class TreeStepInputs:
    """Views into one packed int64 buffer (on the host, pinned for graphs, or the device)."""
    packed: torch.Tensor
    tokens: torch.Tensor        # (bs, n) node tokens, the root first
    parents: torch.Tensor       # (bs, n) -1 for the root and padding
    out_slots: torch.Tensor     # (bs, n) KV slot of each node, PADDING_SLOT for padding
    num_nodes: torch.Tensor     # (bs,)
    req_rows: torch.Tensor      # (bs,) req_to_token rows
    prefix_lens: torch.Tensor   # (bs,) tokens already in each request's cache = the root's position

    @classmethod
    def allocate(cls, bs: int, n: int, device, pin: bool = False) -> TreeStepInputs:
        return cls.view(torch.zeros(3 * bs * n + 3 * bs, dtype=torch.long, device=device, pin_memory=pin), bs, n)

    @classmethod
    def view(cls, packed: torch.Tensor, bs: int, n: int) -> TreeStepInputs:
        rows = bs * n
        parts = packed.split([rows, rows, rows, bs, bs, bs])
        return cls(packed, parts[0].view(bs, n), parts[1].view(bs, n), parts[2].view(bs, n), *parts[3:])

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    def fill(self, proposal: TreeProposal, node_slots: list[int], req_rows: list[int], kv_lens: list[int],
             scratch_row: int) -> None:
        """Writes a batch of `proposal.batch_size` requests with trees of up to this buffer's
        n nodes into a host buffer (through numpy views: a torch op per field costs
        microseconds of dispatch); the rows after it become padding requests.
        node_slots: proposal.num_slots slots per request, PADDING_SLOT for padding nodes."""
        bs, m = proposal.tokens.shape
        tokens, parents, slots, num_nodes, rows, prefix = self._host_arrays()
        tokens.fill(0)
        tokens[:bs, :m] = proposal.tokens
        parents.fill(-1)
        parents[:bs, :m] = proposal.parents
        slots.fill(PADDING_SLOT)
        slots[:bs, :m] = np.asarray(node_slots, dtype=np.int64).reshape(bs, m)
        num_nodes.fill(1)
        num_nodes[:bs] = proposal.num_nodes
        rows.fill(scratch_row)
        rows[:bs] = req_rows
        prefix.fill(0)
        prefix[:bs] = kv_lens

    def fill_decode(self, roots: list[int] | None, slots: list[int], req_rows: list[int], kv_lens: list[int],
                    scratch_row: int) -> None:
        """A decode step's four per-request fields (roots None: they come on the device), the
        rows after the batch padding: in a buffer of one node per request whose parents (-1)
        and node counts (1) never change, `fill`'s other writes are the same every step."""
        tokens, _, out_slots, _, rows, prefix = self._host_arrays()
        bs = len(req_rows)
        if roots is not None:
            tokens[:bs, 0] = roots
        out_slots[:bs, 0] = slots
        out_slots[bs:, 0] = PADDING_SLOT
        rows[:bs] = req_rows
        rows[bs:] = scratch_row
        prefix[:bs] = kv_lens
        prefix[bs:] = 0


    def _host_arrays(self) -> tuple[np.ndarray, ...]:
        """numpy views of the six fields, made once per buffer (a .numpy() costs ~0.7 us and a
        graph's host buffer is filled every step)."""
        arrays = self.__dict__.get("_arrays")
        if arrays is None:
            arrays = self.__dict__["_arrays"] = tuple(t.numpy() for t in (
                self.tokens, self.parents, self.out_slots, self.num_nodes, self.req_rows, self.prefix_lens))
        return arrays


def pad_node_slots(slots: list[int] | np.ndarray, num_nodes: list[int] | np.ndarray, n: int) -> np.ndarray:
    """(bs, n) each request's node slots (`slots`: request after request), padded to n with
    the padding slot."""
    num_nodes = np.asarray(num_nodes, dtype=np.int64)
    padded = np.full((len(num_nodes), n), PADDING_SLOT, dtype=np.int64)
    padded[np.arange(n) < num_nodes[:, None]] = slots   # row-major: request after request
    return padded


@dataclass
class TreeStepOutputs:
    """What a step leaves on the device (views into graph-owned memory when replayed: valid
    until the same graph runs again)."""
    logits: torch.Tensor            # (bs, n, vocab) fp32
    trees: DraftTrees | None        # None for n = 1 (root-only trees are not built)
    outcome: torch.Tensor | None    # (bs, 1 + 2n) int64 greedy outcome, see commit_path; None for n = 1
    hidden: torch.Tensor | None = None   # (bs, n, features) the states `capture` asked for (an EAGLE drafter's)


def forward_tree(model, backend, pool: KVPool, inputs: TreeStepInputs,
                 plan: Callable[[ForwardBatch], None], kv_lens_host: list[int] | None = None,
                 commit: bool = True, capture: HiddenCapture | None = None) -> TreeStepOutputs:
    """The target's forward over every node of every tree and, with `commit`, the KV-table
    entries of what the step commits: for n > 1 (a verify step) the greedy outcome with the
    accepted path's slots, for n = 1 (a decode step) each request's one slot (write_decode_slots).
    kv_lens_host: the prefix lengths on the host, for eager planning (a
    graph plans for the longest context instead). capture: hidden states to keep besides the
    logits (a template: see HiddenCapture.fresh)."""
    bs, n = inputs.shape
    trees = None
    if n == 1:
        mode, positions, tree_mask = ForwardMode.DECODE, inputs.prefix_lens, None
    else:
        trees = DraftTrees.build(inputs.tokens, inputs.parents, inputs.num_nodes)
        mode, positions, tree_mask = ForwardMode.VERIFY, inputs.prefix_lens.unsqueeze(1) + trees.depth, trees.ancestor_mask
    device = inputs.tokens.device
    batch = ForwardBatch(
        mode=mode, input_ids=inputs.tokens.reshape(-1), positions=positions.reshape(-1),
        out_slots=inputs.out_slots.reshape(-1), req_rows=inputs.req_rows, prefix_lens=inputs.prefix_lens,
        extend_lens=torch.full((bs,), n, dtype=torch.long, device=device),
        prefix_lens_host=kv_lens_host if kv_lens_host is not None else [0] * bs, extend_lens_host=[n] * bs,
        kv_pool=pool, logits_indices=torch.arange(bs * n, device=device), tree_mask=tree_mask,
        hidden_capture=capture.fresh() if capture is not None else None)
    plan(batch)
    logits = model(batch, backend).view(bs, n, -1)
    if trees is None and commit:   # a decode step: its one slot is committed whatever its token
        write_decode_slots(inputs, pool)
    outcome = greedy_commit(trees, logits, inputs, pool) if trees is not None and commit else None
    hidden = batch.hidden_capture.features().view(bs, n, -1) if capture is not None else None
    return TreeStepOutputs(logits, trees, outcome, hidden)


def write_decode_slots(inputs: TreeStepInputs, pool: KVPool) -> None:
    """req_to_token[row, prefix] = the step's slot, for every request of a decode step (n = 1),
    inside the step (its graph): the step after it, launched before this one's tokens reach
    the host, reads the entry, and no table write of its own is queued per step (a list to
    tensor, a pinned copy and an index_put: ~70-100 us of host time at 64 requests).
    Padding requests write their padding slot into the scratch row."""
    pool.req_to_token[inputs.req_rows, inputs.prefix_lens] = inputs.out_slots[:, 0].to(pool.req_to_token.dtype)


def greedy_commit(trees: DraftTrees, logits: torch.Tensor, inputs: TreeStepInputs, pool: KVPool) -> torch.Tensor:
    """Greedy verification and its KV-table commit (commit_path). On CUDA: the argmax, then
    one Triton kernel (tree_kernels.verify_commit) instead of ~25 small torch kernels."""
    if trees.tokens.is_cuda:
        from specserve.speculative import tree_kernels   # lazily: CPU-only installs never import Triton
        if trees.num_slots <= tree_kernels.MAX_NODES:
            return tree_kernels.verify_commit(logits.argmax(dim=-1), trees.tokens, trees.parents, trees.depth,
                                              trees.ancestor_mask, inputs.out_slots, inputs.req_rows,
                                              inputs.prefix_lens, pool.req_to_token)
    return commit_path(verify_greedy(trees, logits), inputs, pool)


def commit_path(result: VerifyResult, inputs: TreeStepInputs, pool: KVPool) -> torch.Tensor:
    """req_to_token[row, prefix + d] = the KV slot of the accepted path's node at depth d,
    for d < accept length (the other writes go to the scratch row: positions past a
    request's committed length are never read before they are rewritten).

    Returns (bs, 1 + 2n) int64: the accept length k, the accepted nodes (root first, -1
    after), the committed tokens (k of them, -1 after): one copy brings it all to the host."""
    bs, n = result.accepted_nodes.shape
    depth = torch.arange(n, device=result.accepted_nodes.device).expand(bs, n)
    on_path = depth < result.accept_lens.unsqueeze(1)
    path_slots = inputs.out_slots.gather(1, result.accepted_nodes.clamp(min=0))
    rows = torch.where(on_path, inputs.req_rows.unsqueeze(1), pool.scratch_row)
    columns = torch.where(on_path, inputs.prefix_lens.unsqueeze(1) + depth, depth)
    pool.req_to_token[rows, columns] = path_slots.to(pool.req_to_token.dtype)
    return torch.cat([result.accept_lens.unsqueeze(1), result.accepted_nodes, result.committed_tokens], dim=1)


@dataclass
class GreedyOutcome:
    """The host's view of a verify step's greedy outcome."""
    tokens: list[list[int]]     # per request: committed tokens, accepted drafts then the bonus
    accepted: np.ndarray        # (bs, n) accepted node indices, root first, -1 after
    accept_lens: np.ndarray     # (bs,) accepted nodes (= committed tokens)

    @classmethod
    def parse(cls, packed: torch.Tensor) -> GreedyOutcome:
        """packed: commit_path's (bs, 1 + 2n) outcome, on the host (one tolist: converting
        row by row costs microseconds per request)."""
        n = (packed.shape[1] - 1) // 2
        array = packed.numpy().copy()   # the packed buffer may be reused
        lens = array[:, 0]
        tokens = [row[:k] for row, k in zip(array[:, 1 + n:].tolist(), lens.tolist())]
        return cls(tokens, array[:, 1:1 + n], lens)

    @property
    def accepted_nodes(self) -> list[list[int]]:
        """Per request: the accepted node indices, root first."""
        return [row[:k] for row, k in zip(self.accepted.tolist(), self.accept_lens.tolist())]
