"""The fused chain step's device function (EAGLE / EAGLE3 with top-k 1, NAIVE_EAGLE, MTP): the
target verifies the chain [root, d1 .. dK] and the head drafts the next K tokens from the
target's states of the accepted positions in one function with no host sync, and its packed
inputs (FusedStepInputs). K = --speculative-num-steps (1 for NAIVE_EAGLE and MTP); n = K + 1
chain nodes. EAGLE-2's trees (top-k > 1) take the same step with a tree of n =
--speculative-num-draft-tokens nodes (at least K + 1) and the head's next tree (end of this
docstring). Separate from fused_chain.py, which launches it (a CUDA graph replay per batch
bucket and verification kind, or eagerly) and keeps the q table: this file is what one step
computes, the same whether captured or not.

Per request, with L tokens (the root at position L - 1, the pending drafts at L .. L + K - 1):
1. The target's VERIFY forward of the chain at positions L - 1 .. L + K - 1
   (tree_step.forward_tree), keeping its hidden states (bs, n, features).
2. Verification on the device: the argmax ("greedy"), or the request's temperature / top-k /
   top-p / min-p with the coupled rule ("coupled") or residual rejection with the q the
   drafts were drawn from ("rejection": q_table[request row], kept by the previous step).
   The accepted path's KV slots go into the target's req_to_token (tree_step.commit_path).
   A chain's accepted path is its first a nodes (a = the accept length, 1 .. n).
3. The head's chain (draft_chain.run_chain), fed on the device: rows L - 1 .. L + K - 1 in
   one VERIFY forward, row L - 1 + j reading the committed token at L + j and the target's
   state at L - 1 + j. Shapes are fixed: all n rows are always written, to slots the host
   reserved, but only the first a are real (num_fed = a): the others hold junk, the
   drafter's table marks them unset and the next step, whose rows start at L - 1 + a,
   writes them again. The head's state at the last real row gives the next draft 1, at
   position L + a; the K - 1 DECODE steps after it sit at rows L - 1 + a .. L + a + K - 3,
   whose slots are columns a .. a + K - 2 of the 2K reserved (rows L - 1 .. L + 2K - 2): a
   draft step overwrites a junk fed row or one of the K - 1 rows after them, never a real
   one, and the table needs no write on the device. A draft is the argmax, or a sample of
   q (keyed by seed and position, SALT_DRAFT) whose q is kept in q_table for the next
   step's rejection test.
   The head's table entries of the 2K reserved rows are written inside the step from the
   packed inputs (write_head_table): the host sends them once, with everything else.
4. The outcome, (bs, 1 + 2n + K) int64: accept length, accepted nodes (n), committed tokens
   (n), the next K drafts.

Eager steps (no graph: the CPU, a batch larger than the graphs) read the accept lengths on
the host between 2. and 3. when K > 1: eager attention plans the draft steps from exact host
lengths. Graphs plan from device state and need no such read.

Trees (top-k > 1): 1. and 2. take the tree as they take a chain (its parents; verification
is argmax, or the coupled rule: a tree's drafts are the head's top-k, never sampled, so there
is no q). The accepted path is at most the tree's depth + 1 = K + 1 nodes, so the head is fed
the same K + 1 rows, row L - 1 + j reading the committed token at L + j and the target's
state at the path's j-th node. draft_tree.run_tree then drafts from the last real row: its
K - 1 steps of top-k beams write the reserved slots after the fed rows' (each beam's table
row its own: the fed rows go into every beam's row here). The outcome ends with the next
tree, (bs, 2(n - 1)): its tokens best first, then their parents as node numbers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from specserve.attention.base import ForwardBatch
from specserve.kv.pool import PADDING_SLOT
from specserve.runner.tree_step import TreeStepInputs, commit_path, forward_tree, greedy_commit
from specserve.speculative.model_drafters.draft_chain import ChainInputs, FedSpan, constant_range, run_chain
from specserve.speculative.model_drafters.draft_tree import run_tree
from specserve.speculative.model_drafters.model_proposals import draft_temperature
from specserve.verify.rules import VerifyResult, verify_sampling
from specserve.verify.tree import DraftTrees, TreeProposal

if TYPE_CHECKING:
    from specserve.request.req import Req
    from specserve.runner.model_runner import ModelRunner
    from specserve.speculative.model_drafters.eagle_runner import EagleHeadRunner


@dataclass
class FusedStepInputs:
    """Views into one packed int64 buffer (host, pinned for graphs, or device)."""
    packed: torch.Tensor
    tree: TreeStepInputs              # the target's chains or trees (tree_step.py's fields), n nodes
    head_slots: torch.Tensor          # (bs, reserved_head_rows) a chain's: rows L - 1 .. L + 2K - 2; a tree's: its
                                      # K + 1 fed rows', then its draft steps' beams'
    head_rows: torch.Tensor           # (bs,) the head pool's table rows (a tree's: its first beam's)
    seeds: torch.Tensor               # (bs,)
    top_ks: torch.Tensor              # (bs,) vocabulary size for none
    temperatures: torch.Tensor        # (bs,) float64 views of int64 storage: the target's, 0 for greedy rows
    top_ps: torch.Tensor
    min_ps: torch.Tensor
    draft_temperatures: torch.Tensor  # 0: argmax drafts

    @classmethod
    def allocate(cls, bs: int, nodes: int, head_columns: int, device, pin: bool = False) -> FusedStepInputs:
        """nodes: the target's per request; head_columns: the head slots a request's step writes
        (eagle_runner.reserved_head_rows)."""
        size = 3 * bs * nodes + 3 * bs + bs * head_columns + 7 * bs
        return cls.view(torch.zeros(size, dtype=torch.long, device=device, pin_memory=pin), bs, nodes, head_columns)

    @classmethod
    def view(cls, packed: torch.Tensor, bs: int, nodes: int, head_columns: int) -> FusedStepInputs:
        tree_size = 3 * bs * nodes + 3 * bs
        parts = packed[tree_size:].split([bs * head_columns] + [bs] * 7)
        floats = [part.view(torch.float64) for part in parts[4:]]
        return cls(packed, TreeStepInputs.view(packed[:tree_size], bs, nodes), parts[0].view(bs, head_columns),
                   parts[1], parts[2], parts[3], *floats)

    def request_fields(self) -> list[torch.Tensor]:
        """Every per-request field (a request's row first), in the order of `padding`."""
        tree = self.tree
        return [tree.tokens, tree.parents, tree.out_slots, tree.num_nodes, tree.req_rows, tree.prefix_lens,
                self.head_slots, self.head_rows, self.seeds, self.top_ks, self.temperatures, self.top_ps,
                self.min_ps, self.draft_temperatures]

    @staticmethod
    def padding(scratch_rows: tuple[int, int]) -> list[int | float]:
        """What a padding request holds in each of request_fields: one node (token 0, the
        padding slot) at prefix 0 in the target's and the head's scratch rows, no filters."""
        return [0, -1, PADDING_SLOT, 1, scratch_rows[0], 0, PADDING_SLOT, scratch_rows[1], 0, 0, 0.0, 1.0, 0.0, 0.0]

    def fill(self, reqs: list["Req"], proposal: TreeProposal, node_slots: np.ndarray, head_slots: np.ndarray,
             head_rows: list[int], scratch_rows: tuple[int, int], vocab_size: int) -> None:
        """Writes the batch into a host buffer; rows after it become padding requests.
        head_slots: (len(reqs), head columns); scratch_rows: the target's and the head's padding rows.
        The per-request columns (head rows and sampling parameters) are rewritten only when
        the batch differs from the one this buffer last held (a graph's host buffer is
        filled every step, mostly for the same requests)."""
        count = len(reqs)
        self.tree.fill(proposal, node_slots, [r.row for r in reqs], [r.kv_len for r in reqs], scratch_rows[0])
        padding = self.padding(scratch_rows)[6:]   # head_slots' and the columns'
        slots = self._arrays()[0]
        slots[count:] = padding[0]
        slots[:count] = head_slots
        held = self.__dict__.get("_batch")
        if held is None or len(held[0]) != count or held[1] != head_rows or any(
                a is not b for a, b in zip(held[0], reqs)):
            self._fill_columns(reqs, head_rows, padding[1:], vocab_size)
            self.__dict__["_batch"] = (list(reqs), list(head_rows))   # copies: the caller's lists may change

    def _fill_columns(self, reqs: list["Req"], head_rows: list[int], padding: list[int | float],
                      vocab_size: int) -> None:
        count = len(reqs)
        columns = [   # in _arrays' order after head_slots
            head_rows, [r.seed for r in reqs], [r.params.top_k if r.params.top_k > 0 else vocab_size for r in reqs],
            [0.0 if r.params.greedy else r.params.temperature for r in reqs], [r.params.top_p for r in reqs],
            [r.params.min_p for r in reqs], [draft_temperature(r) for r in reqs]]
        for array, values, pad in zip(self._arrays()[1:], columns, padding):
            array[:count] = values
            array[count:] = pad

    def _arrays(self) -> tuple[np.ndarray, ...]:
        """numpy views of head_slots and the per-request columns, made once per buffer."""
        arrays = self.__dict__.get("_numpy")
        if arrays is None:
            arrays = self.__dict__["_numpy"] = tuple(t.numpy() for t in (
                self.head_slots, self.head_rows, self.seeds, self.top_ks, self.temperatures, self.top_ps,
                self.min_ps, self.draft_temperatures))
        return arrays


def run_fused_step(target: "ModelRunner", head: "EagleHeadRunner", inputs: FusedStepInputs, kind: str,
                   q_table: torch.Tensor | None, plan_target: Callable[[ForwardBatch], None],
                   plan_head: Callable[[ForwardBatch], None], probs_out: torch.Tensor | None,
                   kv_lens_host: list[int] | None = None, target_model=None) -> torch.Tensor:
    """The whole step on the device: (bs, 1 + 2n + K) int64 (see the module docstring).
    probs_out: (>= bs, K, vocab) float32 for the next drafts' q (sampling kinds), else None.
    kv_lens_host: the prefix lengths on the host, for eager planning (graphs plan without).
    target_model: the target's forward (default: the runner's, which broadcasts with tp > 1)."""
    model = target.model if target_model is None else target_model
    step = forward_tree(model, target.attn_backend, target.pool, inputs.tree, plan_target, kv_lens_host,
                        commit=False, capture=target.hidden_capture)
    outcome = _verify_and_commit(kind, step.trees, step.logits, inputs, q_table, target.pool)
    write_head_table(head.pool, inputs, head.topk, head.fed_rows)
    bs, n = inputs.tree.shape
    probs = None if probs_out is None else probs_out[:bs]
    if head.topk > 1:
        drafts = _draft_tree(head, outcome, step.hidden, inputs, plan_head, kv_lens_host)
    else:
        drafts = _draft_next(head, outcome[:, 0], outcome[:, 1 + n:], step.hidden, inputs, plan_head, kv_lens_host,
                             probs)
    if probs is not None:
        q_table.index_copy_(0, inputs.tree.req_rows, probs)
    return torch.cat([outcome, drafts], dim=1)


def chain_inputs(inputs: FusedStepInputs, outcome: torch.Tensor, node_slots: torch.Tensor,
                 head_slots: torch.Tensor, trees: bool = False) -> None:
    """Rewrites the first bs rows of `inputs` (a step's, on the device) into the next step's,
    from that step's outcome (bs, 1 + 2n + K), or with `trees` (bs, 1 + 2n + 2(n - 1)),
    without a host sync: the root is the last committed token, the chain its K next drafts
    (the tree its n - 1 drafts and their parents), at a prefix longer by the accept length;
    every request gets a full chain whatever it had (commit stops a request at its end), and
    the KV slots the host gives: node_slots (bs, n), head_slots (bs, head columns). Request
    rows, table rows and sampling columns stay."""
    bs, n = node_slots.shape
    tree = inputs.tree
    accept_lens = outcome[:, 0]
    committed = outcome[:, 1 + n:1 + 2 * n]
    tree.tokens[:bs, :1] = committed.gather(1, (accept_lens - 1).clamp(min=0).unsqueeze(1))
    if trees:
        tree.tokens[:bs, 1:] = outcome[:, 1 + 2 * n:3 * n]
        tree.parents[:bs, :1] = -1
        tree.parents[:bs, 1:] = outcome[:, 3 * n:]
    else:
        tree.tokens[:bs, 1:] = outcome[:, 1 + 2 * n:]
        tree.parents[:bs] = torch.arange(-1, n - 1, device=tree.parents.device)
    tree.num_nodes[:bs] = n
    tree.prefix_lens[:bs] += accept_lens
    tree.out_slots[:bs] = node_slots
    inputs.head_slots[:bs] = head_slots


def cut_rows(source: FusedStepInputs, rows: torch.Tensor, target: FusedStepInputs,
             scratch_rows: tuple[int, int]) -> None:
    """target's first len(rows) requests become source's requests at `rows` (device indices;
    `target` may be `source`), every field of theirs; its other rows become padding requests
    (FusedStepInputs.padding, what fill writes). For chain_inputs after a step that ended some of
    its requests."""
    bs = rows.numel()
    kept = [field.index_select(0, rows) for field in source.request_fields()]   # all read before any is written
    for field, values, padding in zip(target.request_fields(), kept, FusedStepInputs.padding(scratch_rows)):
        field[:bs] = values
        field[bs:] = padding


def write_head_table(pool, inputs: FusedStepInputs, topk: int = 1, fed_rows: int = 0) -> None:
    """The head's table entries of the reserved rows, req_to_token[head row, L - 1 + j] =
    head_slots[:, j], written inside the step from the packed inputs: no table write of its
    own per step (DraftKVTable.reserve leaves these rows to the step). Padding requests
    write their padding slots into the head's padding row. A tree's fed rows go into each of
    its topk beams' rows (each beam attends to them); its draft steps write their own."""
    device = inputs.head_slots.device
    slots = inputs.head_slots[:, :fed_rows] if topk > 1 else inputs.head_slots
    beams = inputs.head_rows.view(-1, 1, 1)
    if topk > 1:
        beams = beams + constant_range(0, topk, device).view(1, -1, 1)
    columns = inputs.tree.prefix_lens.view(-1, 1, 1) + constant_range(0, slots.shape[1], device)
    pool.req_to_token[beams, columns] = slots.unsqueeze(1).to(pool.req_to_token.dtype)


def _verify_and_commit(kind: str, trees: DraftTrees, logits: torch.Tensor, inputs: FusedStepInputs,
                       q_table: torch.Tensor | None, pool) -> torch.Tensor:
    """Verification and the accepted path's KV-table commit: commit_path's (bs, 1 + 2n)
    outcome. Greedy chains take the verify step's own kernel on a GPU (one launch, where
    verify_greedy and commit_path are ~35 small torch kernels, ~60 us of a batch-1 step)."""
    if kind == "greedy":
        return greedy_commit(trees, logits, inputs.tree, pool)
    return commit_path(_verify_sampling(kind, trees, logits, inputs, q_table), inputs.tree, pool)


def _verify_sampling(kind: str, trees: DraftTrees, logits: torch.Tensor, inputs: FusedStepInputs,
                     q_table: torch.Tensor | None) -> VerifyResult:
    draft_probs = None
    if kind == "rejection":   # node j's child was drawn from q_table[row, j]; the last node has none, its q is never read
        q = q_table.index_select(0, inputs.tree.req_rows)
        draft_probs = torch.cat([q, q[:, -1:]], dim=1)
    # the filters always run: a graph cannot ask the host whether a row uses them (top-k = V,
    # top-p = 1 and min-p = 0 keep every token, as the sampler's skipped filters would)
    return verify_sampling(trees, logits, inputs.temperatures, inputs.top_ks, inputs.top_ps, inputs.min_ps,
                           inputs.seeds, inputs.tree.prefix_lens, draft_probs, rule=kind)


def _draft_next(head: "EagleHeadRunner", accept_lens: torch.Tensor, committed_tokens: torch.Tensor,
                hidden: torch.Tensor, inputs: FusedStepInputs, plan: Callable[[ForwardBatch], None],
                kv_lens_host: list[int] | None, probs: torch.Tensor | None) -> torch.Tensor:
    """The head's chain over the committed tokens (bs, n; -1 past the accept length) and the
    target's states: (bs, K) next drafts (target ids)."""
    bs, n = inputs.tree.shape
    # draft step j (1 .. K - 1) sits at row L - 2 + a + j: column a - 1 + j of the reserved rows
    step_columns = accept_lens.unsqueeze(1) + constant_range(0, n - 2, accept_lens.device)
    slots = torch.cat([inputs.head_slots[:, :n], inputs.head_slots.gather(1, step_columns)], dim=1)
    chain = ChainInputs(inputs.packed, tokens=committed_tokens.clamp(min=0), num_fed=accept_lens, slots=slots,
                        req_rows=inputs.head_rows, prefix_lens=inputs.tree.prefix_lens, seeds=inputs.seeds,
                        temperatures=inputs.draft_temperatures)
    features = head.head.project(hidden.reshape(bs * n, -1).to(head.dtype))
    host_rows = None if kv_lens_host is None else _fed_spans(kv_lens_host, accept_lens, n)
    return run_chain(head.chain_model, head.pool, chain, plan, probs, features, host_rows)


def _draft_tree(head: "EagleHeadRunner", outcome: torch.Tensor, hidden: torch.Tensor, inputs: FusedStepInputs,
                plan: Callable[[ForwardBatch], None], kv_lens_host: list[int] | None) -> torch.Tensor:
    """EAGLE-2's next tree (draft_tree.run_tree: (bs, 2 * (nodes - 1)) tokens, then parents)
    from the accepted path: fed row L - 1 + j reads the committed token at L + j and the
    target's state at the path's node j (its depth-j node: a path is at most K + 1 nodes, the
    tree's depth and the fed rows'). The draft steps' beams take the slots after the fed rows."""
    bs, n = inputs.tree.shape
    fed = head.fed_rows
    accept_lens = outcome[:, 0]
    path = outcome[:, 1:1 + fed].clamp(min=0)                       # junk rows past the accept length read the root
    committed = outcome[:, 1 + n:1 + n + fed]
    states = hidden.gather(1, path.unsqueeze(2).expand(bs, fed, hidden.shape[-1]))
    chain = ChainInputs(inputs.packed, tokens=committed.clamp(min=0), num_fed=accept_lens, slots=inputs.head_slots,
                        req_rows=inputs.head_rows // head.topk, prefix_lens=inputs.tree.prefix_lens,
                        seeds=inputs.seeds, temperatures=inputs.draft_temperatures)
    features = head.head.project(states.reshape(bs * fed, -1).to(head.dtype))
    host_rows = None if kv_lens_host is None else _fed_spans(kv_lens_host, accept_lens, fed)
    return run_tree(head.chain_model, head.pool, chain, plan, head.topk, head.num_steps, head.tree_nodes,
                    features, host_rows)


def _fed_spans(kv_lens_host: list[int], accept_lens: torch.Tensor, nodes: int) -> list[FedSpan]:
    """An eager step's fed rows on the host. Where the draft steps sit depends on the accept
    lengths: reading them is a host sync, paid only when there are draft steps (K > 1; with
    none, only the first fed row's position is planned from)."""
    fed = accept_lens.tolist() if nodes > 2 else [1] * len(kv_lens_host)
    return [FedSpan(prefix, count) for prefix, count in zip(kv_lens_host, fed)]
