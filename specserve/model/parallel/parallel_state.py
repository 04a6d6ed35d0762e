"""`TensorParallelGroup`: one rank's view of the tensor-parallel group and the collectives the
sharded model and the step broadcast use (all-reduce, gather of the vocabulary shards,
broadcast from rank 0, a minimum over ranks, a check that every rank holds the same value).

The group is an explicit object handed to the model and the runner, built on its own
ProcessGroup (gloo on a CPU, NCCL on GPUs) rather than torch.distributed's process-wide
default group: nothing global, so a process may build, shut down and rebuild engines.

A collective that fails (a peer died: gloo reports a closed connection at once; NCCL's
blocked kernels are aborted by rank 0's watchdog, launcher.py) raises TensorParallelError
with the reason the group knows (which rank died, and how), never a bare transport error.

CUDA graphs (GPUs only; a CPU has none): the all-reduces and the vocabulary all-gather sit
inside the forward every rank captures, one graph per (batch bucket, tokens per request),
in the same order on every rank (`agree` checks the plan first: collectives captured in a
different order would pair wrong ops). NCCL collectives can be captured (NCCL >= 2.9.6)
once the communicator exists: the KV size's `min_over_ranks` creates it, and capture_graph's
two warm-up runs use every collective eagerly before capture; torch's ProcessGroupNCCL
keeps captured work away from its watchdog. Rank 0 replays by announcing the graph
(graph_steps.py): each worker replays the same graph on the same inputs.
"""
from __future__ import annotations

import datetime
import os
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from specserve.errors import EngineFatalError

COLLECTIVE_TIMEOUT_S = 600.0   # a live rank that stops answering; a dead one is reported at once


class TensorParallelError(EngineFatalError):
    """A tensor-parallel rank died or stopped answering: the engine cannot go on."""


