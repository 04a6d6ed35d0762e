"""Tokenizing many chats in a pool of processes (EAGLE training data: rendering and
tokenizing 9.5k ShareGPT prompts took 56 s on one core of an H100 machine, out of a 450 s
budget; rendering is Python, so threads would not help).

The chats are cut into contiguous chunks; a worker process runs a module-level function
over each chunk with its own copy of the tokenizer, and the chunks' lists come back in
order, concatenated: the same list as the function over all the chats in this process, for
a function that treats each chat on its own.

Workers are spawned, not forked: the parent has loaded torch (on a GPU, CUDA) and runs
threads whose locks a fork would copy while held. Spawning costs each worker a Python
start-up, the parent's main module (train_eagle: torch) and the tokenizer, sent once as
a pickled file (Qwen2.5's: 10 MB, 0.15 s to pickle and 0.35 s to load), about 2.5 s in
all, at once for every worker; so few chats, or one core, are tokenized here, serially.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from typing import Any

# from a pool's start to its first result (2 workers on this project's 2-core VM, Qwen2.5's
# tokenizer, train_eagle's imports: 2.5-2.6 s); the workers start at once, so one start
WORKER_START_SECONDS = 2.5
# a worker's share is at least this many chats (a 128-core machine does not start 128 for 300 chats)
MIN_CHATS_PER_WORKER = 32
# chats differ ten-fold in length: several chunks a worker keep every worker busy to the end
CHUNKS_PER_WORKER = 4

_worker_tokenizer: Any = None   # a worker process's copy, set by _load_tokenizer


def available_cores() -> int:
    """The cores this process may run on (a taskset or cpuset limits them below the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # macOS has no affinity
        return os.cpu_count() or 1


def pool_workers(num_chats: int, chat_seconds: float, cores: int | None = None) -> int:
    """Processes worth the work on num_chats chats of about chat_seconds each: one a core,
    or 1 (serial, no pool) with one core or where the workers would save less time than
    starting them takes."""
    cores = available_cores() if cores is None else cores
    workers = min(cores, num_chats // MIN_CHATS_PER_WORKER)
    if workers < 2:
        return 1
    saved_seconds = num_chats * chat_seconds * (1 - 1 / workers)
    return workers if saved_seconds > WORKER_START_SECONDS else 1


def run_in_chunks(function: Callable[..., list], chats: Sequence, tokenizer: Any, args: tuple,
                  workers: int) -> list:
    """function(chats, tokenizer, *args), computed as function(chunk, tokenizer, *args) over
    contiguous chunks of chats in `workers` processes (1: here), the chunks' lists
    concatenated in order. `function` must be importable by name (module level) and treat
    each chat on its own."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if workers == 1 or len(chats) < 2:
        return function(chats, tokenizer, *args)
    tokenizer_path = _pickle_to_file(tokenizer)
    pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_load_tokenizer, initargs=(tokenizer_path,))
    try:
        futures = [pool.submit(_run_chunk, function, chunk, args) for chunk in _chunks(chats, workers)]
        return [item for future in futures for item in future.result()]
    finally:
        # the caller goes on while the workers exit: an interpreter with torch and a tokenizer
        # takes 0.5-1.5 s to tear down, which a `with` block would wait for
        pool.shutdown(wait=False, cancel_futures=True)
        os.unlink(tokenizer_path)


def _chunks(chats: Sequence, workers: int) -> list[Sequence]:
    """Contiguous slices of about equal numbers of chats, in order."""
    count = min(len(chats), workers * CHUNKS_PER_WORKER)
    bounds = [len(chats) * i // count for i in range(count + 1)]
    return [chats[start:end] for start, end in zip(bounds, bounds[1:])]


def _pickle_to_file(tokenizer: Any) -> str:
    """The pickled tokenizer in a temporary file, for the workers to read. Not in the
    initializer's arguments: those travel with the process object, through a pipe the parent
    writes in full before it starts the next worker, and a worker reads it only after it has
    imported the main module, so a pipe's worth of arguments or more starts the workers one
    after another (4 workers with Qwen2.5's 10 MB: ready 2.6, 4.0, 5.2 and 6.6 s after the
    pool's start; from a file, all four at 5.0 s on 2 cores: on 16 cores, one start)."""
    handle, path = tempfile.mkstemp(prefix="specserve-tokenizer-", suffix=".pickle")
    with os.fdopen(handle, "wb") as file:
        pickle.dump(tokenizer, file, protocol=pickle.HIGHEST_PROTOCOL)
    return path


def _load_tokenizer(path: str) -> None:
    """A worker's start: its tokenizer, with the Rust tokenizer's own thread pool off (each
    worker is one process a core: the pool's threads would only oversubscribe the cores)."""
    global _worker_tokenizer
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        with open(path, "rb") as file:
            _worker_tokenizer = pickle.load(file)
    except FileNotFoundError:   # started after a chunk failed and run_in_chunks gave up: no chunk comes
        pass


def _run_chunk(function: Callable[..., list], chunk: Sequence, args: tuple) -> list:
    return function(chunk, _worker_tokenizer, *args)
