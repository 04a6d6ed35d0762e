"""The EXTEND batch of a draft model's or an EAGLE head's catch-up: each request's tokens at
positions starts[i].. into its cache row, with no logits wanted.

A catch-up can hold thousands of rows (a probe's over 16 requests' prompts at batch 64, a
feed of the states 64 requests held), and its inputs were Python lists of every token,
position and slot: ~2.5 ms of host time for 16k rows on a 2-core CPU, where numpy takes
~0.45 ms. They go to the device as one packed copy queued without waiting (a probe's
catch-up runs while a plain step launched ahead computes; a blocking copy would wait for
it and leave the GPU idle while the forward's launches follow)."""
from __future__ import annotations

import itertools

import numpy as np
import torch

from specserve.attention.base import ForwardBatch, ForwardMode
from specserve.kv.pool import KVPool, host_to_device_async


def catch_up_batch(rows: list[int], starts: list[int], tokens: list[list[int]], slots: list[int],
                   pool: KVPool, device: torch.device) -> ForwardBatch:
    """rows: each request's cache row (req_rows); tokens[i] go to positions starts[i]..;
    slots: their KV slots, request after request (table entries already written)."""
    lengths = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    first = np.asarray(starts, dtype=np.int64)
    total, bs = int(lengths.sum()), len(lengths)
    # position of row j of request i: starts[i] + j, from one arange less each request's offset
    offsets = np.repeat(np.cumsum(lengths) - lengths - first, lengths)
    packed = np.concatenate([np.fromiter(itertools.chain.from_iterable(tokens), dtype=np.int64, count=total),
                             np.arange(total, dtype=np.int64) - offsets, np.asarray(slots, dtype=np.int64),
                             np.asarray(rows, dtype=np.int64), first, lengths, [total - 1]])
    device_packed = host_to_device_async(torch.from_numpy(packed), device)
    input_ids, positions, out_slots, req_rows, prefix_lens, extend_lens, logits_indices = device_packed.split(
        [total, total, total, bs, bs, bs, 1])
    return ForwardBatch(
        mode=ForwardMode.EXTEND, input_ids=input_ids, positions=positions, out_slots=out_slots,
        req_rows=req_rows, prefix_lens=prefix_lens, extend_lens=extend_lens, prefix_lens_host=list(starts),
        extend_lens_host=lengths.tolist(), kv_pool=pool, logits_indices=logits_indices)   # one row: the cheapest
