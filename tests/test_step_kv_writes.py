"""A decode or verify step commits the KV slots of every request with at most one host
req_to_token write (not one per request; a greedy verify step writes the accepted path on
the device, inside its forward), and the table then holds exactly each request's slots: checked after
every decode step of NGRAM engines (multi-branch and one-branch trees, where drafts are
accepted and rejected) and of a plain engine, with greedy output equal to plain decoding.

Engines run a random-weight tiny model (fast); each batch runs twice, so the second run
drafts from the first's output and accepts long paths.
"""
from __future__ import annotations

import pytest

from specserve.engine.step_events import StepListener
from tests.spec_fixtures import (make_tiny_directory, ngram_args, plain_greedy_outputs, tiny_engine,
                                 wait_until_all_kv_is_free)

PROMPTS = [
    [5, 6, 7, 8, 9] * 6 + [10, 11],
    [20, 21, 22, 23] * 5 + [20, 21],
    list(range(30, 60)) + list(range(30, 42)),
    [40, 41, 40, 42, 40, 43, 40, 41],
    [200, 201, 202] * 8,
]
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-step-kv")
    make_tiny_directory(path, "llama", seed=3)
    return path


@pytest.fixture(scope="module")
def plain_outputs(model_dir) -> list[list[int]]:
    return plain_greedy_outputs(model_dir, PROMPTS, GREEDY)


class TableWriteSpy(StepListener):
    """In the engine's thread: counts the writes into req_to_token per decode step and, after each step, compares every running request's table row with
    its slot list."""

    def __init__(self, core):
        self.core, pool = core, core.runner.pool
        self.writes_per_step: list[int] = []
        self.batch_sizes: list[int] = []
        self.mismatches: list[str] = []
        self._writes = 0
        self._decoding: int | None = None   # the batch size of the decode step in progress
        pool.write_entries_async = self._counting(pool.write_entries_async)  # the scheduler's only table write
        core.events.add(self)

    def step_scheduled(self, batch):
        self._decoding = None if batch.is_extend else len(batch.reqs)
        self._writes = 0

    def step_committed(self, outputs):
        if self._decoding is not None:
            self.writes_per_step.append(self._writes)
            self.batch_sizes.append(self._decoding)
            self._check_table()
            self._decoding = None

    def _counting(self, method):
        def counted(*args, **kwargs):
            self._writes += 1
            return method(*args, **kwargs)
        return counted

    def _check_table(self) -> None:
        table = self.core.runner.pool.req_to_token
        for req in self.core.scheduler.running:
            if req.row is not None and table[req.row, :req.kv_len].tolist() != req.kv_slots:
                self.mismatches.append(f"{req.rid} at kv_len {req.kv_len}")


@pytest.mark.parametrize("speculation", [ngram_args(8), ngram_args(4, one_branch=True), {}],
                         ids=["ngram-8-multi", "ngram-4-one", "plain"])
def test_one_table_write_per_decode_step(model_dir, plain_outputs, speculation):
    with tiny_engine(model_dir, **speculation, max_total_tokens=4096) as engine:
        spy = TableWriteSpy(engine.core)
        histogram: dict[int, int] = {}
        for _ in range(2):
            outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
            assert [o["output_ids"] for o in outputs] == plain_outputs
            for out in outputs:
                for length, count in out["meta_info"].get("spec_accept_histogram", {}).items():
                    histogram[length] = histogram.get(length, 0) + count
        wait_until_all_kv_is_free(engine)
    assert spy.mismatches == []
    assert max(spy.batch_sizes) == len(PROMPTS)          # batched steps were checked
    assert set(spy.writes_per_step) <= {0, 1}           # never one write per request
    if speculation:
        assert 0 in spy.writes_per_step                  # greedy verify steps: written on the device
        assert max(histogram) >= 3 and 1 in histogram    # paths accepted, and drafts rejected
