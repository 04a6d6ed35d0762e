"""Rank 0's side of tensor parallelism: starting the worker ranks, watching them, stopping them.

`start_tensor_parallel` spawns one process per worker rank (spawn, not fork: the parent has
threads and, on GPUs, a CUDA context), each with a pipe to rank 0, and joins the group with
them. A worker sends ("joining",) just before its process group blocks on the rendezvous,
so a worker that dies while importing or loading is reported at once instead of after the
rendezvous' timeout; one that fails later sends ("error", traceback) and exits.

`WorkerSet` owns the processes: it sends each step's header (step_broadcast.py), names the
rank that died and how (its exit code or signal, its last error) for TensorParallelError,
and a watchdog thread marks the group failed the moment a worker exits, which aborts a
collective blocked on it (NCCL; gloo reports the closed connection by itself). Shutdown
sends ("stop",), then terminates and finally kills what has not exited: nothing outlives
the engine (the processes are also daemons, reaped if the engine's process exits first).
"""
from __future__ import annotations

import datetime
import multiprocessing
import multiprocessing.connection
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from specserve.args import ServerArgs
from specserve.model.parallel.parallel_state import TensorParallelError, TensorParallelGroup, create_process_group
from specserve.runner.ranks.worker import WorkerSpec, rank_device, run_worker

JOIN_TIMEOUT_S = 300.0   # worker start-up (spawning Python and importing torch) before the rendezvous
STOP_TIMEOUT_S = 5.0


@dataclass(eq=False)   # hashed by identity: one per process
class WorkerHandle:
    rank: int
    process: multiprocessing.process.BaseProcess
    conn: multiprocessing.connection.Connection
    last_error: str | None = None

    def describe_exit(self) -> str:
        code = self.process.exitcode
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        self.read_messages()
        cause = f"; its error: {self.last_error}" if self.last_error else ""
        return (f"tensor-parallel rank {self.rank} (pid {self.process.pid}) {how}{cause}; "
                "the engine cannot go on without it: restart it")

    def read_messages(self) -> list[tuple]:
        """Whatever the worker sent and nobody read yet (keeping the last error it reported)."""
        messages = []
        try:
            while self.conn.poll():
                messages.append(self.conn.recv())
        except (EOFError, OSError):
            pass
        for message in messages:
            if message[0] == "error":
                self.last_error = message[1]
        return messages


class WorkerSet:
    def __init__(self, handles: list[WorkerHandle]):
        self.handles = handles
        self._stopping = False
        self._watchdog: threading.Thread | None = None

    def send_step(self, header: Any) -> None:
        """A step's header to every worker; a dead worker is a TensorParallelError here, before
        rank 0 blocks in the broadcast that follows."""
        for handle in self.handles:
            if handle.process.exitcode is not None:
                raise TensorParallelError(handle.describe_exit())
            try:
                handle.conn.send(("step", header))
            except OSError as error:   # its end of the pipe closed: it is exiting
                raise TensorParallelError(self.failure() or f"rank {handle.rank}'s pipe broke: {error}") from error

    def failure(self, wait_s: float = 2.0) -> str | None:
        """Why a worker is gone, or None if all are alive after wait_s (a collective can see a
        peer's closed connection a few milliseconds before its exit can be collected)."""
        deadline = time.monotonic() + wait_s
        while True:
            for handle in self.handles:
                if handle.process.exitcode is not None:
                    return handle.describe_exit()
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    def wait_for(self, kind: str, timeout_s: float) -> None:
        """Until every worker has sent a message of `kind`; a worker that exits or reports an
        error first is a TensorParallelError naming it."""
        waiting = {handle.process.sentinel: handle for handle in self.handles}
        waiting.update({handle.conn: handle for handle in self.handles})
        pending, deadline = set(self.handles), time.monotonic() + timeout_s
        while pending:
            ready = multiprocessing.connection.wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                ranks = sorted(handle.rank for handle in pending)
                raise TensorParallelError(f"tensor-parallel rank(s) {ranks} did not start within {timeout_s:.0f} s")
            for key in ready:
                handle = waiting[key]
                if key is handle.conn and any(m[0] == kind for m in handle.read_messages()):
                    pending.discard(handle)
                if handle.last_error is not None or handle.process.exitcode is not None:
                    handle.process.join(STOP_TIMEOUT_S)
                    raise TensorParallelError(handle.describe_exit())

    def watch(self, on_failure: Callable[[str], None]) -> None:
        """Calls on_failure(reason) from a daemon thread as soon as a worker exits unasked."""
        def run() -> None:
            sentinels = [handle.process.sentinel for handle in self.handles]
            while not self._stopping:
                if multiprocessing.connection.wait(sentinels, timeout=0.5) and not self._stopping:
                    # the sentinel fires as the process closes its handles, just before it can be reaped
                    on_failure(self.failure() or "a tensor-parallel rank exited")
                    return
        self._watchdog = threading.Thread(target=run, name="specserve-tp-watchdog", daemon=True)
        self._watchdog.start()

    def shutdown(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        for handle in self.handles:
            try:
                handle.conn.send(("stop",))
            except OSError:
                pass
        for handle in self.handles:
            process = handle.process
            process.join(STOP_TIMEOUT_S)
            for end in (process.terminate, process.kill):
                if process.exitcode is None:
                    end()
                    process.join(STOP_TIMEOUT_S)
            handle.conn.close()
        if self._watchdog is not None:
            self._watchdog.join(timeout=1.0)


def start_tensor_parallel(args: ServerArgs, model_path: str, device: torch.device, dtype: torch.dtype,
                          context_length: int) -> TensorParallelGroup:
    """Starts ranks 1..tp_size-1 (they load their shards meanwhile) and returns rank 0's group."""
    size = args.tp_size
    store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=datetime.timedelta(seconds=JOIN_TIMEOUT_S),
                          wait_for_workers=False)
    context = multiprocessing.get_context("spawn")
    handles = []
    for rank in range(1, size):
        parent_end, child_end = context.Pipe()
        spec = WorkerSpec(args, model_path, rank, size, store.port, str(rank_device(device, rank)), dtype,
                          context_length)
        process = context.Process(target=run_worker, args=(spec, child_end), name=f"specserve-tp-rank{rank}",
                                  daemon=True)
        process.start()
        child_end.close()
        handles.append(WorkerHandle(rank, process, parent_end))
    workers = WorkerSet(handles)
    try:
        workers.wait_for("joining", JOIN_TIMEOUT_S)
        group = TensorParallelGroup(0, size, create_process_group(store, 0, size, device), device, workers)
    except BaseException:
        workers.shutdown()
        raise
    workers.watch(group.fail)
    return group
