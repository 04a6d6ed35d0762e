"""The fused chain step (EAGLE / EAGLE3 with top-k 1, NAIVE_EAGLE, MTP): the target verifies
the chain [root, d1 .. dK] and the head drafts the next K tokens from the target's states of
the accepted positions in one device function with no host sync, replayed from one CUDA
graph per (batch bucket, verification kind) on a GPU; the host reads back one packed outcome
per step. K = --speculative-num-steps (1 for NAIVE_EAGLE and MTP); n = K + 1 chain nodes.

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

With tensor parallelism the step runs on rank 0 (the head, verification and the commit are
its alone); a graph of it holds rank 0's shard of the target forward, and each replay is
announced to the workers, which replay their own (bucket, n) verify graph: the same
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
from specserve.runner.draft_chain import ChainInputs, FedSpan, run_chain
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

KINDS = ("greedy", "coupled", "rejection")      # verification: argmax, or verify_sampling's rule
# The largest q table kept for residual rejection inside the step: (request rows, K, vocab)
# float32, 470 MB for 256 requests, K = 3 and a 152k vocabulary. Past it, batches with sampled
# drafts take the unfused chain (FusedChainDrafter.propose): rejection is what unseeded
# sampling at a temperature needs, and that chain keeps q only for the step's batch.
Q_TABLE_BYTES = 512 << 20


def reserved_head_rows(num_steps: int) -> int:
    """Head rows a fused step writes per request: the K + 1 fed rows and the K - 1 draft
    steps' rows past them (a draft step sits after the last accepted row)."""
    return 2 * num_steps


@dataclass
class FusedStepInputs:
    """Views into one packed int64 buffer (host, pinned for graphs, or device)."""
    packed: torch.Tensor
    tree: TreeStepInputs              # the target's chains (tree_step.py's fields), n nodes
    head_slots: torch.Tensor          # (bs, 2K) the head's slots of rows L - 1 .. L + 2K - 2
    head_rows: torch.Tensor           # (bs,) the head pool's table rows
    seeds: torch.Tensor               # (bs,)
    top_ks: torch.Tensor              # (bs,) vocabulary size for none
    temperatures: torch.Tensor        # (bs,) float64 views of int64 storage: the target's, 0 for greedy rows
    top_ps: torch.Tensor
    min_ps: torch.Tensor
    draft_temperatures: torch.Tensor  # 0: argmax drafts

    @classmethod
    def allocate(cls, bs: int, nodes: int, device, pin: bool = False) -> FusedStepInputs:
        size = 3 * bs * nodes + 3 * bs + bs * reserved_head_rows(nodes - 1) + 7 * bs
        return cls.view(torch.zeros(size, dtype=torch.long, device=device, pin_memory=pin), bs, nodes)

    @classmethod
    def view(cls, packed: torch.Tensor, bs: int, nodes: int) -> FusedStepInputs:
        tree_size = 3 * bs * nodes + 3 * bs
        head_rows = reserved_head_rows(nodes - 1)
        parts = packed[tree_size:].split([bs * head_rows] + [bs] * 7)
        floats = [part.view(torch.float64) for part in parts[4:]]
        return cls(packed, TreeStepInputs.view(packed[:tree_size], bs, nodes), parts[0].view(bs, head_rows),
                   parts[1], parts[2], parts[3], *floats)

    def fill(self, reqs: list["Req"], proposal: TreeProposal, node_slots: np.ndarray, head_slots: np.ndarray,
             head_rows: list[int], scratch_rows: tuple[int, int], vocab_size: int) -> None:
        """Writes the batch into a host buffer; rows after it become padding requests.
        head_slots: (len(reqs), 2K); scratch_rows: the target's and the head's padding rows.
        The per-request columns (head rows and sampling parameters) are rewritten only when
        the batch differs from the one this buffer last held (a graph's host buffer is
        filled every step, mostly for the same requests)."""
        count = len(reqs)
        self.tree.fill(proposal, node_slots, [r.row for r in reqs], [r.kv_len for r in reqs], scratch_rows[0])
        slots = self._arrays()[0]
        slots[count:] = PADDING_SLOT
        slots[:count] = head_slots
        held = self.__dict__.get("_batch")
        if held is None or len(held[0]) != count or held[1] != head_rows or any(
                a is not b for a, b in zip(held[0], reqs)):
            self._fill_columns(reqs, head_rows, scratch_rows[1], vocab_size)
            self.__dict__["_batch"] = (list(reqs), list(head_rows))   # copies: the caller's lists may change

    def _fill_columns(self, reqs: list["Req"], head_rows: list[int], scratch_row: int, vocab_size: int) -> None:
        count = len(reqs)
        columns = [   # (values, padding requests' value), in _arrays' order after head_slots
            (head_rows, scratch_row), ([r.seed for r in reqs], 0),
            ([r.params.top_k if r.params.top_k > 0 else vocab_size for r in reqs], 0),
            ([0.0 if r.params.greedy else r.params.temperature for r in reqs], 0.0),
            ([r.params.top_p for r in reqs], 1.0), ([r.params.min_p for r in reqs], 0.0),
            ([draft_temperature(r) for r in reqs], 0.0)]
        for array, (values, padding) in zip(self._arrays()[1:], columns):
            array[:count] = values
            array[count:] = padding

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
    result = _verify(kind, step.trees, step.logits, inputs, q_table)
    outcome = commit_path(result, inputs.tree, target.pool)
    write_head_table(head.pool, inputs)
    bs = inputs.tree.shape[0]
    probs = None if probs_out is None else probs_out[:bs]
    drafts = _draft_next(head, result, step.hidden, inputs, plan_head, kv_lens_host, probs)
    if probs is not None:
        q_table.index_copy_(0, inputs.tree.req_rows, probs)
    return torch.cat([outcome, drafts], dim=1)


