"""CUDA graphs of a sampled plain decode step's sampling: the filters and the seeded race
(rules.plain_step_tokens) over a decode graph's logits, one graph per (batch bucket, filters used).

Eagerly, Sampler.sample_plain launched ~190 small device operations (softmax, the top-k /
top-p ranking, the counter-based random numbers, the race, a root-only tree's verification):
on an H100 (1.5B random weights, temperature 0.7, top-p 0.95) sampled plain decoding ran at
0.40x greedy's rate at batch 1 (BENCHMARKS.md), the host's launches setting the pace. Without
the trees' bookkeeping and with the counter hash in one kernel (random_kernels.py) they are
~70 (~35 without top-p), a CPU census; replayed from a graph they cost one copy of the
batch's parameters and one launch. The graph computes exactly what the eager call
does (the same operations; top-k rows ranked by a sort rather than a top-k selection, which
apply_sampling_filters makes equal), so a step's tokens do not depend on which ran.

Each graph reads the logits buffer of one decode graph bucket (its rows past the batch are
padding: greedy rows whose tokens nobody reads) and its parameters from one packed buffer
(columns.py), filled on the host and sent with a single copy; two pinned host
buffers per graph are used in turn, so a step launched ahead never waits for the copy of the
step before it, which the stream runs only after that step's forward.
"""
from __future__ import annotations

import itertools

import torch

from specserve.runner.cuda_graph import capture_graph
from specserve.runner.stream_events import record
from specserve.sampling.columns import SamplingColumns
from specserve.verify.rules import plain_step_tokens


class _Graph:
    """One bucket's sampling graph for one set of filters, its device inputs and the two
    pinned host buffers filled in turn."""

    def __init__(self, logits: torch.Tensor, vocab_size: int, need_top_k_top_p: bool, need_min_p: bool, pool):
        bucket = logits.shape[0]
        self.inputs = SamplingColumns.allocate(bucket, logits.device)
        self.hosts = [SamplingColumns.allocate(bucket, "cpu", pin=logits.is_cuda) for _ in range(2)]
        self.copied = [torch.cuda.Event(), torch.cuda.Event()]
        self.used = [False, False]
        self.turn = 0
        # Rows past a batch: greedy, without filters.
        self.padding = {"temperatures": 0.0, "top_ps": 1.0, "min_ps": 0.0, "top_ks": vocab_size, "seeds": 0,
                        "positions": 0}
        columns = self.inputs.columns()
        for name, column in columns.items():   # until a replay's copy
            column.fill_(self.padding[name])

        def sample() -> torch.Tensor:
            return plain_step_tokens(logits, **columns, need_top_k_top_p=need_top_k_top_p, need_min_p=need_min_p)
        self.graph, self.tokens = capture_graph(sample, pool)
        # The captured function lives as long as its graph, and with it every tensor the replays
        # read: a graph keeps only their addresses, and memory freed with the closure is the
        # caching allocator's to hand out again (the root trees the function once built: an
        # eager step's tensors landed on them, and the next replay gathered at garbage indices).
        self.captured = sample

    def replay(self, values: dict[str, list]) -> torch.Tensor:
        """The batch's tokens (bs,), queued: values holds each column's bs rows."""
        turn, self.turn = self.turn, 1 - self.turn
        if self.used[turn]:   # its copy was queued two steps ago, before the step since read
            self.copied[turn].synchronize()
        host, bs = self.hosts[turn], len(values["seeds"])
        host.fill(values, self.padding)
        self.inputs.packed.copy_(host.packed, non_blocking=True)
        record(self.copied[turn])
        self.used[turn] = True
        self.graph.replay()
        return self.tokens[:bs].clone()   # the graph's memory is the next replay's


class PlainSamplingGraphs:
    """The graphs of one engine over the decode graphs' logits buffers (static_logits: one
    (bucket, vocab) tensor per bucket), captured by the warm-up (capture_all) or on first use."""

    def __init__(self, static_logits: list[torch.Tensor], vocab_size: int):
        self.buffers = {logits.data_ptr(): logits for logits in static_logits}
        self.vocab_size = vocab_size
        self.graphs: dict[tuple[int, bool, bool], _Graph] = {}
        self.pool = None

    def covers(self, logits: torch.Tensor) -> bool:
        """Whether logits (bs, vocab) are the first rows of a decode graph's buffer."""
        buffer = self.buffers.get(logits.data_ptr())
        return buffer is not None and logits.shape[0] <= buffer.shape[0] and logits.stride() == buffer.stride()

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Captures every bucket's graph for every set of filters (start-up's warm-up calls it),
        so that no sampled request pays a capture, and the requests decoding beside it no wait,
        at its first step of a new batch size. The largest bucket first: the shared pool takes
        that graph's memory once and the smaller graphs reuse it. Returns how many it captured."""
        before = len(self.graphs)
        for logits in sorted(self.buffers.values(), key=lambda buffer: -buffer.shape[0]):
            for filters in itertools.product((True, False), repeat=2):
                self._graph(logits, *filters)
        return len(self.graphs) - before

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, values: dict[str, list], need_top_k_top_p: bool,
               need_min_p: bool) -> torch.Tensor:
        """verify_sampling's plain tokens (bs,) for logits that `covers` accepts."""
        return self._graph(logits, need_top_k_top_p, need_min_p).replay(values)

    def _graph(self, logits: torch.Tensor, need_top_k_top_p: bool, need_min_p: bool) -> _Graph:
        """The graph over logits' buffer for these filters, captured if it is not yet."""
        key = (logits.data_ptr(), need_top_k_top_p, need_min_p)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = _Graph(self.buffers[logits.data_ptr()], self.vocab_size, need_top_k_top_p,
                                              need_min_p, self.pool)
            if self.pool is None:
                self.pool = graph.graph.pool()
        return graph
