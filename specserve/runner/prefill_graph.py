"""CUDA graphs for prefill steps, one per token-count bucket.

An eager prefill step is host-bound for prompts up to a few thousand tokens: the forward of
Qwen2.5-Coder-1.5B launches ~320 kernels through ~300 module calls, 11 ms of host time for
a step whose GPU work takes 3 ms at 100 tokens (H100, `lab.prefill_cost`, 2026-11-24).
Every prefill step paid it: a turn's time to first token, and the prefill steps of a busy
server (~45% of its time at concurrency 64).

A graph runs `forward_prefill` for a bucket of T tokens and R requests: the step's tokens
come first, then padding tokens (token 0, position 0, KV slot PADDING_SLOT) that belong to
no request; requests past the step's have no tokens (table row `KVPool.scratch_row`). The
attention grid is fixed by T, R and the pool's longest context, and each replay's
programs come from a block table the graph computes (`TritonBackend.plan_ragged_extend`).
The graph returns the logits of R rows: the last token of each sampled request first, and,
for an EAGLE drafter, the hidden states it reads of all T tokens (HiddenCapture). Those
steps ran eagerly once: on an H200 (1.5B, EAGLE-3 held plain by the adaptive policy) the
time to the first token was 35-47 ms at batch 1 against plain decoding's 7-10 ms.

Steps with more tokens or requests than the largest graph and tensor-parallel ranks run
eagerly.
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
from specserve.model.hidden_capture import HiddenCapture
from specserve.runner.cuda_graph import capture_graph
from specserve.runner.stream_events import record

logger = logging.getLogger("specserve")

MAX_REQUESTS = 64   # prompts (chunks) one prefill graph holds; a step with more runs eagerly
# prefill sizes captured; between two buckets a step pads at most half its tokens (above 128)
TOKEN_BUCKETS = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)


def token_buckets(max_tokens: int) -> list[int]:
    """The buckets up to max_tokens, which is a bucket itself (the largest prefill step)."""
    return sorted({b for b in TOKEN_BUCKETS if b < max_tokens} | {max_tokens})


@dataclass
class PrefillInputs:
    """Views into one packed int64 buffer (pinned on the host, or on the device)."""
    packed: torch.Tensor
    input_ids: torch.Tensor     # (T,)
    positions: torch.Tensor     # (T,)
    out_slots: torch.Tensor     # (T,) KV slot of each token, PADDING_SLOT for padding
    req_rows: torch.Tensor      # (R,) req_to_token rows
    prefix_lens: torch.Tensor   # (R,) tokens already in each request's cache
    extend_lens: torch.Tensor   # (R,) this step's tokens of each request, 0 for padding requests
    logits_rows: torch.Tensor   # (R,) token index of each sampled request's last token, first

    @classmethod
    def allocate(cls, num_tokens: int, num_reqs: int, device, pin: bool = False) -> PrefillInputs:
        packed = torch.zeros(3 * num_tokens + 4 * num_reqs, dtype=torch.long, device=device, pin_memory=pin)
        return cls(packed, *packed.split([num_tokens] * 3 + [num_reqs] * 4))

    def fill(self, input_ids: list[int], positions: list[int], slots: list[int], req_rows: list[int],
             prefix_lens: list[int], extend_lens: list[int], logits_rows: list[int], scratch_row: int) -> None:
        """Writes a step into a host buffer through numpy views; the rest becomes padding."""
        for view, values, pad in ((self.input_ids, input_ids, 0), (self.positions, positions, 0),
                                  (self.out_slots, slots, PADDING_SLOT), (self.req_rows, req_rows, scratch_row),
                                  (self.prefix_lens, prefix_lens, 0), (self.extend_lens, extend_lens, 0),
                                  (self.logits_rows, logits_rows, 0)):
            array = view.numpy()
            array[:len(values)] = values
            array[len(values):] = pad


def forward_prefill(model, backend: AttentionBackend, pool: KVPool, inputs: PrefillInputs,
                    capture: HiddenCapture | None = None) -> torch.Tensor:
    """The target's forward over a padded prefill step; (R, vocab) fp32 logits at logits_rows.
    capture: filled with the hidden states of all T tokens."""
    num_reqs = inputs.req_rows.shape[0]
    batch = ForwardBatch(
        mode=ForwardMode.EXTEND, input_ids=inputs.input_ids, positions=inputs.positions,
        out_slots=inputs.out_slots, req_rows=inputs.req_rows, prefix_lens=inputs.prefix_lens,
        extend_lens=inputs.extend_lens, prefix_lens_host=[0] * num_reqs, extend_lens_host=[0] * num_reqs,
        kv_pool=pool, logits_indices=inputs.logits_rows, hidden_capture=capture)
    backend.plan_ragged_extend(batch)
    return model(batch, backend)


class PrefillGraphRunner:
    """Captures `forward_prefill` for each token bucket, for up to max_reqs requests."""

    def __init__(self, model, backend: AttentionBackend, pool: KVPool, max_tokens: int, max_reqs: int,
                 capture: HiddenCapture | None = None):
        """capture: hidden states every graph also outputs, of every token (an EAGLE drafter's)."""
        if capture is not None and capture.rows is not None:
            raise ValueError("a prefill graph keeps the states of every token: a capture of chosen rows runs eagerly")
        self.model, self.backend, self.pool, self.capture = model, backend, pool, capture
        self.buckets = token_buckets(max_tokens)
        self.max_reqs = max_reqs
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.features: dict[int, torch.Tensor | None] = {}   # (T, features) with a capture
        self.device_inputs: dict[int, PrefillInputs] = {}
        self.host_inputs: dict[int, PrefillInputs] = {}
        self._copied: dict[int, torch.cuda.Event] = {}   # the last copy out of each pinned buffer
        self.memory_pool = None   # its own: a decode graph's outputs outlive a prefill step
        start = time.perf_counter()
        for tokens in reversed(self.buckets):   # the largest first: the others reuse its memory
            self._capture(tokens)
        logger.info("captured %d prefill CUDA graphs (tokens %s, up to %d requests) in %.1f s",
                    len(self.graphs), self.buckets, max_reqs, time.perf_counter() - start)

    def can_run(self, num_tokens: int, num_reqs: int) -> bool:
        return num_tokens <= self.buckets[-1] and num_reqs <= self.max_reqs

    @torch.inference_mode()
    def _capture(self, tokens: int) -> None:
        inputs = self.device_inputs[tokens] = PrefillInputs.allocate(tokens, self.max_reqs, self.pool.device)
        self.host_inputs[tokens] = PrefillInputs.allocate(tokens, self.max_reqs, "cpu", pin=True)
        inputs.req_rows.fill_(self.pool.scratch_row)   # empty requests: the graph's attention reads nothing

        def run() -> tuple[torch.Tensor, torch.Tensor | None]:
            capture = self.capture.fresh() if self.capture is not None else None
            logits = forward_prefill(self.model, self.backend, self.pool, inputs, capture)
            return logits, None if capture is None else capture.features()
        self.graphs[tokens], (self.logits[tokens], self.features[tokens]) = capture_graph(run, self.memory_pool)
        if self.memory_pool is None:
            self.memory_pool = self.graphs[tokens].pool()

    @torch.inference_mode()
    def run(self, input_ids: list[int], positions: list[int], slots: list[int], req_rows: list[int],
            prefix_lens: list[int], extend_lens: list[int], sampled: list[bool],
            capture: HiddenCapture | None = None) -> torch.Tensor:
        """Replays the smallest graph that holds the step; returns (num_sampled, vocab) logits
        (a view into the graph's memory, valid until it runs again). sampled: whether each
        request's chunk ends its prompt (its last token gets logits). capture: given the
        step's hidden states (views, valid as long; the graphs must have been captured with one)."""
        tokens = self.buckets[bisect.bisect_left(self.buckets, len(input_ids))]
        ends = np.cumsum(extend_lens) - 1
        logits_rows = ends[np.asarray(sampled, dtype=bool)].tolist()
        host, device = self.host_inputs[tokens], self.device_inputs[tokens]
        if tokens in self._copied:
            self._copied[tokens].synchronize()
        host.fill(input_ids, positions, slots, req_rows, prefix_lens, extend_lens, logits_rows, self.pool.scratch_row)
        device.packed.copy_(host.packed, non_blocking=True)
        record(self._copied.setdefault(tokens, torch.cuda.Event()))
        self.graphs[tokens].replay()
        if capture is not None:
            capture.give_features(self.features[tokens][:len(input_ids)])
        return self.logits[tokens][:len(logits_rows)]
