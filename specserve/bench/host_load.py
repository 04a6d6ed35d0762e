"""A busy host for benchmarks: busy-loop processes beside the engine under test.

Serving hosts are shared (several GPUs' servers, tokenizers, clients on one machine), and a
thread that takes the GIL back at the wrong moment costs the step loop far more there than
on an idle host: an engine that only indexed n-grams on a Python writer thread ran at
0.54-0.81x of plain on a busy 4-GPU host and at 1.0x alone. With `--host-load N` the suite
measures that condition on purpose, not by chance.
"""
from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

BUSY_LOOP = "while True: pass"


@contextlib.contextmanager
def busy_host(processes: int) -> Iterator[list[subprocess.Popen]]:
    """`processes` busy-loop Python processes for the block's duration, killed after it."""
    if processes < 0:
        raise ValueError(f"host load: a number of processes >= 0, not {processes}")
    started: list[subprocess.Popen] = []
    try:
        for _ in range(processes):
            started.append(subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        yield started
    finally:
        for process in started:
            process.kill()
        for process in started:
            process.wait()
