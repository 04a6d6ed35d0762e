"""MaskFiller: many matchers' next-token bitmasks filled at once, on threads kept for it.

A mask costs ~2 us at a JSON key, ~30 us between values and ~70-110 us inside a string with
a maxLength on a 151k vocabulary (one core), so 64 constrained requests cost ~2 ms a step on
one core: more than a 1.5B's forward at 64 hides. xgrammar's BatchGrammarMatcher spreads them
over threads, but builds its pool on every call (hardware_concurrency / 2 threads, started and
joined each step). Here the threads live as long as the process, each filling every k-th row
with a one-thread BatchGrammarMatcher (its loop in C++, the GIL released), and the caller may
go on meanwhile (`start`, then `wait`). Each row's bits are xgrammar's own fill of that
matcher, so the masks are the same as filled one by one.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

# masks a thread fills at least: fewer, and waking a thread costs more than it saves
MIN_ROWS_PER_THREAD = 4
# more threads than this gain little (64 masks of ~40 us: ~0.3 ms on 8) and take cores from
# the engine's other threads; SPECSERVE_MASK_THREADS sets the number
MAX_THREADS = 8


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not on Linux
        return os.cpu_count() or 1


def default_threads() -> int:
    """A core is left to the caller's thread, which goes on with Python while they fill (on 2
    cores, 2 threads beside it made the caller wait for a core: 0.5 ms a step at 64)."""
    given = os.environ.get("SPECSERVE_MASK_THREADS")
    return int(given) if given else max(1, min(MAX_THREADS, usable_cores() - 1))


class Filling:
    """Masks being filled: `wait` returns once every thread is done with the bitmask, and
    raises what a thread raised."""

    def __init__(self, futures: list[Future]):
        self.futures = futures

    def wait(self) -> None:
        wait(self.futures)
        for future in self.futures:
            future.result()


DONE = Filling([])


class MaskFiller:
    def __init__(self, threads: int | None = None):
        import xgrammar
        self.threads = max(1, threads if threads is not None else default_threads())
        # one per thread: a BatchGrammarMatcher of one thread keeps no state between calls,
        # but nothing promises that two threads may share one
        self._fillers = [xgrammar.BatchGrammarMatcher(max_threads=1) for _ in range(self.threads)]
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="grammar-mask")

    def start(self, matchers: list, out: torch.Tensor, rows: list[int]) -> Filling:
        """Row rows[i] of out (a host int32 tensor) gets matchers[i]'s next-token mask, on the
        threads: until `wait` returns, neither the matchers nor `out` may be touched."""
        parts = max(1, min(self.threads, len(rows) // MIN_ROWS_PER_THREAD))
        entered = threading.Semaphore(0)
        # every parts-th row to each thread: neighbouring rows are often alike in cost
        futures = [self._pool.submit(self._fill, k, entered, matchers[k::parts], out, rows[k::parts])
                   for k in range(parts)]
        # a thread needs the GIL to begin: waiting here (the GIL released) until each has
        # begun, rather than going on with Python, lets them fill beside the caller's Python
        # (without it they waited for the caller's next blocking call, as good as no thread)
        for _ in range(parts):
            entered.acquire()
        return Filling(futures)

    def _fill(self, k: int, entered: threading.Semaphore, matchers: list, out: torch.Tensor, rows: list[int]) -> None:
        entered.release()
        self._fillers[k].batch_fill_next_token_bitmask(matchers, out, rows)   # the GIL released inside
