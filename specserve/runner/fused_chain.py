"""The fused one-step chain (NAIVE_EAGLE, MTP): the target verifies [root, d1] and the head
drafts the next d1 from the target's states of the accepted positions in one device
function with no host sync, replayed from one CUDA graph per (batch bucket, verification
kind) on a GPU; the host reads back one packed outcome per step.

Per request, with L tokens (the root at position L - 1, the pending draft d1 at L):
1. The target's VERIFY forward of the chain at positions L - 1, L (tree_step.forward_tree),
   keeping its hidden states (bs, 2, features).
2. Verification on the device: the argmax ("greedy"), or the request's temperature / top-k /
   top-p / min-p with the coupled rule ("coupled") or residual rejection with the q d1 was
   drawn from ("rejection": q_table[request row], kept by the previous step). The accepted
   path's KV slots go into the target's req_to_token (tree_step.commit_path).
3. The head's rows L - 1 and L in one VERIFY forward (draft_chain.fed_rows_batch): row L - 1
   reads the token at L (d1 if accepted, else the bonus) and the target state at L - 1; row L
   reads the token at L + 1 (the bonus after an accepted d1) and the state at L. Shapes are
   fixed: both rows are always written, to slots the host reserved. When d1 was rejected,
   row L holds junk: it is not among the fed rows (num_fed = accept length, so row L - 1 does
   not see it), the drafter's table marks it unset and the next step, whose rows are L and
   L + 1, writes it again. The head's state at the last real row gives the next draft, at
   position L + accept length: its argmax, or a sample of q (keyed by seed and position,
   SALT_DRAFT), whose q is kept in q_table for the next step's rejection test.
4. The outcome, (bs, 6) int64: accept length, accepted nodes (2), committed tokens (2), the
   next draft.

With tensor parallelism the step runs on rank 0 (the head, verification and the commit are
its alone); a graph of it holds rank 0's shard of the target forward, and each replay is
announced to the workers, which replay their own (bucket, 2) verify graph: the same
collectives in the same order (their greedy commit into their table is overwritten by the
next step's table rows, graph_steps.py). Eager steps broadcast as every eager forward does.
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from specserve.attention.base import ForwardBatch
from specserve.distributed.graph_steps import GraphStepHeader, announce_graph_step
from specserve.distributed.step_broadcast import sharded_model
from specserve.kv.pool import PADDING_SLOT
from specserve.runner.cuda_graph import batch_size_buckets, capture_graph
from specserve.runner.draft_chain import ChainInputs, fed_rows_batch, pick
from specserve.runner.model_runner import InFlight
from specserve.runner.tree_step import TreeStepInputs, commit_path, forward_tree, pad_node_slots
from specserve.speculative.model_proposals import draft_temperature
from specserve.speculative.tree import DraftTrees, TreeProposal
from specserve.speculative.verify import VerifyResult, verify_greedy, verify_sampling

if TYPE_CHECKING:
    from specserve.engine.request import Req
    from specserve.runner.eagle_runner import EagleHeadRunner
    from specserve.runner.model_runner import ModelRunner

logger = logging.getLogger("specserve")

NODES = 2                                       # the root and one draft
KINDS = ("greedy", "coupled", "rejection")      # verification: argmax, or verify_sampling's rule
OUTCOME_COLUMNS = 1 + 2 * NODES + 1


@dataclass
class FusedStepInputs:
    """Views into one packed int64 buffer (host, pinned for graphs, or device)."""
    packed: torch.Tensor
    tree: TreeStepInputs              # the target's chains (tree_step.py's fields)
    head_slots: torch.Tensor          # (bs, 2) the head's slots of rows L - 1 and L
    head_rows: torch.Tensor           # (bs,) the head pool's table rows
    seeds: torch.Tensor               # (bs,)
    top_ks: torch.Tensor              # (bs,) vocabulary size for none
    temperatures: torch.Tensor        # (bs,) float64 views of int64 storage: the target's, 0 for greedy rows
    top_ps: torch.Tensor
    min_ps: torch.Tensor
    draft_temperatures: torch.Tensor  # 0: argmax drafts

    @classmethod
    def allocate(cls, bs: int, device, pin: bool = False) -> FusedStepInputs:
        size = 3 * bs * NODES + 3 * bs + bs * NODES + 7 * bs
        return cls.view(torch.zeros(size, dtype=torch.long, device=device, pin_memory=pin), bs)

    @classmethod
    def view(cls, packed: torch.Tensor, bs: int) -> FusedStepInputs:
        tree_size = 3 * bs * NODES + 3 * bs
        parts = packed[tree_size:].split([bs * NODES] + [bs] * 7)
        floats = [part.view(torch.float64) for part in parts[4:]]
        return cls(packed, TreeStepInputs.view(packed[:tree_size], bs, NODES), parts[0].view(bs, NODES), parts[1],
                   parts[2], parts[3], *floats)

    def fill(self, reqs: list["Req"], proposal: TreeProposal, node_slots: list[int], head_slots: list[int],
             head_rows: list[int], scratch_rows: tuple[int, int], vocab_size: int) -> None:
        """Writes the batch into a host buffer; rows after it become padding requests.
        scratch_rows: the target's and the head's padding rows."""
        count = len(reqs)
        self.tree.fill(proposal, node_slots, [r.row for r in reqs], [r.kv_len for r in reqs], scratch_rows[0])
        columns = [   # (field, values, padding requests' value)
            (self.head_rows, head_rows, scratch_rows[1]), (self.seeds, [r.seed for r in reqs], 0),
            (self.top_ks, [r.params.top_k if r.params.top_k > 0 else vocab_size for r in reqs], 0),
            (self.temperatures, [0.0 if r.params.greedy else r.params.temperature for r in reqs], 0.0),
            (self.top_ps, [r.params.top_p for r in reqs], 1.0), (self.min_ps, [r.params.min_p for r in reqs], 0.0),
            (self.draft_temperatures, [draft_temperature(r) for r in reqs], 0.0)]
        for tensor, values, padding in columns:
            array = tensor.numpy()
            array[:count] = values
            array[count:] = padding
        slots = self.head_slots.numpy()
        slots.fill(PADDING_SLOT)
        slots[:count] = np.asarray(head_slots, dtype=np.int64).reshape(count, NODES)


def run_fused_step(target: "ModelRunner", head: "EagleHeadRunner", inputs: FusedStepInputs, kind: str,
                   q_table: torch.Tensor, plan_target: Callable[[ForwardBatch], None],
                   plan_head: Callable[[ForwardBatch], None], probs_out: torch.Tensor | None,
                   kv_lens_host: list[int] | None = None, target_model=None) -> torch.Tensor:
    """The whole step on the device: (bs, OUTCOME_COLUMNS) int64 (see the module docstring).
    probs_out: (>= bs, vocab) float32 for the next drafts' q (sampling kinds), else None.
    kv_lens_host: the prefix lengths on the host, for eager planning (graphs plan without).
    target_model: the target's forward (default: the runner's, which broadcasts with tp > 1)."""
    model = target.model if target_model is None else target_model
    step = forward_tree(model, target.attn_backend, target.pool, inputs.tree, plan_target, kv_lens_host,
                        commit=False, capture=target.hidden_capture)
    result = _verify(kind, step.trees, step.logits, inputs, q_table)
    outcome = commit_path(result, inputs.tree, target.pool)
    bs = inputs.tree.shape[0]
    probs = None if probs_out is None else probs_out[:bs]
    drafts = _draft_next(head, result, step.hidden, inputs, plan_head, kv_lens_host, probs)
    if probs is not None:
        q_table.index_copy_(0, inputs.tree.req_rows, probs)
    return torch.cat([outcome, drafts.unsqueeze(1)], dim=1)


def _verify(kind: str, trees: DraftTrees, logits: torch.Tensor, inputs: FusedStepInputs,
            q_table: torch.Tensor) -> VerifyResult:
    if kind == "greedy":
        return verify_greedy(trees, logits)
    draft_probs = None
    if kind == "rejection":   # d1 was drawn from q; node 1 has no children, its q is never read
        draft_probs = q_table.index_select(0, inputs.tree.req_rows).unsqueeze(1).expand(-1, NODES, -1)
    # the filters always run: a graph cannot ask the host whether a row uses them (top-k = V,
    # top-p = 1 and min-p = 0 keep every token, as the sampler's skipped filters would)
    return verify_sampling(trees, logits, inputs.temperatures, inputs.top_ks, inputs.top_ps, inputs.min_ps,
                           inputs.seeds, inputs.tree.prefix_lens, draft_probs, rule=kind)


def _draft_next(head: "EagleHeadRunner", result: VerifyResult, hidden: torch.Tensor, inputs: FusedStepInputs,
                plan: Callable[[ForwardBatch], None], kv_lens_host: list[int] | None,
                probs: torch.Tensor | None) -> torch.Tensor:
    """The head's rows L - 1 and L fed from the committed tokens and the target's states; (bs,)
    next drafts (target ids)."""
    bs = inputs.tree.shape[0]
    chain = ChainInputs(inputs.packed, tokens=result.committed_tokens.clamp(min=0), num_fed=result.accept_lens,
                        slots=inputs.head_slots, req_rows=inputs.head_rows, prefix_lens=inputs.tree.prefix_lens,
                        seeds=inputs.seeds, temperatures=inputs.draft_temperatures)
    batch = fed_rows_batch(chain, head.pool, kv_lens_host if kv_lens_host is not None else [0] * bs)
    plan(batch)
    features = head.head.project(hidden.reshape(bs * NODES, -1).to(head.dtype))
    state = head.chain_model.forward(batch, features)
    position = inputs.tree.prefix_lens + result.accept_lens + 1     # L + accept length
    return pick(head.chain_model, state, chain, position, probs)


class FusedChainRunner:
    """Launches fused steps: a graph replay when the batch fits, else the same function eagerly."""

    def __init__(self, target: "ModelRunner", head: "EagleHeadRunner"):
        self.target, self.head = target, head
        self.device = target.device
        self.vocab_size = target.config.vocab_size
        # q of every request's pending draft, by target table row (the scratch row included)
        self.q_table = torch.zeros((target.pool.max_requests + 1, self.vocab_size), dtype=torch.float32,
                                   device=self.device)
        self.scratch_rows = (target.pool.scratch_row, head.padding_row)
        self.graphs = None
        if target.graphs is not None and head.graphs is not None:
            max_bs = min(target.graphs.max_bs, head.graphs.max_bs)
            if target.tp is None or all((bs, NODES) in target.graphs.graphs for bs in batch_size_buckets(max_bs)):
                self.graphs = FusedGraphs(self, max_bs)
            else:   # a worker replays its own verify graph of the bucket: it must hold one
                logger.info("tp_size=%d: fused steps run eagerly (no target graph of 2 tokens per request for "
                            "each batch bucket)", target.tp.size)

    @torch.inference_mode()
    def launch(self, reqs: list["Req"], proposal: TreeProposal, slots: list[int], head_slots: list[int],
               kind: str) -> InFlight:
        """Queues the step without a host sync. slots: the target's node slots, request after
        request (proposal.num_nodes each); head_slots: two per request."""
        node_slots = pad_node_slots(slots, proposal.num_nodes.tolist(), proposal.num_slots)
        head_rows = [r.row * self.head.topk for r in reqs]
        if self.graphs is not None and len(reqs) <= self.graphs.max_bs:
            return InFlight.launch(self.graphs.replay(reqs, proposal, node_slots, head_slots, head_rows, kind))
        bs = len(reqs)
        host = FusedStepInputs.allocate(bs, "cpu", pin=self.device.type == "cuda")
        host.fill(reqs, proposal, node_slots, head_slots, head_rows, self.scratch_rows, self.vocab_size)
        inputs = FusedStepInputs.view(host.packed.to(self.device, non_blocking=True), bs)
        probs = None if kind == "greedy" else torch.zeros((bs, self.vocab_size), device=self.device)
        outcome = run_fused_step(self.target, self.head, inputs, kind, self.q_table, self.target.attn_backend.plan,
                                 self.head.backend.plan, probs, [r.kv_len for r in reqs])
        return InFlight.launch(outcome)

    def set_pending_q(self, rows: list[int], probs: torch.Tensor | None, drafts: list[int]) -> None:
        """q of drafts made outside a fused step (the head's catch-up chain): probs (len(rows),
        vocab), or None for argmax drafts, whose q is one-hot."""
        index = torch.tensor(rows, device=self.device)
        if probs is None:
            probs = torch.zeros((len(rows), self.vocab_size), device=self.device)
            probs[torch.arange(len(rows), device=self.device), torch.tensor(drafts, device=self.device)] = 1.0
        self.q_table.index_copy_(0, index, probs.float())


class FusedGraphs:
    """run_fused_step captured per (batch bucket, kind); the target's and the head's backends
    plan inside the graphs from their static graph state (their own runners made it)."""

    def __init__(self, runner: FusedChainRunner, max_bs: int):
        self.runner = runner
        self.buckets = batch_size_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        device = runner.device
        self.device_inputs = {bs: FusedStepInputs.allocate(bs, device) for bs in self.buckets}
        self.host_inputs = {bs: FusedStepInputs.allocate(bs, "cpu", pin=True) for bs in self.buckets}
        self.probs = torch.zeros((self.max_bs, runner.vocab_size), device=device)
        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.outcomes: dict[tuple[int, str], torch.Tensor] = {}
        self._copied: dict[int, torch.cuda.Event] = {}
        start, memory_pool = time.perf_counter(), None
        for kind in KINDS:
            for bs in reversed(self.buckets):     # largest first: later graphs reuse its pool memory
                self._capture(bs, kind, memory_pool)
                memory_pool = memory_pool or self.graphs[bs, kind].pool()
        logger.info("captured %d fused verify-and-draft CUDA graphs (batch sizes %s) in %.1f s",
                    len(self.graphs), self.buckets, time.perf_counter() - start)

    @torch.inference_mode()
    def _capture(self, bs: int, kind: str, memory_pool) -> None:
        runner, inputs = self.runner, self.device_inputs[bs]
        inputs.tree.num_nodes.fill_(1)
        inputs.tree.parents.fill_(-1)
        inputs.tree.req_rows.fill_(runner.scratch_rows[0])
        inputs.head_rows.fill_(runner.scratch_rows[1])
        probs = None if kind == "greedy" else self.probs
        target, head = runner.target, runner.head
        shard = sharded_model(target.model)   # replays are announced, not broadcast from inside
        announce = None if target.tp is None else lambda: self._announce(bs, inputs, 0, 0)
        self.graphs[bs, kind], self.outcomes[bs, kind] = capture_graph(
            lambda: run_fused_step(target, head, inputs, kind, runner.q_table, target.attn_backend.plan_for_capture,
                                   head.backend.plan_for_capture, probs, target_model=shard),
            memory_pool, before_warmup=announce)

    def _announce(self, bucket: int, inputs: FusedStepInputs, batch_size: int, table_columns: int) -> None:
        """Tensor parallelism: the workers replay their verify graph of the bucket on these inputs."""
        target = self.runner.target
        announce_graph_step(target.tp, GraphStepHeader((bucket, NODES), batch_size, table_columns),
                            inputs.tree.packed, inputs.tree.req_rows, target.pool)

    @torch.inference_mode()
    def replay(self, reqs: list["Req"], proposal: TreeProposal, node_slots: list[int], head_slots: list[int],
               head_rows: list[int], kind: str) -> torch.Tensor:
        """The outcome (bs, OUTCOME_COLUMNS), a view of graph memory valid until the next replay."""
        bs = len(reqs)
        bucket = self.buckets[bisect.bisect_left(self.buckets, bs)]
        host, device = self.host_inputs[bucket], self.device_inputs[bucket]
        if bucket in self._copied:
            self._copied[bucket].synchronize()   # the previous copy out of this pinned buffer is done
        host.fill(reqs, proposal, node_slots, head_slots, head_rows, self.runner.scratch_rows, self.runner.vocab_size)
        device.packed.copy_(host.packed, non_blocking=True)
        self._copied.setdefault(bucket, torch.cuda.Event()).record()
        if self.runner.target.tp is not None:
            self._announce(bucket, device, bs, max(r.kv_len for r in reqs))
        self.graphs[bucket, kind].replay()
        return self.outcomes[bucket, kind][:bs]
