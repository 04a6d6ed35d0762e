"""The collectives behind tensor-parallel CUDA graphs and drafters, run on the CPU (gloo, 2
ranks in two spawned processes, no engine): what a GPU run relies on but cannot show when it
goes wrong.

- the vocabulary all-gather (NCCL's gather_vocab: every rank's graph verifies on the whole
  logits) gives each rank the logits rank 0's gather does;
- a vocabulary weight gathered whole on rank 0 (an EAGLE head's borrowed embedding);
- a graph step announced by rank 0 arrives as rank 0's graph inputs and table rows in the
  worker's buffers before its replay runs;
- ranks about to capture different CUDA graph plans stop with an error naming it, on every
  rank, instead of capturing collectives that pair up wrong.
"""
from __future__ import annotations

import datetime
import multiprocessing
import socket
import traceback
import zlib

import pytest
import torch
import torch.distributed as dist

from specserve.kv.pool import KVPool
from specserve.model.parallel.parallel_state import TensorParallelError, TensorParallelGroup, create_process_group
from specserve.runner.cuda_graph import batch_size_buckets, capture_plan
from specserve.runner.ranks.graph_steps import GraphStepHeader, announce_graph_step, replay_announced_step
from specserve.runner.tree_step import TreeStepInputs

VOCAB, VOCAB_PER_RANK, ROWS = 7, 4, 3          # the second shard's last column is padding
GRAPH = GraphStepHeader(key=(4, 2), batch_size=2, table_columns=5)
TABLE_ROWS = [3, 1]                            # the graph's real requests' req_to_token rows


def logits_shard(rank: int) -> torch.Tensor:
    """(ROWS, VOCAB_PER_RANK): rank r's columns of the (ROWS, 8) logits whose entry is 10 * row + column."""
    columns = torch.arange(rank * VOCAB_PER_RANK, (rank + 1) * VOCAB_PER_RANK)
    return (10 * torch.arange(ROWS).unsqueeze(1) + columns).float()


def rank_plan(rank: int) -> list[tuple[int, int]]:
    """Rank 1 as if started with another cuda_graph_max_bs."""
    return capture_plan(batch_size_buckets(64 if rank == 0 else 32), [1, 4])


def run_rank(rank: int, port: int, results, received) -> None:
    """Puts (rank, outputs or a traceback) on `results`, then stays alive until the parent has
    `received` every rank's: a tensor crosses a spawn Queue as a file descriptor that the
    parent can only open while the sender lives (an exited rank left ConnectionResetError)."""
    try:
        _run_rank(rank, port, results)
    finally:
        received.wait(120)


def _run_rank(rank: int, port: int, results) -> None:
    try:
        store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
        group = TensorParallelGroup(rank, 2, create_process_group(store, rank, 2, torch.device("cpu"), 60.0),
                                    torch.device("cpu"))
        out = {"all_gather": group.all_gather_vocab(logits_shard(rank), VOCAB),
               "all_gather_no_rows": group.all_gather_vocab(logits_shard(rank)[:0], VOCAB),
               "gather": group.gather_vocab(logits_shard(rank), VOCAB)}
        whole = torch.empty((2 * ROWS, VOCAB_PER_RANK)) if rank == 0 else None
        group.gather_rows_into(logits_shard(rank), whole)
        out["rows"] = whole
        out["graph"] = graph_step(group, rank)
        group.agree(zlib.crc32(repr(capture_plan(batch_size_buckets(64), [1, 4])).encode()), "the same plan")
        try:
            group.agree(zlib.crc32(repr(rank_plan(rank)).encode()), "the CUDA graphs to capture")
        except TensorParallelError as error:
            out["disagreement"] = str(error)
        results.put((rank, out))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def graph_step(group: TensorParallelGroup, rank: int) -> dict:
    """Rank 0 announces GRAPH from filled buffers; rank 1 replays it from empty ones. Returns
    what the replay saw (rank 1) or what was sent (rank 0)."""
    pool = KVPool(1, 1, 4, size=64, max_requests=4, max_context=8, dtype=torch.float32, device=torch.device("cpu"))
    inputs = TreeStepInputs.allocate(*GRAPH.key, "cpu")
    if rank == 0:
        inputs.packed.copy_(torch.arange(inputs.packed.numel()) + 100)
        inputs.req_rows.copy_(torch.tensor(TABLE_ROWS + [pool.scratch_row] * 2))
        pool.req_to_token.copy_(torch.arange(pool.req_to_token.numel()).view_as(pool.req_to_token))
        sent = []
        group.workers = type("Workers", (), {"send_step": staticmethod(sent.append)})()
        announce_graph_step(group, GRAPH, inputs.packed, inputs.req_rows, pool)
        return {"headers": sent, "packed": inputs.packed.clone(), "table": pool.req_to_token[TABLE_ROWS, :5].clone()}
    seen = {}

    def replay() -> None:
        seen["packed"] = inputs.packed.clone()
        seen["table"] = pool.req_to_token[TABLE_ROWS, :5].clone()
        table = pool.req_to_token
        seen["untouched"] = table[[0, 2], :].abs().sum().item() + table[:, 5:].abs().sum().item()

    replay_announced_step(group, GRAPH, inputs.packed, inputs.req_rows, pool, replay)
    return seen


@pytest.fixture(scope="module")
def ranks() -> dict[int, dict]:
    context = multiprocessing.get_context("spawn")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results, received = context.Queue(), context.Event()
    processes = [context.Process(target=run_rank, args=(rank, port, results, received), daemon=True)
                 for rank in range(2)]
    for process in processes:
        process.start()
    try:
        outcome = dict(results.get(timeout=120) for _ in processes)
    finally:
        received.set()
        for process in processes:
            process.join(10)
            if process.exitcode is None:
                process.kill()
                process.join(5)
    for rank, out in outcome.items():
        assert isinstance(out, dict), f"rank {rank} failed:\n{out}"
    return outcome


def test_vocabulary_all_gather_gives_every_rank_rank_0s_logits(ranks):
    expected = (10 * torch.arange(ROWS).unsqueeze(1) + torch.arange(VOCAB)).float()
    assert torch.equal(ranks[0]["gather"], expected) and ranks[1]["gather"] is None
    assert torch.equal(ranks[0]["all_gather"], expected) and torch.equal(ranks[1]["all_gather"], expected)


def test_a_step_that_samples_no_row_gathers_empty_logits(ranks):
    """A prefill step whose chunks end no prompt: (0, vocab) logits, not an error (H200 x2, the 1.5B)."""
    assert ranks[0]["all_gather_no_rows"].shape == (0, VOCAB) == ranks[1]["all_gather_no_rows"].shape


def test_vocabulary_rows_gather_whole_on_rank_0(ranks):
    assert torch.equal(ranks[0]["rows"], torch.cat([logits_shard(0), logits_shard(1)]))


def test_an_announced_graph_step_brings_rank_0s_inputs_and_table_rows_before_the_replay(ranks):
    sent, seen = ranks[0]["graph"], ranks[1]["graph"]
    assert sent["headers"] == [GRAPH]
    assert torch.equal(seen["packed"], sent["packed"]) and torch.equal(seen["table"], sent["table"].int())
    assert seen["untouched"] == 0   # only the step's rows and columns are written


def test_ranks_with_different_capture_plans_stop_with_the_reason(ranks):
    for rank in (0, 1):
        assert "the tensor-parallel ranks disagree on the CUDA graphs to capture" in ranks[rank]["disagreement"]
