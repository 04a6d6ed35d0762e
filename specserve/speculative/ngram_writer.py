"""TrieWriter: the n-gram trie's writes (indexing, releasing a stream), off the step loop.

Indexing costs ~2-5 us per token (a batch of 64 prompts of ~1000 tokens: ~200 ms), too
much for the engine's step loop. With the compiled trie the writes run on a thread of the
C library's own (ngram_trie.c, `ngt_writer_*`), which never takes Python's GIL: the step
loop only copies the tokens into a queued job. A Python thread did this before (session 31,
BENCHMARKS.md): between its C calls it held the GIL, and on a busy host, preempted while it
held it, it stopped the step loop for a scheduler slice: an engine that indexed but never
drafted ran at 0.54-0.81x of plain on chat at 64 there, where one indexing nothing ran at
0.95-0.98x.

Jobs run one at a time, in the order they were submitted. Readers call `drain()` first,
which waits until every job submitted so far is done, so what a reader sees does not depend
on timing (drafted trees equal between runs and between tensor-parallel ranks), and the
writer is idle while they read.

A job that fails stops the writer: the trie may hold part of that job's tokens, so later
jobs are dropped and `drain()` / `submit()` / `check()` raise on the caller's thread, every
time, naming the original error (an EngineFatalError: the engine fails every request with
it). Nothing waits forever: a closed writer refuses jobs.

Without the compiled trie (no C compiler) each job runs at once on the caller's thread: the
pure-Python trie holds the GIL throughout, so a thread would only add switching.
"""
from __future__ import annotations

from typing import Sequence

from specserve.errors import EngineFatalError

Streams = Sequence[tuple[int, Sequence[int]]]


class TrieWriterError(EngineFatalError):
    """A write into the n-gram trie failed on the writer thread (or the writer was closed).
    Fatal: every later proposal would fail too, so the engine fails all its requests at
    once instead of one by one."""


class TrieWriter:
    def __init__(self, trie, background: bool = True):
        """background: the C trie's writer thread (a trie without one writes at once)."""
        self.trie = trie
        self.background = background and hasattr(trie, "start_writer")
        self._failure: BaseException | None = None
        self._closed = False
        if self.background:
            trie.start_writer()   # a writer nobody closed stops with its trie (ngt_free joins it)

    def submit(self, streams: Streams, released: Sequence[int]) -> None:
        """Indexes `streams` ((owner, tokens) in order), then lets the released owners'
        streams go: after every job submitted before, on the writer thread (at once without)."""
        self.check()
        if not self.background:
            if streams:
                self.trie.insert_many(streams)
            for owner in released:
                self.trie.release(owner)
            return
        self._guarded(lambda: self.trie.submit(streams, released))

    def drain(self) -> None:
        """Waits until every job submitted so far is done; raises if one failed."""
        self.check()
        if self.background:
            self._guarded(self.trie.drain)

    def check(self) -> None:
        """Raises, without waiting, if a job has failed or the writer is closed."""
        if self._failure is not None:
            raise TrieWriterError(f"indexing into the n-gram trie failed on its writer thread: "
                                  f"{type(self._failure).__name__}: {self._failure}") from self._failure
        if self._closed:
            raise TrieWriterError("the n-gram trie's writer is closed (the drafter was closed)")

    @property
    def pending(self) -> int:
        """Jobs submitted and not done yet."""
        return self.trie.pending_jobs() if self.background and not self._closed else 0

    @property
    def backlog(self) -> int:
        """Tokens submitted and not indexed yet."""
        return self.trie.backlog() if self.background and not self._closed else 0

    def close(self) -> None:
        """Stops the thread once the job in progress is done (queued ones are dropped) and
        joins it. Idempotent."""
        if not self._closed and self.background:
            self.trie.stop_writer()
        self._closed = True

    def _guarded(self, call) -> None:
        try:
            call()
        except (MemoryError, ValueError) as error:   # the C trie's codes, from a job
            self._failure = error
            self.check()

