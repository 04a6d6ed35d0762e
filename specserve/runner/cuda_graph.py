"""CUDA graphs for decode and verify steps, one per (batch-size bucket, tokens per
request), replayed over static input buffers.

A decode graph (1 token per request) runs `bucket` requests of one node each. A verify
graph of level L is ragged (tree_step.forward_ragged): `bucket` requests with trees of up
to the largest level's nodes each, whose real nodes (padding requests: one each) fit in
bucket * L tokens; what it runs is the tree metadata, the forward over those tokens,
greedy verification and the KV-table commit of the accepted path. A step replays the
smallest level that holds its nodes, so a step where few requests draft costs about their
nodes. Prefill (EXTEND) stays eager: its shapes vary.

Each graph's integer inputs live in one packed int64 buffer, filled on the host (pinned,
written through numpy views) and sent with a single copy per step, so a replay launches
nothing but the copy and the graph.

Plain greedy decode steps (the overlap schedule's) take a leaner launch, `launch_decode`:
their graphs (n = 1) also hold the argmax, only the four per-request fields of the packed
buffer are written, and the argmax comes back through one of two pinned buffers per bucket
with its own event (one step is read while the next is in flight). On an H200 the general
path's launch took 190-570 us of host time per decode step (0.5B, batch 1 to 64), more
than the graph launch itself (10-35 us), and at batch 1 that host time is most of a step.

With tensor parallelism every rank captures the same plan (`capture_plan`, agreed on before
the first capture: the graphs hold collectives) and rank 0 announces each replay to the
workers, which replay the same graph on its inputs (runner/ranks/graph_steps.py).
"""
from __future__ import annotations

import bisect
import functools
import logging
import time
import zlib
from typing import Callable, TypeVar

import numpy as np
import torch

from specserve.attention.base import AttentionBackend
from specserve.kv.pool import KVPool
from specserve.model.hidden_capture import HiddenCapture
from specserve.model.parallel.parallel_state import TensorParallelGroup
from specserve.runner.ranks.graph_steps import GraphStepHeader, announce_graph_step, replay_announced_step
from specserve.runner.stream_events import record
from specserve.runner.tree_step import TreeStepInputs, TreeStepOutputs, forward_tree, set_roots
from specserve.verify.tree import TreeProposal, smallest_level

logger = logging.getLogger("specserve")
T = TypeVar("T")


def batch_size_buckets(max_bs: int) -> list[int]:
    small = [1, 2, 4, 8]
    return sorted({b for b in small if b <= max_bs} | set(range(16, max_bs + 1, 16)) | {max_bs})


def capture_plan(buckets: list[int], sizes: list[int]) -> list[tuple[int, int]]:
    """The (batch bucket, tokens per request) graphs in capture order: for each size, the
    largest bucket first (later graphs reuse its pool memory)."""
    return [(bs, n) for n in sizes for bs in reversed(buckets)]


