"""Launches the fused chain step (fused_step.py: verification, commit and the next K drafts,
or EAGLE-2's next tree, in one device function): replayed from one CUDA graph per (batch bucket, verification kind)
on a GPU, or run eagerly (the CPU, a batch larger than the graphs); the host reads back one
packed outcome per step. Also keeps the q table of every request's pending drafts for the
next step's residual rejection. Separate from fused_step.py: this is the capture, replay and
q-table bookkeeping around the function, not what it computes. A greedy step can be followed
by one launched before its outcome is read (launch_chained): the same graph replayed on its
own input buffer, rewritten on the device from the outcome (fused_step.chain_inputs).

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
from typing import TYPE_CHECKING

import numpy as np
import torch

from specserve.runner.cuda_graph import batch_size_buckets, capture_graph
from specserve.runner.model_runner import InFlight
from specserve.runner.ranks.graph_steps import GraphStepHeader, announce_graph_step
from specserve.runner.ranks.step_broadcast import sharded_model
from specserve.runner.stream_events import record
from specserve.runner.tree_step import pad_node_slots
from specserve.speculative.model_drafters.eagle_runner import reserved_head_rows
from specserve.speculative.model_drafters.fused_step import FusedStepInputs, chain_inputs, cut_rows, run_fused_step
from specserve.verify.tree import TreeProposal

if TYPE_CHECKING:
    from specserve.request.req import Req
    from specserve.runner.model_runner import ModelRunner
    from specserve.speculative.model_drafters.eagle_runner import EagleHeadRunner

logger = logging.getLogger("specserve")

KINDS = ("greedy", "coupled", "rejection")      # verification: argmax, or verify_sampling's rule
# The largest q table kept for residual rejection inside the step: (request rows, K, vocab)
# float32, 470 MB for 256 requests, K = 3 and a 152k vocabulary. Past it, batches with sampled
# drafts take the unfused chain (FusedChainDrafter.propose): rejection is what unseeded
# sampling at a temperature needs, and that chain keeps q only for the step's batch.
Q_TABLE_BYTES = 512 << 20


@dataclass
class LastLaunch:
    """The last fused step, on the device: what launch_chained derives the next from."""
    reqs: list["Req"]
    kind: str                      # its verification (KINDS), the next step's too
    launched: InFlight             # the step, as its launch returned it
    inputs: FusedStepInputs        # a graph's own buffer, or the eager step's
    outcome: torch.Tensor          # (bs, 1 + 2n + K), a graph's output until its next replay
    bucket: int | None             # the graph's batch bucket; None: run eagerly


class FusedChainRunner:
    """Launches fused steps: a graph replay when the batch fits, else the same function eagerly."""

    def __init__(self, target: "ModelRunner", head: "EagleHeadRunner"):
        self.target, self.head = target, head
        self.device = target.device
        self.num_steps = head.num_steps
        self.trees = head.topk > 1     # EAGLE-2's trees of tree_nodes nodes, argmax drafts: no q to keep
        self.nodes = head.tree_nodes if self.trees else self.num_steps + 1
        self.head_columns = reserved_head_rows(self.num_steps, head.topk)
        self.drafts_width = 2 * (self.nodes - 1) if self.trees else self.num_steps   # the outcome's after commit_path's
        self.vocab_size = target.config.vocab_size
        # q of every request's pending drafts, by target table row (the scratch row included)
        rows = target.pool.max_requests + 1
        fits = not self.trees and rows * self.num_steps * self.vocab_size * 4 <= Q_TABLE_BYTES
        self.q_table = torch.zeros((rows, self.num_steps, self.vocab_size), dtype=torch.float32,
                                   device=self.device) if fits else None
        if not fits and not self.trees:
            logger.info("fused chain: no q table for %d requests x %d drafts x %d tokens (over %d MiB): batches "
                        "with sampled drafts take the unfused chain", rows, self.num_steps, self.vocab_size,
                        Q_TABLE_BYTES >> 20)
        self.kinds = KINDS if fits else tuple(kind for kind in KINDS if kind != "rejection")
        # (a tree's head rows are its first beam's: the padding request's too)
        self.scratch_rows = (target.pool.scratch_row, head.padding_row * head.topk)
        self.last: LastLaunch | None = None
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
        self.last = None
        if self.graphs is not None and len(reqs) <= self.graphs.max_bs:
            launched, bucket = self.graphs.replay(reqs, proposal, node_slots, head_slots, head_rows, kind)
            self.last = LastLaunch(list(reqs), kind, launched, self.graphs.device_inputs[bucket], launched.device,
                                   bucket)
            return launched
        bs = len(reqs)
        host = FusedStepInputs.allocate(bs, self.nodes, self.head_columns, "cpu", pin=self.device.type == "cuda")
        host.fill(reqs, proposal, node_slots, head_slots, head_rows, self.scratch_rows, self.vocab_size)
        inputs = FusedStepInputs.view(host.packed.to(self.device, non_blocking=True), bs, self.nodes,
                                      self.head_columns)
        return self._run_eagerly(reqs, inputs, kind, [r.kv_len for r in reqs])

    def chains(self, launched: InFlight, reqs: list["Req"]) -> bool:
        """Whether launch_chained can follow the step `launched` for `reqs` (the last step
        launched, for these requests or some of them in the same order; no tensor parallelism:
        workers replay from host-built inputs)."""
        return (self.last is not None and self.last.launched is launched and self.target.tp is None
                and kept_rows(self.last.reqs, reqs) is not None)

    @torch.inference_mode()
    def launch_chained(self, reqs: list["Req"], node_slots: np.ndarray, head_slots: np.ndarray) -> InFlight:
        """The next step of the last one's requests (`chains`), verified as it was, launched
        before the host has read that one: its inputs are derived on the device
        (fused_step.cut_rows where the last step ended some requests, then chain_inputs; the
        sampling columns and seeds stay, sampled drafts' q is in the q table, and the
        randomness is keyed by seed and position: a step gives what it would after the read).
        An eager step (a batch past the graphs) reads its prefix lengths for its planning: a
        host sync.
        node_slots: (bs, n) the target's KV slots; head_slots: (bs, 2K) the head's."""
        last = self.last
        rows = kept_rows(last.reqs, reqs)
        rows = None if len(rows) == len(last.reqs) else rows
        if last.bucket is not None:   # a graph's step: so is the next, as large or smaller
            launched, bucket, inputs = self.graphs.replay_chained(last, rows, node_slots, head_slots)
            self.last = LastLaunch(list(reqs), last.kind, launched, inputs, launched.device, bucket)
            return launched
        bs = len(reqs)
        outcome = last.outcome
        if rows is None:
            inputs = FusedStepInputs.view(last.inputs.packed.clone(), bs, self.nodes, self.head_columns)
        else:
            index = torch.tensor(rows, device=self.device)
            inputs = FusedStepInputs.allocate(bs, self.nodes, self.head_columns, self.device)
            cut_rows(last.inputs, index, inputs, self.scratch_rows)
            outcome = outcome.index_select(0, index)
        chain_inputs(inputs, outcome, torch.as_tensor(node_slots, device=self.device),
                     torch.as_tensor(head_slots, device=self.device), self.trees)
        prefix = inputs.tree.prefix_lens[:bs].tolist()   # eager planning reads them: a host sync
        return self._run_eagerly(reqs, inputs, last.kind, prefix)

    def _run_eagerly(self, reqs: list["Req"], inputs: FusedStepInputs, kind: str, kv_lens: list[int]) -> InFlight:
        bs = len(reqs)
        probs = torch.zeros((bs, self.num_steps, self.vocab_size), device=self.device) if self.keeps_q(kind) else None
        outcome = run_fused_step(self.target, self.head, inputs, kind, self.q_table, self.target.attn_backend.plan,
                                 self.head.backend.plan, probs, kv_lens)
        launched = InFlight.launch(outcome)
        self.last = LastLaunch(list(reqs), kind, launched, inputs, outcome, None)
        return launched

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
        columns = runner.head_columns
        self.device_inputs = {bs: FusedStepInputs.allocate(bs, nodes, columns, device) for bs in self.buckets}
        self.host_inputs = {bs: FusedStepInputs.allocate(bs, nodes, columns, "cpu", pin=True) for bs in self.buckets}
        self.probs = torch.zeros((self.max_bs, runner.num_steps, runner.vocab_size), device=device) \
            if runner.q_table is not None else None
        self.graphs: dict[tuple[int, str], torch.cuda.CUDAGraph] = {}
        self.outcomes: dict[tuple[int, str], torch.Tensor] = {}
        # the outcome's pinned host copies per bucket, two in turn (a chained step's copy is on
        # its way while the host reads the step before), each read before the replay after next
        self.host_outcomes = {bs: [torch.empty((bs, 1 + 2 * nodes + runner.drafts_width), dtype=torch.long,
                                               pin_memory=True) for _ in range(2)] for bs in self.buckets}
        self._outcome_read = {bs: [torch.cuda.Event(), torch.cuda.Event()] for bs in self.buckets}
        self._turn: dict[int, int] = {}
        self._copied: dict[int, torch.cuda.Event] = {}
        # a chained step's KV slots and the last step's row of each request, (bucket, n + head columns + 1):
        # pinned on the host, their device copy, and its event
        width = nodes + columns + 1
        self._chain_slots = {bs: torch.empty((bs, width), dtype=torch.long, pin_memory=True) for bs in self.buckets}
        self._chain_slots_device = {bs: torch.empty((bs, width), dtype=torch.long, device=device) for bs in self.buckets}
        self._chain_copied: dict[int, torch.cuda.Event] = {}
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
               head_rows: list[int], kind: str) -> tuple[InFlight, int]:
        """The outcome (bs, 1 + 2n + K) on its way to a reused pinned host buffer, and the
        bucket: the host view is valid until the replay of the bucket after next (the caller
        reads it before)."""
        bs = len(reqs)
        bucket = self.buckets[bisect.bisect_left(self.buckets, bs)]
        host, device = self.host_inputs[bucket], self.device_inputs[bucket]
        if bucket in self._copied:
            self._copied[bucket].synchronize()   # the previous copy out of this pinned buffer is done
        host.fill(reqs, proposal, node_slots, head_slots, head_rows, self.runner.scratch_rows, self.runner.vocab_size)
        device.packed.copy_(host.packed, non_blocking=True)
        record(self._copied.setdefault(bucket, torch.cuda.Event()))
        if self.runner.target.tp is not None:
            self._announce(bucket, device, bs, max(r.kv_len for r in reqs))
        self.graphs[bucket, kind].replay()
        return self._outcome_on_its_way(bucket, bs, kind), bucket

    @torch.inference_mode()
    def replay_chained(self, last: LastLaunch, rows: list[int] | None, node_slots: np.ndarray,
                       head_slots: np.ndarray) -> tuple[InFlight, int, FusedStepInputs]:
        """The graph of the next step's bucket and `last`'s kind, on inputs rewritten from `last`'s on
        the device (fused_step.cut_rows for the requests at `rows` of it, None: all of them,
        then chain_inputs), after its replay in stream order. Returns the step, the bucket and
        its input buffer."""
        (bs, n), r = node_slots.shape, head_slots.shape[1]
        bucket = self.buckets[bisect.bisect_left(self.buckets, bs)]
        staged = self._chain_slots[bucket]
        if bucket in self._chain_copied:
            self._chain_copied[bucket].synchronize()   # the last chained step's slots have left this buffer
        host = staged.numpy()
        host[:bs, :n] = node_slots
        host[:bs, n:n + r] = head_slots
        if rows is not None:
            host[:bs, n + r] = rows
        staged_device = self._chain_slots_device[bucket][:bs]
        staged_device.copy_(staged[:bs], non_blocking=True)
        record(self._chain_copied.setdefault(bucket, torch.cuda.Event()))
        inputs, outcome = self.device_inputs[bucket], last.outcome
        if rows is not None:
            index = staged_device[:, n + r]
            cut_rows(last.inputs, index, inputs, self.runner.scratch_rows)
            outcome = outcome.index_select(0, index)
        chain_inputs(inputs, outcome, staged_device[:, :n], staged_device[:, n:n + r], self.runner.trees)
        self.graphs[bucket, last.kind].replay()
        return self._outcome_on_its_way(bucket, bs, last.kind), bucket, inputs

    def _outcome_on_its_way(self, bucket: int, bs: int, kind: str) -> InFlight:
        turn = self._turn[bucket] = 1 - self._turn.get(bucket, 1)
        outcome, host_outcome = self.outcomes[bucket, kind][:bs], self.host_outcomes[bucket][turn][:bs]
        host_outcome.copy_(outcome, non_blocking=True)
        read = self._outcome_read[bucket][turn]
        record(read)
        return InFlight(outcome, host_outcome, read)


def kept_rows(before: list["Req"], after: list["Req"]) -> list[int] | None:
    """Each request of `after` by its row in `before`, if `after` is `before` or some of its
    requests in the same order (the same objects); else None."""
    rows, row = [], 0
    for req in after:
        while row < len(before) and before[row] is not req:
            row += 1
        if row == len(before):
            return None
        rows.append(row)
        row += 1
    return rows
