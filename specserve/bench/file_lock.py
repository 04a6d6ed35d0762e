"""An exclusive lock on a file, across processes: benchmark jobs that run side by side on one
machine's GPUs (scripts/gpu_parallel.sh) share what the first of them builds there (an HF
model directory converted from a GGUF file, a peer's installed wheels), and two writers at
once would each find the other's half-written files."""
from __future__ import annotations

import contextlib
import fcntl
import os


@contextlib.contextmanager
def exclusive(path: str):
    """Holds `path + '.lock'` (made where missing) until the block ends: a second process
    waits here until the first has finished and can then read what it built."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
