"""A benchmark of specserve/bench run with the host's time per step split by phase: every
RunWatch it makes, and lab.step_cost's step loop, time their steps with HostPhases (where
a step's host time goes, and how long the host waited for the GPU), which the benchmarks
leave off: it wraps the device's waits and launches, which costs every step some time.

    python -m lab.suite_host_phases specserve.bench.gpu_suite --models-dir /root/models ...
    python -m lab.suite_host_phases specserve.bench.model_drafters --algorithm EAGLE3 ...
    python -m lab.suite_host_phases lab.step_cost --batch-sizes 1 --sizes 1 8

Each run's row then carries `host_us_per_step`: microseconds per step by kind and phase.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Iterator

from lab import step_cost
from lab.host_phases import HostPhases
from specserve.bench.run_watch import RunWatch


@contextlib.contextmanager
def host_phases_timed() -> Iterator[None]:
    """While open, every new RunWatch and step_cost's step loop time their steps' host phases."""
    before = RunWatch.phase_timer, step_cost.PHASE_TIMER
    RunWatch.phase_timer = step_cost.PHASE_TIMER = HostPhases
    try:
        yield
    finally:
        RunWatch.phase_timer, step_cost.PHASE_TIMER = before


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m lab.suite_host_phases MODULE [its flags]")
    module, *flags = argv
    with host_phases_timed():
        importlib.import_module(module).main(flags)


if __name__ == "__main__":
    main(sys.argv[1:])
