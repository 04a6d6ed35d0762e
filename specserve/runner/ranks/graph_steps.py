"""Replaying a CUDA graph on every tensor-parallel rank: `GraphStepHeader`,
`announce_graph_step` (rank 0) and `replay_announced_step` (a worker).

Every rank captured the same graphs in the same order (cuda_graph.CudaGraphRunner, checked
by TensorParallelGroup.agree), each holding the forward's all-reduces and its vocabulary
all-gather. A replay on rank 0 is announced first: the header names the graph, and one
broadcast carries the graph's packed inputs (as rank 0's replay reads them: after a device
root was copied in) and the rows of req_to_token the step's attention reads, which only
rank 0 keeps up to date (step_broadcast.py says why). The worker writes both into its own
graph inputs and table and replays the same graph; the collectives inside then pair up.

Nothing here waits for the host: on GPUs the broadcast is queued on the stream before the
replay, so a decode step launched ahead (the overlap schedule) stays ahead.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from specserve.kv.pool import KVPool
from specserve.model.parallel.parallel_state import TensorParallelGroup


@dataclass(frozen=True)
class GraphStepHeader:
    key: tuple[int, int]   # the graph: (batch bucket, tokens per request)
    batch_size: int        # real requests: their table rows travel with the step
    table_columns: int     # their longest prefix (the columns attention reads)

    def table_size(self) -> int:
        return self.batch_size * self.table_columns


def announce_graph_step(group: TensorParallelGroup, header: GraphStepHeader, packed_inputs: torch.Tensor,
                        req_rows: torch.Tensor, pool: KVPool) -> None:
    """Rank 0, just before replaying the graph of header.key. packed_inputs: the graph's
    int64 input buffer (on the device, filled); req_rows: its (bucket,) table-row view."""
    rows = req_rows[:header.batch_size]
    table = pool.req_to_token[rows, :header.table_columns]    # (bs, columns)
    group.workers.send_step(header)
    group.broadcast(torch.cat([packed_inputs, table.reshape(-1).to(torch.long)]))


def replay_announced_step(group: TensorParallelGroup, header: GraphStepHeader, packed_inputs: torch.Tensor,
                          req_rows: torch.Tensor, pool: KVPool, replay: Callable[[], None]) -> None:
    """A worker: rank 0's inputs into this rank's graph buffer and table, then the replay."""
    size = packed_inputs.numel()
    received = group.broadcast(torch.empty(size + header.table_size(), dtype=torch.long, device=group.device))
    packed_inputs.copy_(received[:size])
    table = received[size:].view(header.batch_size, header.table_columns)
    pool.req_to_token[req_rows[:header.batch_size], :header.table_columns] = table.to(pool.req_to_token.dtype)
    replay()