def write_head_table(pool, inputs: FusedStepInputs) -> None:
    """The head's table entries of the reserved rows, req_to_token[head row, L - 1 + j] =
    head_slots[:, j], written inside the step from the packed inputs: no table write of its
    own per step (DraftKVTable.reserve leaves these rows to the step). Padding requests
    write their padding slots into the head's padding row."""
    columns = inputs.tree.prefix_lens.unsqueeze(1) + torch.arange(inputs.head_slots.shape[1],
                                                                    device=inputs.head_slots.device)
    pool.req_to_token[inputs.head_rows.unsqueeze(1), columns] = inputs.head_slots.to(pool.req_to_token.dtype)


def _verify(kind: str, trees: DraftTrees, logits: torch.Tensor, inputs: FusedStepInputs,
            q_table: torch.Tensor | None) -> VerifyResult:
    if kind == "greedy":
        return verify_greedy(trees, logits)
    draft_probs = None
    if kind == "rejection":   # node j's child was drawn from q_table[row, j]; the last node has none, its q is never read
        q = q_table.index_select(0, inputs.tree.req_rows)
        draft_probs = torch.cat([q, q[:, -1:]], dim=1)
    # the filters always run: a graph cannot ask the host whether a row uses them (top-k = V,
    # top-p = 1 and min-p = 0 keep every token, as the sampler's skipped filters would)
    return verify_sampling(trees, logits, inputs.temperatures, inputs.top_ks, inputs.top_ps, inputs.min_ps,
                           inputs.seeds, inputs.tree.prefix_lens, draft_probs, rule=kind)


def _draft_next(head: "EagleHeadRunner", result: VerifyResult, hidden: torch.Tensor, inputs: FusedStepInputs,
                plan: Callable[[ForwardBatch], None], kv_lens_host: list[int] | None,
                probs: torch.Tensor | None) -> torch.Tensor:
    """The head's chain over the committed tokens and the target's states: (bs, K) next
    drafts (target ids)."""
    bs, n = inputs.tree.shape
    accept_lens = result.accept_lens
    # draft step j (1 .. K - 1) sits at row L - 2 + a + j: column a - 1 + j of the reserved rows
    step_columns = accept_lens.unsqueeze(1) - 1 + torch.arange(1, n - 1, device=accept_lens.device)
    slots = torch.cat([inputs.head_slots[:, :n], inputs.head_slots.gather(1, step_columns)], dim=1)
    chain = ChainInputs(inputs.packed, tokens=result.committed_tokens.clamp(min=0), num_fed=accept_lens, slots=slots,
                        req_rows=inputs.head_rows, prefix_lens=inputs.tree.prefix_lens, seeds=inputs.seeds,
                        temperatures=inputs.draft_temperatures)
    features = head.head.project(hidden.reshape(bs * n, -1).to(head.dtype))
    host_rows = None if kv_lens_host is None else _fed_spans(kv_lens_host, accept_lens, n)
    return run_chain(head.chain_model, head.pool, chain, plan, probs, features, host_rows)


