"""The device side of a decode or verify step: one packed input buffer, the target's
forward over the draft trees' nodes (a verify step's real nodes only: `forward_ragged`),
and greedy verification with the KV-table commit of the accepted path, so that a step costs
one host-to-device copy, one forward and one device-to-host copy of the outcome.

The host sends only what a drafter proposes (tokens, parents, node counts) and where the
nodes go (KV slots, table rows, prefix lengths); depth, positions and the ancestor mask
are derived on the device (`DraftTrees.build`: a hundred microseconds of torch dispatch on
a host, one Triton kernel on a GPU, as is the greedy commit after the argmax: see
tree_kernels.py). The same functions run eagerly (CPU, batches larger than the graphs) and
inside a CUDA graph per (batch bucket, tokens per request), see cuda_graph.py.

Padding: rows past the batch are requests with one node (token 0, KV slot PADDING_SLOT,
prefix 0, table row `KVPool.scratch_row`); nodes past a tree's node count are padding nodes
(see DraftTrees), which a ragged step does not run (its padding tokens after the last
request's nodes belong to no request). None is ever accepted, and their table writes land
in the scratch row.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from specserve.attention.base import ForwardBatch, ForwardMode
from specserve.kv.pool import PADDING_SLOT, KVPool
from specserve.model.hidden_capture import HiddenCapture
from specserve.verify.rules import VerifyResult, accept_matching_children
from specserve.verify.tree import DraftTrees, TreeProposal


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


def set_roots(roots: torch.Tensor, inputs: TreeStepInputs) -> None:
    """(bs,) root tokens on the device into a step's inputs (a step launched before the step
    before it was read)."""
    inputs.tokens[:roots.shape[0], 0].copy_(roots)


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

    def node_logits(self, bs: int, m: int) -> torch.Tensor:
        """(bs, m, vocab): the first bs requests' first m nodes."""
        return self.logits[:bs, :m]

    def node_hidden(self, bs: int, m: int) -> torch.Tensor | None:
        return self.hidden[:bs, :m] if self.hidden is not None else None

    def logits_at(self, rows: list[int], nodes: list[int]) -> torch.Tensor:
        """(len(rows), vocab): node nodes[i] of request rows[i] (grammar/greedy_paths.py)."""
        return self.logits[_index(rows, self.logits), _index(nodes, self.logits)]


class RaggedStepOutputs:
    """What a ragged verify step leaves on the device, TreeStepOutputs' fields in its (bs, n)
    node layout: logits and hidden states are kept per token and gathered per node only when
    read (a sampling step reads them; (bs, n, vocab) fp32 is ~300 MB at 64 x 8 requests)."""

    def __init__(self, token_logits: torch.Tensor, node_rows: torch.Tensor, trees: DraftTrees,
                 outcome: torch.Tensor | None, token_hidden: torch.Tensor | None):
        self.token_logits, self.node_rows, self.trees, self.outcome = token_logits, node_rows, trees, outcome
        self.token_hidden = token_hidden

    @property
    def logits(self) -> torch.Tensor:
        return self.node_logits(*self.node_rows.shape)

    @property
    def hidden(self) -> torch.Tensor | None:
        return self.node_hidden(*self.node_rows.shape)

    def node_logits(self, bs: int, m: int) -> torch.Tensor:
        return self.token_logits[self.node_rows[:bs, :m]]

    def node_hidden(self, bs: int, m: int) -> torch.Tensor | None:
        return self.token_hidden[self.node_rows[:bs, :m]] if self.token_hidden is not None else None

    def logits_at(self, rows: list[int], nodes: list[int]) -> torch.Tensor:
        """(len(rows), vocab): node nodes[i] of request rows[i], without gathering the others."""
        return self.token_logits[self.node_rows[_index(rows, self.node_rows), _index(nodes, self.node_rows)]]


