"""ChainGraphs: a model drafter's whole drafting (draft_chain.run_chain: the fed rows and K - 1
draft steps; or draft_tree.run_tree) captured as one CUDA graph per (batch bucket, argmax or
sampled drafts), so a step's drafting is one replay. Inputs ride in one packed buffer sent with a single copy;
what else a chain reads (EAGLE's target states) lives in static buffers its runner fills."""
from __future__ import annotations

import bisect
import logging
import time
from typing import Callable

import torch

from specserve.runner.cuda_graph import batch_size_buckets, capture_graph
from specserve.runner.stream_events import record
from specserve.speculative.model_drafters.draft_chain import ChainInputs, ChainRow

logger = logging.getLogger("specserve")

# (inputs of a bucket, q buffer or None) -> drafts (bucket, ...)
ChainRun = Callable[[ChainInputs, "torch.Tensor | None"], torch.Tensor]


class ChainGraphs:
    def __init__(self, run: ChainRun, max_bs: int, rows_per_req: int, draft_slots: int, scratch_row: int,
                 device: torch.device, probs_shape: tuple[int, int] | None):
        """probs_shape: (K + 1, vocab) of a sampling chain's q; None: argmax drafts only."""
        self.buckets = batch_size_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        self.scratch_row = scratch_row
        self.device_inputs = {bs: ChainInputs.allocate(bs, rows_per_req, draft_slots, device) for bs in self.buckets}
        self.host_inputs = {bs: ChainInputs.allocate(bs, rows_per_req, draft_slots, "cpu", pin=True)
                            for bs in self.buckets}
        # q of the sampling graphs, shared; the last node has no child: its q stays 0
        self.probs = None if probs_shape is None else torch.zeros((self.max_bs, *probs_shape), device=device)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.drafts: dict[tuple[int, bool], torch.Tensor] = {}
        self._copied: dict[int, torch.cuda.Event] = {}
        memory_pool = None
        start = time.perf_counter()
        for sample in (False, True) if self.probs is not None else (False,):
            for bs in reversed(self.buckets):    # largest first: later graphs reuse its pool memory
                inputs = self.device_inputs[bs]
                inputs.req_rows.fill_(scratch_row)
                inputs.num_fed.fill_(1)
                self.graphs[bs, sample], self.drafts[bs, sample] = capture_graph(
                    lambda: run(inputs, self.probs if sample else None), memory_pool)
                memory_pool = memory_pool or self.graphs[bs, sample].pool()
        logger.info("captured %d drafting CUDA graphs (batch sizes %s) in %.1f s",
                    len(self.graphs), self.buckets, time.perf_counter() - start)

    def bucket(self, bs: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, bs)]

    @torch.inference_mode()
    def replay(self, rows: list[ChainRow], sample: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Outputs are views of graph memory, valid until the next chain replays."""
        bs = len(rows)
        bucket = self.bucket(bs)
        host, device = self.host_inputs[bucket], self.device_inputs[bucket]
        if bucket in self._copied:
            self._copied[bucket].synchronize()   # the previous copy out of this pinned buffer is done
        host.fill(rows, self.scratch_row)
        device.packed.copy_(host.packed, non_blocking=True)
        record(self._copied.setdefault(bucket, torch.cuda.Event()))
        self.graphs[bucket, sample].replay()
        return self.drafts[bucket, sample][:bs], self.probs[:bs] if sample else None
