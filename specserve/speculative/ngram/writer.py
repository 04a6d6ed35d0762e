"""TrieWriter: the n-gram trie's writes (indexing, releasing a stream) on one background thread.

Indexing costs ~2-5 us per token (a batch of 64 prompts of ~1000 tokens: ~200 ms), too
much for the engine's step loop, while the compiled trie's insert releases the GIL
(trie.py calls it through ctypes.CDLL): a thread that runs it runs truly in parallel
with the step loop, while the GPU computes and while the host does everything else.

Jobs run one at a time, in the order they were submitted. Readers call `drain()` first,
which waits until every job submitted so far is done, so what a reader sees does not depend
on timing (drafted trees equal between runs and between tensor-parallel ranks); `lock` is
held around every call into the trie by jobs and readers alike, so they never overlap.

A job that raises stops the writer: the trie may hold part of that job's tokens, so later
jobs are skipped and `drain()` / `check()` raise on the caller's thread, every time, naming
the original error (an EngineFatalError: the engine fails every request with it). Nothing waits forever: a closed writer refuses jobs and drains at once.

`TrieWriter(background=False)` runs each job at once on the caller's thread (the pure-Python
trie, which holds the GIL throughout: a thread would only add switching), and
`submit(job, inline=True)` runs a small job so where none is pending (the NGRAM drafter's
flushes of a few tokens: drafter.py).
"""
from __future__ import annotations

import threading
import weakref
from collections import deque
from typing import Callable

from specserve.errors import EngineFatalError

Job = Callable[[], None]
_STOP = object()
JOIN_TIMEOUT_S = 10.0   # close() waits this long for a job in progress (the longest: one chunk's insert)


class TrieWriterError(EngineFatalError):
    """A write into the n-gram trie failed on the writer thread (or the writer was closed).
    Fatal: every later proposal would fail too, so the engine fails all its requests at
    once instead of one by one."""


class TrieWriter:
    def __init__(self, background: bool = True, name: str = "ngram-trie-writer"):
        self.background = background
        self.lock = threading.Lock()       # around each call into the trie
        self._state = _WriterState()
        self._thread: threading.Thread | None = None
        if background:
            # The thread holds the state only, not the writer: a writer nobody closed is still
            # stopped when it is collected (the finalizer), and a daemon never keeps the process alive.
            self._thread = threading.Thread(target=self._state.work, name=name, daemon=True)
            self._thread.start()
            self._finalizer = weakref.finalize(self, self._state.stop)

    def submit(self, job: Job, inline: bool = False) -> None:
        """Runs `job` after every job submitted before it: at once without a thread, or
        with `inline` where no job is pending (a small job: handing it over costs more than
        it does); a failure then surfaces as one on the thread does (check)."""
        self.check()
        if self._thread is None:
            job()
        elif inline and self._state.unfinished == 0:   # read without the lock: 0 means the thread is idle
            self._state.run(job)
        else:
            self._state.put(job)

    def drain(self) -> None:
        """Waits until every job submitted so far is done; raises if one failed."""
        if self._thread is not None and self._state.unfinished:   # read without the lock: 0 means done
            self._state.wait_idle(self._thread)
        self.check()

    def check(self) -> None:
        """Raises, without waiting, if a job has failed or the writer is closed."""
        state = self._state
        if state.failure is not None:
            raise TrieWriterError(f"indexing into the n-gram trie failed on its writer thread: "
                                  f"{type(state.failure).__name__}: {state.failure}") from state.failure
        if state.closed:
            raise TrieWriterError("the n-gram trie's writer is closed (the drafter was closed)")

    @property
    def pending(self) -> int:
        """Jobs submitted and not done yet."""
        return self._state.unfinished

    def close(self) -> None:
        """Stops the thread once the job in progress is done (queued ones are dropped) and
        joins it. Idempotent."""
        if self._thread is None:
            self._state.closed = True
            return
        self._finalizer()   # stop(), once
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=JOIN_TIMEOUT_S)

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread


class _WriterState:
    """What the writer thread shares with the writer: the job queue and how it went."""

    def __init__(self):
        self.cond = threading.Condition()
        self.jobs: deque[object] = deque()
        self.unfinished = 0                  # jobs queued or running
        self.failure: BaseException | None = None
        self.closed = False

    def put(self, job: Job) -> None:
        with self.cond:
            if self.closed:
                raise TrieWriterError("the n-gram trie's writer is closed (the drafter was closed)")
            self.jobs.append(job)
            self.unfinished += 1
            self.cond.notify_all()

    def stop(self) -> None:
        with self.cond:
            self.closed = True
            self.unfinished -= len(self.jobs)   # dropped: nobody waits for them
            self.jobs.clear()
            self.jobs.append(_STOP)
            self.cond.notify_all()

    def wait_idle(self, thread: threading.Thread) -> None:
        with self.cond:
            while self.unfinished and not self.closed:
                # a timeout, so that a thread that died some other way cannot hang the caller
                self.cond.wait(timeout=1.0)
                if not thread.is_alive() and self.unfinished and self.failure is None:
                    self.failure = RuntimeError("the writer thread ended with jobs queued")
                    return

    def run(self, job: Job) -> None:
        """Runs a job, unless one failed before (the trie's state is then unknown); its
        failure surfaces on the caller's thread (check / drain)."""
        try:
            if self.failure is None:
                job()
        except BaseException as error:
            self.failure = error

    def work(self) -> None:
        while True:
            with self.cond:
                while not self.jobs:
                    self.cond.wait()
                job = self.jobs.popleft()
            if job is _STOP:
                return
            try:
                self.run(job)
            finally:
                with self.cond:
                    self.unfinished -= 1
                    self.cond.notify_all()
            job = None   # a job may hold the drafter: keep nothing alive while idle