def _index(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(like.device, non_blocking=True)


def forward_tree(model, backend, pool: KVPool, inputs: TreeStepInputs,
                 plan: Callable[[ForwardBatch], None], kv_lens_host: list[int] | None = None,
                 commit: bool = True, capture: HiddenCapture | None = None,
                 token_budget: int | None = None, num_nodes_host: list[int] | None = None) -> TreeStepOutputs:
    """The target's forward over every node of every tree and, with `commit`, the KV-table
    entries of what the step commits: for n > 1 (a verify step) the greedy outcome with the
    accepted path's slots, for n = 1 (a decode step) each request's one slot (write_decode_slots).
    kv_lens_host: the prefix lens on the host, for eager planning (a graph plans for the
    longest context instead). capture: hidden states to keep besides the logits (a template:
    see HiddenCapture.fresh).

    token_budget (n > 1): a ragged step (`forward_ragged`): only the trees' real nodes go
    through the model, packed into this many tokens; num_nodes_host: their counts on the
    host, for eager planning. Without it every request's n nodes do (a fused step's chains)."""
    bs, n = inputs.shape
    if n > 1 and token_budget is not None:
        return forward_ragged(model, backend, pool, inputs, plan, token_budget, kv_lens_host, num_nodes_host,
                              commit, capture)
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


def forward_ragged(model, backend, pool: KVPool, inputs: TreeStepInputs, plan: Callable[[ForwardBatch], None],
                   token_budget: int, kv_lens_host: list[int] | None, num_nodes_host: list[int] | None,
                   commit: bool, capture: HiddenCapture | None) -> RaggedStepOutputs:
    """A verify step that runs only the trees' real nodes: request after request, packed into
    `token_budget` tokens (>= their sum; the rest are padding tokens of no request, at the
    padding slot). A step where few requests draft then costs about their nodes, not every
    request padded to the largest tree (at 64 requests and 8 nodes on an H200 a verify step
    is compute-bound: 512 tokens through a 1.5B model). The layout is derived on the device,
    so one captured graph serves any trees whose nodes fit its budget."""
    bs, n = inputs.shape
    trees = DraftTrees.build(inputs.tokens, inputs.parents, inputs.num_nodes)
    token_nodes, node_rows = ragged_layout(trees.num_nodes, n, token_budget)
    # the flat node fields, one padding entry after them (token 0 at position 0, the padding slot)
    pad = lambda t, fill: torch.cat([t.reshape(-1), t.new_full((1,), fill)])
    positions = inputs.prefix_lens.unsqueeze(1) + trees.depth
    device = inputs.tokens.device
    batch = ForwardBatch(
        mode=ForwardMode.VERIFY, input_ids=pad(inputs.tokens, 0)[token_nodes], positions=pad(positions, 0)[token_nodes],
        out_slots=pad(inputs.out_slots, PADDING_SLOT)[token_nodes], req_rows=inputs.req_rows,
        prefix_lens=inputs.prefix_lens, extend_lens=trees.num_nodes,
        prefix_lens_host=kv_lens_host if kv_lens_host is not None else [0] * bs,
        extend_lens_host=num_nodes_host if num_nodes_host is not None else [n] * bs,
        kv_pool=pool, logits_indices=torch.arange(token_budget, device=device), tree_mask=trees.ancestor_mask,
        hidden_capture=capture.fresh() if capture is not None else None, ragged=True)
    plan(batch)
    logits = model(batch, backend)                                        # (token_budget, vocab)
    outcome = None
    if commit:   # the argmax of each node, back in the (bs, n) layout (padding nodes' are never read)
        targets = torch.zeros(bs * n + 1, dtype=torch.int64, device=device)
        targets.scatter_(0, token_nodes, logits.argmax(dim=-1))
        outcome = commit_targets(trees, targets[:bs * n].view(bs, n), inputs, pool)
    hidden = batch.hidden_capture.features() if capture is not None else None
    return RaggedStepOutputs(logits, node_rows, trees, outcome, hidden)


def ragged_layout(num_nodes: torch.Tensor, n: int, token_budget: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(token_nodes, node_rows) of trees of num_nodes (bs,) real nodes in a (bs, n) layout
    packed into token_budget tokens: token_nodes (token_budget,) the flat node (b * n + i) of
    each token, bs * n for padding tokens; node_rows (bs, n) the token of each node (0 for
    padding nodes). Device ops of fixed shapes: a graph derives it every replay. Nodes past
    the budget would be dropped: callers size the budget to hold them."""
    bs = num_nodes.shape[0]
    real = (torch.arange(n, device=num_nodes.device) < num_nodes.unsqueeze(1)).reshape(-1)
    token = torch.cumsum(real, 0) - 1
    fits = real & (token < token_budget)
    token_nodes = torch.full((token_budget + 1,), bs * n, dtype=torch.int64, device=num_nodes.device)
    token_nodes.scatter_(0, torch.where(fits, token, token_budget), torch.arange(bs * n, device=num_nodes.device))
    return token_nodes[:token_budget], torch.where(fits, token, 0).view(bs, n)


def write_decode_slots(inputs: TreeStepInputs, pool: KVPool) -> None:
    """req_to_token[row, prefix] = the step's slot, for every request of a decode step (n = 1),
    inside the step (its graph): the step after it, launched before this one's tokens reach
    the host, reads the entry, and no table write of its own is queued per step (a list to
    tensor, a pinned copy and an index_put: ~70-100 us of host time at 64 requests).
    Padding requests write their padding slot into the scratch row."""
    pool.req_to_token[inputs.req_rows, inputs.prefix_lens] = inputs.out_slots[:, 0].to(pool.req_to_token.dtype)


def greedy_commit(trees: DraftTrees, logits: torch.Tensor, inputs: TreeStepInputs, pool: KVPool) -> torch.Tensor:
    """Greedy verification and its KV-table commit (commit_path), from the nodes' logits."""
    return commit_targets(trees, logits.argmax(dim=-1), inputs, pool)


def commit_targets(trees: DraftTrees, targets: torch.Tensor, inputs: TreeStepInputs, pool: KVPool) -> torch.Tensor:
    """Greedy verification and its KV-table commit, from the target's token after each node
    (bs, n). On CUDA: one Triton kernel (tree_kernels.verify_commit) instead of ~25 small
    torch kernels."""
    if trees.tokens.is_cuda:
        from specserve.verify import tree_kernels   # lazily: CPU-only installs never import Triton
        if trees.num_slots <= tree_kernels.MAX_NODES:
            return tree_kernels.verify_commit(targets, trees.tokens, trees.parents, trees.depth,
                                              trees.ancestor_mask, inputs.out_slots, inputs.req_rows,
                                              inputs.prefix_lens, pool.req_to_token)
    return commit_path(accept_matching_children(trees, targets), inputs, pool)


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