def _fed_spans(kv_lens_host: list[int], accept_lens: torch.Tensor, nodes: int) -> list[FedSpan]:
    """An eager step's fed rows on the host. Where the draft steps sit depends on the accept
    lengths: reading them is a host sync, paid only when there are draft steps (K > 1; with
    none, only the first fed row's position is planned from)."""
    fed = accept_lens.tolist() if nodes > 2 else [1] * len(kv_lens_host)
    return [FedSpan(prefix, count) for prefix, count in zip(kv_lens_host, fed)]


class FusedChainRunner:
    """Launches fused steps: a graph replay when the batch fits, else the same function eagerly."""

    def __init__(self, target: "ModelRunner", head: "EagleHeadRunner"):
        self.target, self.head = target, head
        self.device = target.device
        self.num_steps = head.num_steps
        self.nodes = self.num_steps + 1
        self.vocab_size = target.config.vocab_size
        # q of every request's pending drafts, by target table row (the scratch row included)
        rows = target.pool.max_requests + 1
        fits = rows * self.num_steps * self.vocab_size * 4 <= Q_TABLE_BYTES
        self.q_table = torch.zeros((rows, self.num_steps, self.vocab_size), dtype=torch.float32,
                                   device=self.device) if fits else None
        if not fits:
            logger.info("fused chain: no q table for %d requests x %d drafts x %d tokens (over %d MiB): batches "
                        "with sampled drafts take the unfused chain", rows, self.num_steps, self.vocab_size,
                        Q_TABLE_BYTES >> 20)
        self.kinds = KINDS if fits else tuple(kind for kind in KINDS if kind != "rejection")
        self.scratch_rows = (target.pool.scratch_row, head.padding_row)
        self.graphs = None
        if target.graphs is not None and head.graphs is not None:
            max_bs = min(target.graphs.max_bs, head.graphs.max_bs)
            if target.tp is None or all((bs, self.nodes) in target.graphs.graphs for bs in batch_size_buckets(max_bs)):
                self.graphs = FusedGraphs(self, max_bs)
            else:   # a worker replays its own verify graph of the bucket: it must hold one
                logger.info("tp_size=%d: fused steps run eagerly (no target graph of %d tokens per request for "
                            "each batch bucket)", target.tp.size, self.nodes)

    @torch.inference_mode()
    def launch(self, reqs: list["Req"], proposal: TreeProposal, slots: list[int], head_slots: np.ndarray,
               kind: str) -> InFlight:
        """Queues the step without a host sync (eagerly with K > 1: one, see the module
        docstring). slots: the target's node slots, request after request
        (proposal.num_nodes each); head_slots: (len(reqs), 2K) the reserved rows' slots."""
        if kind not in self.kinds:
            raise ValueError(f"fused verification kind {kind!r}: this runner serves {self.kinds}")
        node_slots = pad_node_slots(slots, proposal.num_nodes.tolist(), proposal.num_slots)
        head_rows = [r.row * self.head.topk for r in reqs]
        if self.graphs is not None and len(reqs) <= self.graphs.max_bs:
            return self.graphs.replay(reqs, proposal, node_slots, head_slots, head_rows, kind)
        bs = len(reqs)
        host = FusedStepInputs.allocate(bs, self.nodes, "cpu", pin=self.device.type == "cuda")
        host.fill(reqs, proposal, node_slots, head_slots, head_rows, self.scratch_rows, self.vocab_size)
        inputs = FusedStepInputs.view(host.packed.to(self.device, non_blocking=True), bs, self.nodes)
        probs = torch.zeros((bs, self.num_steps, self.vocab_size), device=self.device) if self.keeps_q(kind) else None
        outcome = run_fused_step(self.target, self.head, inputs, kind, self.q_table, self.target.attn_backend.plan,
                                 self.head.backend.plan, probs, [r.kv_len for r in reqs])
        return InFlight.launch(outcome)

    def keeps_q(self, kind: str) -> bool:
        """Whether a step of this kind keeps its drafts' q (for the next step's rejection
        test): sampling kinds, when there is a q table (without one no request with sampled
        drafts is fused: the others' drafts are argmax)."""
        return kind != "greedy" and self.q_table is not None

    def set_pending_q(self, rows: list[int], probs: torch.Tensor | None, drafts: list[list[int]]) -> None:
        """q of drafts made outside a fused step (the head's catch-up chain): probs
        (len(rows), >= K, vocab), or None for argmax drafts, whose q is one-hot. No-op
        without a q table (sampled drafts then never reach a fused step)."""
        if self.q_table is None:
            return
        index = torch.tensor(rows, device=self.device)
        if probs is None:
            probs = torch.zeros((len(rows), self.num_steps, self.vocab_size), device=self.device)
            probs.scatter_(2, torch.tensor(drafts, device=self.device).unsqueeze(2), 1.0)
        self.q_table.index_copy_(0, index, probs[:, :self.num_steps].float())


