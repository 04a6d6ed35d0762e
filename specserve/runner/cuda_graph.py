"""CUDA graphs for the DECODE and VERIFY forwards, one per (batch-size bucket, tokens per
request), replayed over static input buffers.

A graph batch has `bucket` requests of exactly `n` tokens each (n = 1 for DECODE, the
draft size for VERIFY). Real requests with smaller trees, and the padding requests that
fill a bucket, get padding nodes: token 0, KV slot PADDING_SLOT, a tree-mask row that sees
only itself; their logits are dropped. Prefill (EXTEND) stays eager: its shapes vary.
"""
from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass

import torch

from specserve.attention.base import AttentionBackend, ForwardBatch, ForwardMode
from specserve.kv.pool import PADDING_SLOT, KVPool

logger = logging.getLogger("specserve")


def batch_size_buckets(max_bs: int) -> list[int]:
    small = [1, 2, 4, 8]
    return sorted({b for b in small if b <= max_bs} | set(range(16, max_bs + 1, 16)) | {max_bs})


@dataclass
class _StaticInputs:
    input_ids: torch.Tensor     # (max_bs * n,) int64
    positions: torch.Tensor     # (max_bs * n,) int64
    out_slots: torch.Tensor     # (max_bs * n,) int64
    req_rows: torch.Tensor      # (max_bs,) int64
    prefix_lens: torch.Tensor   # (max_bs,) int64
    extend_lens: torch.Tensor   # (max_bs,) int64, always n
    tree_mask: torch.Tensor     # (max_bs, n, n) bool
    logits_indices: torch.Tensor


class CudaGraphRunner:
    """Captures `model(batch, backend)` for every bucket and each tokens-per-request size."""

    def __init__(self, model, backend: AttentionBackend, pool: KVPool, max_bs: int, tokens_per_req: list[int]):
        self.model, self.backend, self.pool = model, backend, pool
        self.buckets = batch_size_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        self.sizes = sorted(set(tokens_per_req))
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.inputs: dict[int, _StaticInputs] = {}
        self.memory_pool = None
        backend.init_cuda_graph_state(self.max_bs, max(self.sizes), pool)
        start = time.perf_counter()
        for n in self.sizes:
            self.inputs[n] = self._allocate_inputs(n)
            for bs in reversed(self.buckets):  # largest first: later graphs reuse its pool memory
                self._capture(bs, n)
        logger.info("captured %d CUDA graphs (batch sizes %s, tokens per request %s) in %.1f s",
                    len(self.graphs), self.buckets, self.sizes, time.perf_counter() - start)

    def can_run(self, bs: int, n: int) -> bool:
        return bs <= self.max_bs and any(size >= n for size in self.sizes)

    def graph_size(self, n: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def _allocate_inputs(self, n: int) -> _StaticInputs:
        device, rows = self.pool.device, self.max_bs * n
        long = dict(dtype=torch.long, device=device)
        return _StaticInputs(
            input_ids=torch.zeros(rows, **long), positions=torch.zeros(rows, **long),
            out_slots=torch.full((rows,), PADDING_SLOT, **long), req_rows=torch.zeros(self.max_bs, **long),
            prefix_lens=torch.zeros(self.max_bs, **long), extend_lens=torch.full((self.max_bs,), n, **long),
            tree_mask=torch.eye(n, dtype=torch.bool, device=device).expand(self.max_bs, n, n).contiguous(),
            logits_indices=torch.arange(rows, device=device))

    def _static_batch(self, bs: int, n: int) -> ForwardBatch:
        s = self.inputs[n]
        rows = bs * n
        return ForwardBatch(
            mode=ForwardMode.DECODE if n == 1 else ForwardMode.VERIFY,
            input_ids=s.input_ids[:rows], positions=s.positions[:rows], out_slots=s.out_slots[:rows],
            req_rows=s.req_rows[:bs], prefix_lens=s.prefix_lens[:bs], extend_lens=s.extend_lens[:bs],
            prefix_lens_host=[0] * bs, extend_lens_host=[n] * bs, kv_pool=self.pool,
            logits_indices=s.logits_indices[:rows], tree_mask=s.tree_mask[:bs] if n > 1 else None)

    @torch.inference_mode()
    def _capture(self, bs: int, n: int) -> None:
        batch = self._static_batch(bs, n)
        self.backend.plan_for_capture(batch)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: autotuning and lazy initialisation stay out of the graph
                self.model(batch, self.backend)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            self.outputs[(bs, n)] = self.model(batch, self.backend)
        if self.memory_pool is None:
            self.memory_pool = graph.pool()
        self.graphs[(bs, n)] = graph

    @torch.inference_mode()
    def replay(self, trees_tokens: torch.Tensor, trees_depth: torch.Tensor, tree_mask: torch.Tensor,
               node_slots: torch.Tensor, req_rows: list[int], kv_lens: list[int]) -> torch.Tensor:
        """trees_*: (bs, m) with m <= graph n; node_slots (bs, m) int64 (PADDING_SLOT for
        padding nodes). Returns (bs, m, vocab) logits."""
        bs, m = trees_tokens.shape
        n = self.graph_size(m)
        bucket = self.buckets[bisect.bisect_left(self.buckets, bs)]
        s = self.inputs[n]
        device = s.input_ids.device
        host = torch.tensor([req_rows + [0] * (bucket - bs), kv_lens + [0] * (bucket - bs)], dtype=torch.long)
        host = host.to(device, non_blocking=True)
        s.req_rows[:bucket].copy_(host[0])
        s.prefix_lens[:bucket].copy_(host[1])
        grid = lambda t: t[:bucket * n].view(bucket, n)
        _fill(grid(s.input_ids), trees_tokens, 0)
        _fill(grid(s.positions), trees_depth + host[1, :bs].unsqueeze(1), 0)
        _fill(grid(s.out_slots), node_slots, PADDING_SLOT)
        if n > 1:
            s.tree_mask[:bucket].copy_(torch.eye(n, dtype=torch.bool, device=device))
            s.tree_mask[:bs, :m, :m].copy_(tree_mask)
        batch = self._static_batch(bucket, n)
        self.backend.plan_for_replay(batch)
        self.graphs[(bucket, n)].replay()
        return self.outputs[(bucket, n)].view(bucket, n, -1)[:bs, :m]


def _fill(target: torch.Tensor, values: torch.Tensor, pad: int) -> None:
    """target (bucket, n) <- values (bs, m) in its top-left corner, pad elsewhere."""
    bs, m = values.shape
    target.fill_(pad)
    target[:bs, :m].copy_(values)