def create_process_group(store: dist.Store, rank: int, size: int, device: torch.device,
                         timeout_s: float = COLLECTIVE_TIMEOUT_S) -> dist.ProcessGroup:
    """Gloo for CPU tensors, NCCL for CUDA ones; blocks until every rank has joined."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.PrefixStore("specserve-tp", store)
    if device.type != "cuda":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    # NVLink SHARP (multicast) needs fabric-manager state the lent machines do not keep
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    # rank 0's device may be a bare "cuda" (the current device); set_device wants an index
    torch.cuda.set_device(device.index if device.index is not None else torch.cuda.current_device())
    options = dist.ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, options)


class RankProcesses(Protocol):
    """Rank 0's worker processes as the group sees them (the launcher's WorkerSet)."""

    def failure(self) -> str | None:
        """Why a worker is gone, or None while all are alive."""

    def shutdown(self) -> None:
        """Stops every worker process."""


class TensorParallelGroup:
    def __init__(self, rank: int, size: int, process_group: dist.ProcessGroup, device: torch.device,
                 workers: RankProcesses | None = None):
        """workers: on rank 0, the worker processes it started (their failures are this group's)."""
        self.rank, self.size, self.device = rank, size, device
        self.process_group = process_group
        self.workers = workers
        self.failure: str | None = None   # set once the group is broken; every later call raises it

    @property
    def is_driver(self) -> bool:
        """Rank 0: runs the scheduler and the step loop and sends each forward's inputs."""
        return self.rank == 0

    # --- collectives ---
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks, in place (the row-parallel linears' partial outputs)."""
        self._run(lambda: self.process_group.allreduce([x]))
        return x

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """(rows, vocab_per_rank) shards -> (rows, vocab_size) logits on rank 0 (gloo) or on
        every rank (NCCL), None on the others.

        The sampler, verification and the KV commit need the full logits on rank 0 only.
        On GPUs every rank gets them through one all-gather: a CUDA graph holds it (as it
        does an all-reduce), and each rank's graph of a verify step then verifies and commits
        exactly as rank 0's does, so every rank captures the same function."""
        if self.device.type == "cuda":
            return self.all_gather_vocab(logits, vocab_size)
        options = dist.GatherOptions()
        options.rootRank = 0
        logits = logits.contiguous()
        if not self.is_driver:
            self._run(lambda: self.process_group.gather([], [logits], options))
            return None
        shards = [torch.empty_like(logits) for _ in range(self.size)]
        self._run(lambda: self.process_group.gather([shards], [logits], options))
        return torch.cat(shards, dim=-1)[..., :vocab_size]

    def all_gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """(rows, vocab_per_rank) shards -> (rows, vocab_size) logits on every rank."""
        flat = logits.reshape(-1, logits.shape[-1]).contiguous()        # (rows, vocab_per_rank)
        shards = flat.new_empty((self.size * flat.shape[0], flat.shape[1]))   # rank after rank
        self._run(lambda: self.process_group._allgather_base(shards, flat))
        # explicit widths: a step whose chunks end no prompt samples no rows (0 elements, -1 ambiguous)
        whole = shards.view(self.size, *flat.shape).transpose(0, 1).reshape(flat.shape[0], self.size * flat.shape[1])
        return whole[:, :vocab_size].view(*logits.shape[:-1], vocab_size)

    def gather_rows_into(self, shard: torch.Tensor, full: torch.Tensor | None) -> None:
        """Rank r's (rows, ...) shard into rows r * rows .. of rank 0's `full` (None on the
        other ranks): a vocabulary-parallel weight made whole on rank 0."""
        options = dist.GatherOptions()
        options.rootRank = 0
        shard = shard.contiguous()
        if not self.is_driver:
            self._run(lambda: self.process_group.gather([], [shard], options))
            return
        parts = list(full.split(shard.shape[0]))   # contiguous row blocks of a contiguous tensor
        if len(parts) != self.size:
            raise ValueError(f"{tuple(full.shape)} rows are not {self.size} shards of {tuple(shard.shape)}")
        self._run(lambda: self.process_group.gather([parts], [shard], options))

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor into every rank's `tensor`, in place."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._run(lambda: self.process_group.broadcast([tensor], options))
        return tensor

    def min_over_ranks(self, value: int) -> int:
        """The smallest of every rank's value (e.g. the KV tokens each rank's memory holds)."""
        return self._reduce(value, dist.ReduceOp.MIN)

    def agree(self, value: int, what: str) -> None:
        """A TensorParallelError on every rank unless every rank holds the same `value` (e.g. a
        fingerprint of the CUDA graphs it is about to capture): ranks whose collectives would
        pair up wrong stop with a reason instead of hanging or mixing data."""
        low, high = self._reduce(value, dist.ReduceOp.MIN), self._reduce(value, dist.ReduceOp.MAX)
        if low != high:
            self.fail(f"the tensor-parallel ranks disagree on {what} (values {low} to {high} over the ranks, "
                      f"rank {self.rank}'s {value})")
            raise TensorParallelError(self.failure)

    def _reduce(self, value: int, op: dist.ReduceOp) -> int:
        x = torch.tensor([value], dtype=torch.long, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = op
        self._run(lambda: self.process_group.allreduce([x], options))
        return int(x.item())

    def _run(self, launch: Callable[[], dist.Work]) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        try:
            launch().wait()
        except RuntimeError as error:
            self.fail(self._reason(error))
            raise TensorParallelError(self.failure) from error

    # --- failure and shutdown ---
    def _reason(self, error: RuntimeError) -> str:
        if self.workers is not None:
            died = self.workers.failure()
            if died is not None:
                return died
        who = "a tensor-parallel rank" if self.is_driver else "rank 0 (the engine's process)"
        return f"{who} stopped answering a collective: {' '.join(str(error).split())[:300]}"

    def fail(self, reason: str) -> None:
        """Marks the group broken (first reason kept); NCCL kernels waiting on a dead peer are
        aborted so that the thread blocked behind them gets its error instead of hanging."""
        if self.failure is None:
            self.failure = reason
            self._abort_nccl()

    def shutdown(self) -> None:
        """Stops the worker processes (rank 0) and marks the group closed; on GPUs the
        communicator is aborted, not destroyed: once CUDA graphs captured collectives, a
        destroy can wait on peers (pytorch#115388) and abort is local."""
        if self.workers is not None:
            self.workers.shutdown()
        if self.failure is None:
            self.failure = "the tensor-parallel group was shut down"
            self._abort_nccl()

    def _abort_nccl(self) -> None:
        abort = getattr(self.process_group, "abort", None)
        if self.device.type == "cuda" and abort is not None:
            abort()
