"""Each forward's inputs, from rank 0 to the worker ranks: `BroadcastingModel` and `StepHeader`.

The seam is the model's forward (`model(batch, backend)`): prefill chunks, decode steps and
verify steps of any draft tree all pass through it, so the scheduler, the drafters, the
sampler and verification stay in rank 0's process and single-process. Rank 0 sends a small
header (the mode, the sizes, the host-side lengths attention plans with) through each
worker's pipe, and the tensors in one packed int64 broadcast: the tokens, positions and KV
slots (allocated by rank 0's scheduler), the table rows, the logits rows and, for a verify
step, the draft trees' ancestor mask. A worker rebuilds the ForwardBatch over its own KV pool
(its heads of the same slots), plans attention and runs its shard of the same forward.

req_to_token: rank 0 alone keeps the table (the scheduler, the prefix cache and the device
commit of accepted paths write it); each step carries the rows of its requests up to the
longest prefix, which is all attention reads of it. That is bs x prefix int32 per step
(64 requests x 2k tokens: 512 KiB, microseconds over NVLink); a GPU run that finds it
costly could send only the entries written since the last step instead.

The header goes through a pipe, not the collective, because a worker waits for the next
step for as long as the engine is idle: a collective would time out.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specserve.attention.base import AttentionBackend, ForwardBatch, ForwardMode
from specserve.kv.pool import KVPool
from specserve.model.parallel.parallel_state import TensorParallelGroup

# (bs,) and (num_tokens,) fields of ForwardBatch sent as they are, in this order
_TOKEN_FIELDS = ("input_ids", "positions", "out_slots")
_REQUEST_FIELDS = ("req_rows", "prefix_lens", "extend_lens")


@dataclass(frozen=True)
class StepHeader:
    """What a worker needs before the packed tensor arrives: sizes and host-side lengths."""
    mode: ForwardMode
    num_logits: int
    tree_nodes: int                  # n of the (bs, n, n) tree mask; 0 without one
    prefix_lens_host: list[int]
    extend_lens_host: list[int]

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_host)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens_host)

    @property
    def table_columns(self) -> int:
        return max(self.prefix_lens_host, default=0)

    def part_sizes(self) -> list[int]:
        bs = self.batch_size
        return ([self.num_tokens] * len(_TOKEN_FIELDS) + [bs] * len(_REQUEST_FIELDS)
                + [self.num_logits, bs * self.tree_nodes ** 2, bs * self.table_columns])


def pack_step(batch: ForwardBatch) -> tuple[StepHeader, torch.Tensor]:
    """Rank 0: the header and the packed int64 tensor of one forward (on the batch's device)."""
    tree_nodes = 0 if batch.tree_mask is None else batch.tree_mask.shape[-1]
    header = StepHeader(batch.mode, batch.logits_indices.numel(), tree_nodes, list(batch.prefix_lens_host),
                        list(batch.extend_lens_host))
    pool = batch.kv_pool
    table = pool.req_to_token[batch.req_rows, :header.table_columns]
    parts = [getattr(batch, name).reshape(-1) for name in (*_TOKEN_FIELDS, *_REQUEST_FIELDS)]
    parts.append(batch.logits_indices.reshape(-1))
    if batch.tree_mask is not None:
        parts.append(batch.tree_mask.reshape(-1))
    parts.append(table.reshape(-1))
    packed = torch.cat([part.to(torch.long) for part in parts])
    return header, packed


def unpack_step(header: StepHeader, packed: torch.Tensor, pool: KVPool) -> ForwardBatch:
    """A worker: the ForwardBatch over its own pool, with rank 0's table rows written into it."""
    parts = dict(zip((*_TOKEN_FIELDS, *_REQUEST_FIELDS, "logits_indices", "tree_mask", "table"),
                     packed.split(header.part_sizes())))
    bs, n = header.batch_size, header.tree_nodes
    tree_mask, table = parts.pop("tree_mask"), parts.pop("table").view(bs, header.table_columns)
    tree_mask = tree_mask.view(bs, n, n).bool() if n else None
    pool.req_to_token[parts["req_rows"], :header.table_columns] = table.to(pool.req_to_token.dtype)
    return ForwardBatch(mode=header.mode, **parts, prefix_lens_host=header.prefix_lens_host,
                        extend_lens_host=header.extend_lens_host, kv_pool=pool, tree_mask=tree_mask)


class BroadcastingModel(nn.Module):
    """Rank 0's model: sends every forward's inputs to the worker ranks, then runs its own
    shard; the collectives inside the forward keep the ranks in step and bring the full
    logits back here."""

    def __init__(self, model: nn.Module, group: TensorParallelGroup):
        super().__init__()
        self.model = model   # rank 0's shard (a DecoderLM)
        self.group = group

    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        """The workers' batches keep no hidden states: the residual stream is whole on every
        rank after each all-reduce, so rank 0's capture (an EAGLE head's input) is complete."""
        header, packed = pack_step(batch)
        self.group.workers.send_step(header)
        self.group.broadcast(packed)
        return self.model(batch, backend)


def sharded_model(model: nn.Module) -> nn.Module:
    """The rank's own shard behind a runner's model (rank 0's wraps it in BroadcastingModel)."""
    return model.model if isinstance(model, BroadcastingModel) else model
