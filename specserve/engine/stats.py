"""Periodic engine log line: throughput, queue, KV usage and, when speculating, accept length."""
from __future__ import annotations

import logging
import time

logger = logging.getLogger("specserve")


class StepLogger:
    def __init__(self, interval_s: float, speculative: bool):
        self.interval_s = interval_s
        self.speculative = speculative
        self.total_tokens = 0
        self.total_steps = 0
        self._window_tokens = 0
        self._window_steps = 0
        self._window_start = time.perf_counter()

    def count_tokens(self, n: int) -> None:
        self.total_tokens += n
        self._window_tokens += n

    def maybe_log(self, scheduler) -> None:
        self.total_steps += 1
        self._window_steps += 1
        now = time.perf_counter()
        elapsed = now - self._window_start
        if elapsed < self.interval_s:
            return
        pool = scheduler.pool
        used = 1.0 - pool.slots.available() / pool.size
        line = (f"decode: {self._window_tokens / elapsed:.1f} tok/s, running {len(scheduler.running)}, "
                f"queued {len(scheduler.waiting)}, KV usage {used:.1%}")
        if self.speculative:
            accept = [r.spec.accept_length for r in scheduler.running if r.spec.verify_steps]
            if accept:
                line += f", accept length {sum(accept) / len(accept):.2f}"
        logger.info(line)
        self._window_tokens = self._window_steps = 0
        self._window_start = now
