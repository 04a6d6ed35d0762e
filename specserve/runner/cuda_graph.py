"""CUDA graphs for the DECODE and VERIFY forwards, one per (batch-size bucket, tokens per
request), replayed over static input buffers.

A graph batch has `bucket` requests of exactly `n` tokens each (n = 1 for DECODE, the
draft size for VERIFY). Real requests with smaller trees, and the padding requests that
fill a bucket, get padding nodes: token 0, KV slot PADDING_SLOT, a tree-mask row that sees
only itself; their logits are dropped. Prefill (EXTEND) stays eager: its shapes vary.

Each graph's integer inputs live in one packed int64 buffer, filled on the host (pinned,
written through a numpy view: a torch op per input costs microseconds of dispatch) and sent
with a single copy per step. The attention backend's metadata is derived from those inputs
inside the graph, so a replay launches nothing but the copy and the graph.
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from specserve.attention.base import AttentionBackend, ForwardBatch, ForwardMode
from specserve.kv.pool import PADDING_SLOT, KVPool

logger = logging.getLogger("specserve")


def batch_size_buckets(max_bs: int) -> list[int]:
    small = [1, 2, 4, 8]
    return sorted({b for b in small if b <= max_bs} | set(range(16, max_bs + 1, 16)) | {max_bs})


@dataclass
class GraphInputs:
    """Views into one packed int64 buffer (host or device) for a (bucket, n) graph."""
    packed: torch.Tensor
    input_ids: torch.Tensor     # (bucket, n)
    positions: torch.Tensor     # (bucket, n)
    out_slots: torch.Tensor     # (bucket, n)
    req_rows: torch.Tensor      # (bucket,)
    prefix_lens: torch.Tensor   # (bucket,)
    extend_lens: torch.Tensor   # (bucket,), always n
    tree_mask: torch.Tensor     # (bucket, n, n) bool, kept apart: it is not int64

    @classmethod
    def allocate(cls, bucket: int, n: int, device, pin: bool = False) -> "GraphInputs":
        rows = bucket * n
        packed = torch.zeros(3 * rows + 3 * bucket, dtype=torch.long, device=device, pin_memory=pin)
        mask = torch.eye(n, dtype=torch.bool, device=device).expand(bucket, n, n).contiguous()
        if pin:
            mask = mask.pin_memory()
        parts = packed.split([rows, rows, rows, bucket, bucket, bucket])
        inputs = cls(packed, parts[0].view(bucket, n), parts[1].view(bucket, n), parts[2].view(bucket, n),
                     parts[3], parts[4], parts[5], mask)
        inputs.extend_lens.fill_(n)
        return inputs


class CudaGraphRunner:
    """Captures `model(batch, backend)` for every bucket and each tokens-per-request size."""

    def __init__(self, model, backend: AttentionBackend, pool: KVPool, max_bs: int, tokens_per_req: list[int]):
        self.model, self.backend, self.pool = model, backend, pool
        self.buckets = batch_size_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        self.sizes = sorted(set(tokens_per_req))
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.device_inputs: dict[tuple[int, int], GraphInputs] = {}
        self.host_inputs: dict[tuple[int, int], GraphInputs] = {}
        self._batches: dict[tuple[int, int], ForwardBatch] = {}
        # marks the last host-to-device copy out of each pinned host buffer: a step launched
        # ahead rewrites the buffer while the previous copy may still be queued
        self._copied: dict[tuple[int, int], torch.cuda.Event] = {}
        self.memory_pool = None
        backend.init_cuda_graph_state(self.max_bs, max(self.sizes), pool)
        start = time.perf_counter()
        for n in self.sizes:
            for bs in reversed(self.buckets):  # largest first: later graphs reuse its pool memory
                self._capture(bs, n)
        logger.info("captured %d CUDA graphs (batch sizes %s, tokens per request %s) in %.1f s",
                    len(self.graphs), self.buckets, self.sizes, time.perf_counter() - start)

    def can_run(self, bs: int, n: int) -> bool:
        return bs <= self.max_bs and n <= self.sizes[-1]

    def _static_batch(self, key: tuple[int, int]) -> ForwardBatch:
        bs, n = key
        s = self.device_inputs[key]
        return ForwardBatch(
            mode=ForwardMode.DECODE if n == 1 else ForwardMode.VERIFY,
            input_ids=s.input_ids.view(-1), positions=s.positions.view(-1), out_slots=s.out_slots.view(-1),
            req_rows=s.req_rows, prefix_lens=s.prefix_lens, extend_lens=s.extend_lens,
            prefix_lens_host=[0] * bs, extend_lens_host=[n] * bs, kv_pool=self.pool,
            logits_indices=torch.arange(bs * n, device=self.pool.device), tree_mask=s.tree_mask if n > 1 else None)

    @torch.inference_mode()
    def _capture(self, bs: int, n: int) -> None:
        key = (bs, n)
        self.device_inputs[key] = GraphInputs.allocate(bs, n, self.pool.device)
        self.host_inputs[key] = GraphInputs.allocate(bs, n, "cpu", pin=True)
        batch = self._static_batch(key)
        self.backend.plan_for_capture(batch)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: autotuning and lazy initialisation stay out of the graph
                self.model(batch, self.backend)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            self.backend.plan_for_capture(batch)  # captured: every replay re-derives the metadata
            self.outputs[key] = self.model(batch, self.backend)
        if self.memory_pool is None:
            self.memory_pool = graph.pool()
        self.graphs[key] = graph
        self._batches[key] = batch

    @torch.inference_mode()
    def replay(self, tokens: torch.Tensor, depth: torch.Tensor, tree_mask: torch.Tensor,
               node_slots: list[int], req_rows: list[int], kv_lens: list[int]) -> torch.Tensor:
        """tokens, depth (bs, m) and tree_mask (bs, m, m) on the host, m <= a captured n;
        node_slots: bs * m slots (PADDING_SLOT for padding nodes); tokens may instead be a
        (bs, 1) device tensor (a decode step launched before its inputs reached the host).
        Returns (bs, m, vocab)."""
        bs, m = tokens.shape
        n = self.sizes[bisect.bisect_left(self.sizes, m)]
        key = (self.buckets[bisect.bisect_left(self.buckets, bs)], n)
        host, device = self.host_inputs[key], self.device_inputs[key]
        if key in self._copied:
            self._copied[key].synchronize()
        on_device = tokens.is_cuda
        lens = np.asarray(kv_lens, dtype=np.int64)
        ids, positions, slots = host.input_ids.numpy(), host.positions.numpy(), host.out_slots.numpy()
        ids.fill(0)
        if not on_device:
            ids[:bs, :m] = tokens.numpy()
        positions.fill(0)
        positions[:bs, :m] = depth.numpy() + lens[:, None]
        slots.fill(PADDING_SLOT)
        slots[:bs, :m] = np.asarray(node_slots, dtype=np.int64).reshape(bs, m)
        rows, prefix = host.req_rows.numpy(), host.prefix_lens.numpy()
        rows.fill(0)
        rows[:bs] = req_rows
        prefix.fill(0)
        prefix[:bs] = lens
        device.packed.copy_(host.packed, non_blocking=True)
        if on_device:
            device.input_ids[:bs, :m].copy_(tokens)
        if n > 1:
            mask = host.tree_mask.numpy()
            mask[:] = np.eye(n, dtype=bool)
            mask[:bs, :m, :m] = tree_mask.numpy()
            device.tree_mask.copy_(host.tree_mask, non_blocking=True)
        self._copied.setdefault(key, torch.cuda.Event()).record()
        self.graphs[key].replay()
        return self.outputs[key].view(key[0], n, -1)[:bs, :m]