def capture_graph(run: Callable[[], T], memory_pool,
                  before_warmup: Callable[[], None] | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """`run` captured in a CUDA graph (sharing `memory_pool`, None for a new one), after two
    runs on a side stream: autotuning and lazy initialisation stay out of the graph (and, with
    tensor parallelism, every collective's first use: NCCL connects lazily).
    before_warmup: called before each of those runs, not before the capture (rank 0 announcing
    a graph whose collectives the other ranks run from a graph they already hold).
    Returns the graph and what the captured run returned (its outputs live in the graph's memory)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            if before_warmup is not None:
                before_warmup()
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=memory_pool):
        output = run()
    return graph, output


class CudaGraphRunner:
    """Captures `forward_tree` for every bucket and each tokens-per-request size."""

    def __init__(self, model, backend: AttentionBackend, pool: KVPool, max_bs: int, tokens_per_req: list[int],
                 capture: HiddenCapture | None = None, tp: TensorParallelGroup | None = None):
        """tp: the tensor-parallel group whose rank this is (model: the rank's shard, whose
        forward holds the collectives); rank 0 announces its replays to the other ranks."""
        self.model, self.backend, self.pool = model, backend, pool
        self.capture = capture   # hidden states every graph also outputs (an EAGLE drafter's, rank 0's only)
        self.tp = tp
        self.buckets = batch_size_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        self.sizes = sorted(set(tokens_per_req))
        self.levels = [size for size in self.sizes if size > 1]   # the verify graphs' tokens per request
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], TreeStepOutputs] = {}
        self.device_inputs: dict[tuple[int, int], TreeStepInputs] = {}
        self.host_inputs: dict[tuple[int, int], TreeStepInputs] = {}
        # marks the last host-to-device copy out of each pinned host buffer: a step launched
        # ahead rewrites the buffer while the previous copy may still be queued
        self._copied: dict[tuple[int, int], torch.cuda.Event] = {}
        self.memory_pool = None
        self.decode_argmax: dict[tuple[int, int], torch.Tensor] = {}   # (bucket, 1) -> the graph's (bucket,) argmax
        self._decode_reads: dict[tuple[int, int], _DecodeReads] = {}
        backend.init_cuda_graph_state(self.max_bs, max(self.sizes), pool)
        plan = capture_plan(self.buckets, self.sizes)
        if tp is not None:
            tp.agree(zlib.crc32(repr(plan).encode()), "the CUDA graphs to capture (cuda_graph_max_bs, draft sizes)")
        start = time.perf_counter()
        for bs, n in plan:
            self._capture(bs, n)
        logger.info("captured %d CUDA graphs (batch sizes %s, tokens per request %s) in %.1f s",
                    len(self.graphs), self.buckets, self.sizes, time.perf_counter() - start)

    def can_run(self, bs: int, n: int) -> bool:
        return bs <= self.max_bs and n <= self.sizes[-1]

    @torch.inference_mode()
    def _capture(self, bs: int, n: int) -> None:
        """The graph of `bs` requests and `n` tokens per request: a decode graph for n = 1,
        else a ragged verify graph of bs * n tokens over trees of up to the largest size."""
        key = (bs, n)
        width = self.sizes[-1] if n > 1 else 1
        inputs = self.device_inputs[key] = TreeStepInputs.allocate(bs, width, self.pool.device)
        self.host_inputs[key] = TreeStepInputs.allocate(bs, width, "cpu", pin=True)
        inputs.num_nodes.fill_(1)
        inputs.parents.fill_(-1)
        inputs.req_rows.fill_(self.pool.scratch_row)
        if n == 1:   # constant in a decode step: launch_decode leaves them alone
            self.host_inputs[key].parents.fill_(-1)
            self.host_inputs[key].num_nodes.fill_(1)

        def step():
            outputs = forward_tree(self.model, self.backend, self.pool, inputs, self.backend.plan_for_capture,
                                   capture=self.capture, token_budget=bs * n if n > 1 else None)
            return outputs, outputs.logits[:, 0].argmax(-1) if n == 1 else None
        # the metadata is planned inside: every replay re-derives it
        self.graphs[key], (self.outputs[key], argmax) = capture_graph(step, self.memory_pool)
        if argmax is not None:
            self.decode_argmax[key] = argmax
        if self.memory_pool is None:
            self.memory_pool = self.graphs[key].pool()

    @torch.inference_mode()
    def replay(self, proposal: TreeProposal, node_slots: np.ndarray, req_rows: list[int], kv_lens: list[int],
               derive: Callable[[TreeStepInputs], None] | None = None, every_node: bool = False) -> "CutStepOutputs":
        """Runs the graph that holds the batch: the bucket's decode graph for one node per
        request, else its verify graph of the smallest level that holds the real nodes.
        node_slots: proposal.num_slots slots per request (PADDING_SLOT for padding nodes).
        derive: rewrites the device's copy of the inputs before the graph runs (root tokens
        already on the device; a forecast's trees, runner/forecast_step.py), which with
        `every_node` may give any request every one of proposal.num_slots nodes (the level is
        chosen for that). Returns outputs cut to (bs, m)."""
        bs, m = proposal.tokens.shape
        key = self.key_for(proposal, every_node)
        host = self._host_buffer(key)
        host.fill(proposal, node_slots, req_rows, kv_lens, self.pool.scratch_row)
        self._send_and_replay(key, bs, kv_lens, derive)
        return CutStepOutputs(self.outputs[key], bs, m)

    def key_for(self, proposal: TreeProposal, every_node: bool = False) -> tuple[int, int]:
        """(bucket, tokens per request) of the graph a proposal replays: the bucket's decode
        graph for one node per request, else its verify graph of the smallest level whose
        tokens hold the real nodes (a padding request has one; every_node: each request may
        have proposal.num_slots)."""
        bs, m = proposal.tokens.shape
        bucket = self.buckets[bisect.bisect_left(self.buckets, bs)]
        if m == 1:
            return bucket, 1
        nodes = bs * m if every_node else int(proposal.num_nodes.sum())
        return bucket, smallest_level(self.levels, bucket, nodes + bucket - bs)

    def decode_logits(self) -> list[torch.Tensor]:
        """Each decode graph's logits buffer (bucket, vocab), whose first rows launch_decode's
        logits are."""
        return [self.outputs[bs, 1].logits[:, 0] for bs in self.buckets if (bs, 1) in self.outputs]

    def can_launch_decode(self, bs: int) -> bool:
        return bs <= self.max_bs and 1 in self.sizes

    @torch.inference_mode()
    def launch_decode(self, req_rows: list[int], kv_lens: list[int], slots: list[int],
                      roots: list[int] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event,
                                                                 torch.Tensor | None, torch.Tensor]:
        """A plain greedy decode step (one node per request) with the argmax in its graph.
        roots: the last tokens on the host, or (bs,) on the device. Returns the argmax on the
        device, its host copy (valid once the event fires, until the second decode launch of
        the bucket after this one), the event, the hidden states the graph keeps (bs, 1,
        features) or None, and the logits (bs, vocab): views of graph memory, valid until the
        bucket's graph runs again."""
        bs = len(req_rows)
        key = (self.buckets[bisect.bisect_left(self.buckets, bs)], 1)
        on_device = isinstance(roots, torch.Tensor) and roots.is_cuda
        self._host_buffer(key).fill_decode(None if on_device else roots, slots, req_rows, kv_lens, self.pool.scratch_row)
        self._send_and_replay(key, bs, kv_lens, functools.partial(set_roots, roots) if on_device else None)
        argmax = self.decode_argmax[key][:bs]
        reads = self._decode_reads.get(key)
        if reads is None:
            reads = self._decode_reads[key] = _DecodeReads(key[0])
        host, done = reads.copy(argmax)
        outputs = self.outputs[key]
        return argmax, host, done, None if outputs.hidden is None else outputs.hidden[:bs], outputs.logits[:bs, 0]

    def _host_buffer(self, key: tuple[int, int]) -> TreeStepInputs:
        """The bucket's pinned input buffer, once the previous copy out of it is done (a step
        launched ahead rewrites it while the copy before may still be queued)."""
        if key in self._copied:
            self._copied[key].synchronize()
        return self.host_inputs[key]

    def _send_and_replay(self, key: tuple[int, int], bs: int, kv_lens: list[int],
                         derive: Callable[[TreeStepInputs], None] | None) -> None:
        """The filled host buffer to the device, `derive` (if any) rewriting what the device
        already holds (root tokens, a forecast's trees), then the graph."""
        device = self.device_inputs[key]
        device.packed.copy_(self.host_inputs[key].packed, non_blocking=True)
        if derive is not None:
            derive(device)
        copied = self._copied.get(key)
        if copied is None:
            copied = self._copied[key] = torch.cuda.Event()
        record(copied)
        if self.tp is not None:
            announce_graph_step(self.tp, GraphStepHeader(key, bs, max(kv_lens)), device.packed, device.req_rows,
                                self.pool)
        self.graphs[key].replay()

    @torch.inference_mode()
    def replay_announced(self, header: GraphStepHeader) -> None:
        """A tensor-parallel worker: the graph rank 0 announced, on rank 0's inputs."""
        inputs, graph = self.device_inputs[header.key], self.graphs[header.key]
        replay_announced_step(self.tp, header, inputs.packed, inputs.req_rows, self.pool, graph.replay)


class CutStepOutputs:
    """A graph's outputs (TreeStepOutputs) cut to the batch's bs requests of m nodes, each
    view made when first read: a view costs microseconds of host dispatch, the trees' take
    fourteen, and a greedy verify step reads only its outcome."""

    def __init__(self, full: TreeStepOutputs, bs: int, m: int):
        self._full, self._bs, self._m = full, bs, m

    @functools.cached_property
    def logits(self) -> torch.Tensor:
        return self._full.node_logits(self._bs, self._m)

    @functools.cached_property
    def trees(self):
        return self._full.trees.head(self._bs, self._m) if self._full.trees is not None else None

    @functools.cached_property
    def outcome(self) -> torch.Tensor | None:
        outcome = self._full.outcome
        if outcome is None or outcome.shape[0] == self._bs:
            return outcome
        return outcome[:self._bs]

    @functools.cached_property
    def hidden(self) -> torch.Tensor | None:
        return self._full.node_hidden(self._bs, self._m)

    def logits_at(self, rows: list[int], nodes: list[int]) -> torch.Tensor:
        return self._full.logits_at(rows, nodes)   # rows < bs and nodes < m index the same nodes


class _DecodeReads:
    """Two pinned host buffers for a bucket's decode argmax, used in turn, each with its own
    event: the overlap schedule reads step N while step N+1 is in flight and reads N before it
    launches N+2, so a buffer is never rewritten before its step was read (a step dropped
    unread may be overwritten: nobody reads it). A pinned allocation and an event per step
    cost host time the launch would otherwise not spend."""

    def __init__(self, bucket: int):
        self._hosts = [torch.empty(bucket, dtype=torch.long, pin_memory=True) for _ in range(2)]
        self._events = [torch.cuda.Event(), torch.cuda.Event()]
        self._turn = 0

    def copy(self, argmax: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        turn, self._turn = self._turn, 1 - self._turn
        host = self._hosts[turn][:argmax.shape[0]]
        host.copy_(argmax, non_blocking=True)
        record(self._events[turn])
        return host, self._events[turn]