class FusedGraphs:
    """run_fused_step captured per (batch bucket, kind); the target's and the head's backends
    plan inside the graphs from their static graph state (their own runners made it)."""

    def __init__(self, runner: FusedChainRunner, max_bs: int):
        self.runner = runner
        self.buckets = batch_size_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        device, nodes = runner.device, runner.nodes
        self.device_inputs = {bs: FusedStepInputs.allocate(bs, nodes, device) for bs in self.buckets}
        self.host_inputs = {bs: FusedStepInputs.allocate(bs, nodes, "cpu", pin=True) for bs in self.buckets}
        self.probs = torch.zeros((self.max_bs, runner.num_steps, runner.vocab_size), device=device) \
            if runner.q_table is not None else None
        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.outcomes: dict[tuple[int, str], torch.Tensor] = {}
        # the outcome's pinned host copy per bucket (read before the next replay), and its event
        self.host_outcomes = {bs: torch.empty((bs, 1 + 2 * nodes + runner.num_steps), dtype=torch.long,
                                              pin_memory=True) for bs in self.buckets}
        self._outcome_read = torch.cuda.Event()
        self._copied: dict[int, torch.cuda.Event] = {}
        start, memory_pool = time.perf_counter(), None
        for kind in runner.kinds:
            for bs in reversed(self.buckets):     # largest first: later graphs reuse its pool memory
                self._capture(bs, kind, memory_pool)
                memory_pool = memory_pool or self.graphs[bs, kind].pool()
        logger.info("captured %d fused verify-and-draft CUDA graphs (%d drafts, batch sizes %s) in %.1f s",
                    len(self.graphs), runner.num_steps, self.buckets, time.perf_counter() - start)

    @torch.inference_mode()
    def _capture(self, bs: int, kind: str, memory_pool) -> None:
        runner, inputs = self.runner, self.device_inputs[bs]
        inputs.tree.num_nodes.fill_(1)
        inputs.tree.parents.fill_(-1)
        inputs.tree.req_rows.fill_(runner.scratch_rows[0])
        inputs.head_rows.fill_(runner.scratch_rows[1])
        probs = self.probs if runner.keeps_q(kind) else None
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
        announce_graph_step(target.tp, GraphStepHeader((bucket, self.runner.nodes), batch_size, table_columns),
                            inputs.tree.packed, inputs.tree.req_rows, target.pool)

    @torch.inference_mode()
    def replay(self, reqs: list["Req"], proposal: TreeProposal, node_slots: np.ndarray, head_slots: np.ndarray,
               head_rows: list[int], kind: str) -> InFlight:
        """The outcome (bs, 1 + 2n + K) on its way to a reused pinned host buffer: its host
        view is valid until the next replay of the bucket (the caller reads it before)."""
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
        outcome, host_outcome = self.outcomes[bucket, kind][:bs], self.host_outcomes[bucket][:bs]
        host_outcome.copy_(outcome, non_blocking=True)
        self._outcome_read.record()
        return InFlight(outcome, host_outcome, self._outcome_read)
