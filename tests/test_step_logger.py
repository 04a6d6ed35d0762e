"""The periodic log line reports the rate while the engine was busy: an idle spell before a
request does not dilute it (a stream at 14 tok/s is logged as 14 tok/s)."""
from __future__ import annotations

import logging
from types import SimpleNamespace

from specserve.engine import stats


class FakeScheduler:
    def __init__(self):
        self.running, self.waiting = [], []
        self.pool = SimpleNamespace(size=100, slots=SimpleNamespace(available=lambda: 75))
        self.busy = False

    def has_work(self) -> bool:
        return self.busy


def test_the_rate_leaves_idle_time_out(monkeypatch, caplog):
    clock = [0.0]
    monkeypatch.setattr(stats.time, "perf_counter", lambda: clock[0])
    logger, scheduler = stats.StepLogger(interval_s=5.0, speculative=False), FakeScheduler()
    clock[0] = 30.0           # 30 s idle, then a request: prefill (1 token) and 69 decode steps of 1/14 s
    scheduler.busy = True
    logger.count_tokens(1)
    clock[0] += 0.5
    with caplog.at_level(logging.INFO, logger="specserve"):
        logger.maybe_log(scheduler)
        for step in range(69):
            clock[0] += 1 / 14
            logger.count_tokens(1)
            scheduler.busy = step < 68
            logger.maybe_log(scheduler)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1, lines
    assert lines[0].startswith("generation: 14.0 tok/s") and "KV usage 25.0%" in lines[0]


def test_no_line_before_the_interval(monkeypatch, caplog):
    clock = [0.0]
    monkeypatch.setattr(stats.time, "perf_counter", lambda: clock[0])
    logger, scheduler = stats.StepLogger(interval_s=10.0, speculative=False), FakeScheduler()
    scheduler.busy = True
    with caplog.at_level(logging.INFO, logger="specserve"):
        for _ in range(50):
            clock[0] += 0.1
            logger.count_tokens(1)
            logger.maybe_log(scheduler)
    assert not caplog.records and logger.total_tokens == 50 and logger.total_steps == 50
