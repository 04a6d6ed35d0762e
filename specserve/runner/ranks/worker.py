"""A worker rank's process: join the group, load this rank's shard, build the same runner as
rank 0, then run every step rank 0 announces until told to stop.

The worker holds no scheduler, sampler or drafter: each step's inputs arrive whole (the
header through the pipe, the tensors by broadcast; step_broadcast.py, graph_steps.py), so
its state is its weights, its heads' KV pool and, on GPUs, its CUDA graphs. It exits when
rank 0 says stop, when rank 0's process is gone (the pipe closes) or when a collective
fails; any other error is sent to rank 0 first, so that the engine's message names it.
"""
from __future__ import annotations

import datetime
import logging
import multiprocessing.connection
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist

from specserve.args import ServerArgs
from specserve.model.parallel.parallel_state import TensorParallelError, TensorParallelGroup, create_process_group
from specserve.model.parallel.vocab_weights import send_vocabulary_shard
from specserve.runner.ranks.graph_steps import GraphStepHeader
from specserve.runner.ranks.step_broadcast import StepHeader, unpack_step

STORE_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class WorkerSpec:
    args: ServerArgs
    model_path: str
    rank: int
    size: int
    store_port: int
    device: str
    dtype: torch.dtype
    context_length: int


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the CPU for every rank, or the r-th GPU after rank 0's."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def run_worker(spec: WorkerSpec, conn: multiprocessing.connection.Connection) -> None:
    """The worker process' entry point (spawned by launcher.start_tensor_parallel)."""
    logging.basicConfig(level=spec.args.log_level.upper(), format=f"[specserve tp{spec.rank} %(asctime)s] %(message)s")
    if spec.device == "cpu":   # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.size))
    _exit_with_parent()
    try:
        runner = _build_runner(spec, conn)
        serve_steps(runner, conn)
        runner.tp.shutdown()
    except TensorParallelError:
        _exit_now()   # rank 0 is gone or failed: it reports the cause itself
    except BaseException:
        _send(conn, ("error", traceback.format_exc(limit=-3).strip().splitlines()[-1]))
        logging.getLogger("specserve").exception("tensor-parallel rank %d failed", spec.rank)
        _exit_now()


def _exit_now() -> None:
    """Exits at once with status 1. A normal interpreter exit destroys the NCCL communicator,
    which can wait on the peers; rank 0, blocked in a collective this rank never joins, is
    only released by the watchdog seeing this process end (H200 x2: a worker that raised
    stayed alive and both ranks hung until the call's timeout)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _build_runner(spec: WorkerSpec, conn: multiprocessing.connection.Connection):
    from specserve.model.loader import load_checkpoint, load_random_checkpoint
    from specserve.runner.model_runner import ModelRunner

    device = torch.device(spec.device)
    store = dist.TCPStore("127.0.0.1", spec.store_port, spec.size, False,
                          timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
    conn.send(("joining",))
    group = TensorParallelGroup(spec.rank, spec.size, create_process_group(store, spec.rank, spec.size, device), device)
    if spec.args.load_format == "dummy":
        checkpoint = load_random_checkpoint(spec.model_path, spec.dtype, device, seed=spec.args.random_seed,
                                            tp_rank=spec.rank, tp_size=spec.size)
    else:
        checkpoint = load_checkpoint(spec.model_path, spec.dtype, device, tp_rank=spec.rank, tp_size=spec.size)
    return ModelRunner(spec.args, checkpoint.config, checkpoint.state_dict, device, spec.dtype, spec.context_length,
                       tp=group)


def serve_steps(runner, conn: multiprocessing.connection.Connection) -> None:
    """Runs each collective step rank 0 announces: an eager forward, a CUDA graph replay, or
    the gather of a vocabulary weight for rank 0's drafter."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return   # rank 0's process is gone
        if message[0] == "stop":
            return
        header = message[1]
        with torch.inference_mode():
            if isinstance(header, StepHeader):
                run_eager_step(runner, header)
            elif isinstance(header, GraphStepHeader):
                runner.graphs.replay_announced(header)
            else:
                send_vocabulary_shard(runner.tp, runner.model, header)


def run_eager_step(runner, header: StepHeader) -> None:
    """This rank's shard of an eager forward (its logits, if any, are not needed here)."""
    group = runner.tp
    packed = group.broadcast(torch.empty(sum(header.part_sizes()), dtype=torch.long, device=group.device))
    batch = unpack_step(header, packed, runner.pool)
    runner.attn_backend.plan(batch)
    runner.model(batch, runner.attn_backend)


def _exit_with_parent() -> None:
    """Exits when rank 0's process is gone. Its pipe closing ends a worker waiting for a step,
    and gloo reports the closed connection; but on GPUs a worker inside an NCCL collective
    would wait for NCCL's timeout, holding its GPU, if rank 0 was killed mid-step."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="specserve-tp-parent-watch", daemon=True).start()


def _send(conn: multiprocessing.connection.Connection, message: tuple) -> None:
    try:
        conn.send(message)
    except OSError:
        pass
