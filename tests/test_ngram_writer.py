"""The n-gram trie's writer thread (ngram_writer.py, NgramDrafter): writes run in the
background in order, a proposal sees exactly what was flushed before it (the same trees as
indexing on the caller's thread), a failed write surfaces on the caller's thread, and the
thread ends when the drafter or the engine is closed."""
from __future__ import annotations

import ctypes
import gc
import random
import threading
import time

import pytest

from specserve.speculative.ngram import drafter as ngram
from specserve.speculative.ngram.config import NgramConfig
from specserve.speculative.ngram.drafter import INLINE_WRITE_TOKENS, NgramDrafter
from specserve.speculative.ngram.trie import NgramTrie
from specserve.speculative.ngram.writer import TrieWriterError
from tests.test_spec_kv import fake_req

WRITER_NAME = "ngram-trie-writer"


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == WRITER_NAME]


def gated_inserts(drafter: NgramDrafter) -> threading.Event:
    """The drafter's inserts wait for the returned event (on the writer thread)."""
    gate, insert_many = threading.Event(), drafter.trie.insert_many

    def waiting(streams):
        assert gate.wait(timeout=30), "the test never opened the gate"
        insert_many(streams)
    drafter.trie.insert_many = waiting
    return gate


def proposals(drafter: NgramDrafter, reqs, limits) -> tuple[list, list, list, list]:
    trees, num_nodes = drafter.propose(reqs, limits)
    return trees.tokens.tolist(), trees.parents.tolist(), num_nodes, list(drafter.proposal_keys())


def test_the_compiled_insert_releases_the_gil_and_proposals_keep_it():
    trie = NgramTrie(NgramConfig(capacity=1000))
    assert not trie._insert_c._flags_ & ctypes._FUNCFLAG_PYTHONAPI     # CDLL: runs beside Python
    assert trie._propose_batch_c._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # PyDLL: no GIL round trip


@pytest.mark.parametrize("one_branch", [False, True])
def test_background_indexing_drafts_the_trees_of_synchronous_indexing(one_branch):
    """The same calls on two drafters, one indexing on its writer thread, one on the caller's:
    every proposal equal, node for node, through eviction (a small capacity) and prompts
    longer than a write chunk; the tries end up identical."""
    rng = random.Random(11)
    config = NgramConfig(capacity=3000, max_bfs_breadth=3, max_trie_depth=8)
    background, inline = NgramDrafter(config, one_branch, background=True), NgramDrafter(config, one_branch, background=False)
    assert background.writer.thread is not None and inline.writer.thread is None
    reqs = []
    for i in range(10):
        motif = [rng.randrange(30) for _ in range(rng.randrange(2, 7))]
        noise = [rng.randrange(30) for _ in range(rng.randrange(ngram.WRITE_BATCH_TOKENS))]   # new n-grams: evictions
        reqs.append(fake_req(f"r{i}", (motif * 700)[:rng.randrange(3, 2 * ngram.WRITE_BATCH_TOKENS)] + noise))
    drafted = 0
    for step in range(25):
        if step < len(reqs):
            for drafter in (background, inline):
                drafter.add_prompt(reqs[step])
        live = [r for r in reqs[:step + 1] if not getattr(r, "done", False)]
        if rng.random() < 0.7:
            for drafter in (background, inline):
                drafter.flush()
        limits = [rng.choice([1, 4, 8, 16]) for _ in live]
        got = proposals(background, live, limits)
        assert got == proposals(inline, live, limits), step
        drafted += sum(n > 1 for n in got[2])
        for req in live:
            committed = [rng.randrange(30) for _ in range(rng.randrange(1, 4))]
            req.output_ids.extend(committed)
            for drafter in (background, inline):
                drafter.observe(req, committed)
            if rng.random() < 0.08:
                req.done = True
                for drafter in (background, inline):
                    drafter.release(req)
    for drafter in (background, inline):
        drafter.flush()
        drafter.writer.drain()
    assert drafted > 20 and background.trie._epoch > 0, "meant to draft, and to evict (a small capacity)"
    assert background.trie._nodes() == inline.trie._nodes()
    assert background.trie._check() == 0
    background.close()


def test_flush_returns_while_the_writer_indexes_and_a_later_proposal_sees_the_prompt():
    drafter = NgramDrafter(NgramConfig(), one_branch=True)
    gate = gated_inserts(drafter)
    long_prompt = [100 + (i % 50) for i in range(4 * ngram.WRITE_BATCH_TOKENS)]
    drafter.add_prompt(fake_req("w", long_prompt))
    start = time.perf_counter()
    drafter.flush()
    assert time.perf_counter() - start < 1.0   # the inserts wait on the gate: flush did not
    assert drafter.writer.pending == 1         # handed over, not indexed yet
    gate.set()
    reader = fake_req("r", [1, 100, 101])
    trees, num_nodes = drafter.propose([reader], [5])   # waits for the writer: sees the whole prompt
    assert trees.tokens[0, :num_nodes[0]].tolist() == [101, 102, 103, 104, 105]
    assert drafter.writer.pending == 0
    drafter.close()


def test_probes_and_drafting_steps_are_put_off_while_a_large_backlog_is_indexed():
    drafter = NgramDrafter(NgramConfig(), one_branch=True)
    gate = gated_inserts(drafter)
    drafter.add_prompt(fake_req("small", list(range(10, 10 + ngram.PROBE_BACKLOG_TOKENS))))
    drafter.flush()
    assert drafter.ready_to_probe() and drafter.ready_to_draft()   # a backlog a probe may wait for
    drafter.add_prompt(fake_req("medium", list(range(20))))
    drafter.flush()
    assert not drafter.ready_to_probe()    # a probe waits for the writer to catch up ...
    assert drafter.ready_to_draft()        # ... a drafting step still drafts
    drafter.add_prompt(fake_req("large", list(range(30, 30 + ngram.DRAFT_BACKLOG_TOKENS))))
    drafter.flush()
    assert not drafter.ready_to_probe() and not drafter.ready_to_draft()
    gate.set()
    drafter.writer.drain()
    assert drafter.ready_to_probe() and drafter.ready_to_draft() and drafter._backlog == 0
    drafter.close()


def test_a_finished_requests_stream_goes_after_its_queued_tokens():
    drafter = NgramDrafter(NgramConfig(), one_branch=True)
    writer = fake_req("w", [5, 6, 7])
    drafter.add_prompt(writer)
    owner = drafter._owners["w"]
    drafter.observe(writer, [8, 9])
    drafter.release(writer)          # finished with tokens still queued: they continue its stream
    drafter.flush()
    drafter.writer.drain()
    assert owner not in drafter.trie._streams and not drafter._pending and not drafter._released
    trees, num_nodes = drafter.propose([fake_req("r", [1, 7])], [4])
    assert trees.tokens[0, :num_nodes[0]].tolist() == [7, 8, 9]   # indexed before the release
    drafter.close()


@pytest.mark.parametrize("prompt_length", [4, 2 * INLINE_WRITE_TOKENS])
def test_a_failed_write_surfaces_on_the_callers_thread_every_time(prompt_length):
    drafter = NgramDrafter(NgramConfig(), one_branch=False)

    def failing(streams):
        raise MemoryError("the n-gram trie is out of memory")
    drafter.trie.insert_many = failing
    req = fake_req("a", list(range(1, prompt_length + 1)))
    drafter.add_prompt(req)
    drafter.flush()                  # the failure happens inline or on the writer thread: no raise here
    with pytest.raises(TrieWriterError, match="MemoryError: the n-gram trie is out of memory") as raised:
        drafter.propose([req], [4])
    assert isinstance(raised.value.__cause__, MemoryError)
    drafter.observe(req, [5])
    with pytest.raises(TrieWriterError, match="MemoryError"):
        drafter.flush()
    with pytest.raises(TrieWriterError, match="MemoryError"):
        drafter.propose([req], [4])
    drafter.close()
    assert drafter.writer.thread not in threading.enumerate()


def test_close_joins_the_thread_and_a_closed_drafter_refuses_work():
    before = len(writer_threads())
    drafter = NgramDrafter(NgramConfig(), one_branch=False)
    assert drafter.writer.thread.daemon and len(writer_threads()) == before + 1
    drafter.add_prompt(fake_req("a", [1, 2, 3]))
    drafter.flush()
    drafter.close()
    drafter.close()                   # idempotent
    assert drafter.writer.thread not in threading.enumerate()
    drafter.add_prompt(fake_req("b", [4, 5]))
    with pytest.raises(TrieWriterError, match="closed"):
        drafter.flush()
    with pytest.raises(TrieWriterError, match="closed"):
        drafter.propose([fake_req("b", [4, 5])], [4])


def test_a_drafter_nobody_closed_stops_its_thread_when_collected():
    drafter = NgramDrafter(NgramConfig(), one_branch=False)
    drafter.add_prompt(fake_req("a", [1, 2, 3]))
    drafter.flush()
    drafter.writer.drain()
    thread = drafter.writer.thread
    del drafter
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_the_python_trie_indexes_at_flush_without_a_thread(monkeypatch):
    """The pure-Python trie holds the GIL throughout: its writes run at once on the caller's thread."""
    from specserve.speculative.ngram import trie as ngram_trie
    monkeypatch.setattr(ngram_trie, "compiled_trie_unavailable", lambda: "no compiler (test)")
    before = len(writer_threads())
    drafter = NgramDrafter(NgramConfig(), one_branch=True)
    assert drafter.writer.thread is None and len(writer_threads()) == before
    drafter.add_prompt(fake_req("w", [5, 6, 7, 8]))
    drafter.flush()
    assert drafter.writer.pending == 0
    trees, num_nodes = drafter.propose([fake_req("r", [40, 5, 6])], [4])
    assert trees.tokens[0, :num_nodes[0]].tolist() == [6, 7, 8]


def test_engine_shutdown_joins_the_writer_threads(engine_factory):
    from tests.spec_fixtures import ngram_args
    before = set(writer_threads())
    engine = engine_factory(max_total_tokens=2048, **ngram_args(8, adaptive=True))
    out = engine.generate("def add(a, b):\n    return a + b\n\ndef add(a, b):",
                          {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
    assert len(out["output_ids"]) == 12
    thread = engine.core.drafter.writer.thread
    assert thread.is_alive()
    engine.shutdown()
    gc.collect()   # the warm-up's scratch drafters stop when collected
    deadline = time.monotonic() + 10
    while set(writer_threads()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not thread.is_alive() and not set(writer_threads()) - before


def test_a_failed_write_fails_the_engines_requests_instead_of_hanging(engine_factory):
    from tests.spec_fixtures import ngram_args
    engine = engine_factory(max_total_tokens=2048, **ngram_args(8))

    def failing(streams):
        raise MemoryError("the n-gram trie is out of memory")
    engine.core.drafter.trie.insert_many = failing
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    with pytest.raises(RuntimeError, match="n-gram trie failed on its writer thread: MemoryError"):
        engine.generate("def add(a, b):", params)
    assert isinstance(engine.fatal_error, TrieWriterError)
    with pytest.raises(RuntimeError):   # the engine stopped: refused, not left waiting
        engine.generate("def sub(a, b):", params)
    engine.shutdown()
    assert not engine.core.drafter.writer.thread.is_alive()


def test_committed_tokens_reach_the_writer_once_enough_are_queued():
    """Plain steps that do not probe do not flush; observe hands the queue over itself once
    AUTO_FLUSH_TOKENS committed tokens wait, so a later probe does not wait for thousands."""
    drafter = NgramDrafter(NgramConfig(capacity=10_000), one_branch=True, background=True)
    try:
        req = fake_req("a", [1, 2, 3])
        drafter.add_prompt(req)
        drafter.flush()
        gate = gated_inserts(drafter)
        for _ in range(ngram.AUTO_FLUSH_TOKENS // 4 - 1):
            drafter.observe(req, [7, 8, 9, 10])
        assert drafter._pending                       # below the threshold: still queued here
        drafter.observe(req, [7, 8, 9, 10])
        assert not drafter._pending                   # handed to the writer without a flush
        gate.set()
        drafter.writer.drain()
    finally:
        drafter.close()


def test_insert_many_indexes_as_inserts_one_by_one_in_one_call_without_the_gil():
    """The writer's batched insert: the same trie as a call per stream, through eviction and
    streams continued across calls, and through CDLL (it runs beside Python)."""
    rng = random.Random(5)
    config = NgramConfig(capacity=2000, max_trie_depth=8)
    one_by_one, batched = NgramTrie(config), NgramTrie(config)
    assert not batched._insert_many_c._flags_ & ctypes._FUNCFLAG_PYTHONAPI
    for _ in range(6):
        streams = [(rng.choice([None, 1, 2, 3]), [rng.randrange(40) for _ in range(rng.randrange(0, 300))])
                   for _ in range(rng.randrange(1, 8))]
        for owner, tokens in streams:
            one_by_one.insert(tokens, owner)
        batched.insert_many(streams)
    assert batched._epoch > 0, "meant to evict (a small capacity)"
    assert batched._nodes() == one_by_one._nodes() and batched._check() == 0
    assert batched.propose([3, 4], 8, False, owner=2) == one_by_one.propose([3, 4], 8, False, owner=2)


def test_a_flush_of_many_streams_reaches_the_trie_in_few_calls_in_order():
    """A plain step's flush at batch 64 (a few tokens per request) is one trie call, not one
    per request: each call hands the GIL back to the writer, which the step loop waits for.
    A long prompt goes in pieces of at most WRITE_BATCH_TOKENS, in order."""
    drafter = NgramDrafter(NgramConfig(), one_branch=False)
    calls, insert_many = [], drafter.trie.insert_many
    drafter.trie.insert_many = lambda streams: (calls.append([(o, list(t)) for o, t in streams]), insert_many(streams))
    reqs = [fake_req(f"r{i}", [i, i + 1]) for i in range(64)]
    long_prompt = [7 + i % 90 for i in range(2 * ngram.WRITE_BATCH_TOKENS + 10)]
    for req in reqs:
        drafter.observe(req, [1, 2, 3])
    drafter.flush()
    drafter.writer.drain()
    assert len(calls) == 1 and len(calls[0]) == 64
    calls.clear()
    drafter.add_prompt(fake_req("long", long_prompt))
    drafter.observe(reqs[0], [4])
    drafter.flush()
    drafter.writer.drain()
    assert [sum(len(t) for _, t in call) for call in calls] == [ngram.WRITE_BATCH_TOKENS, ngram.WRITE_BATCH_TOKENS, 11]
    assert [t for call in calls for o, t in call if o == drafter._owners["long"]] == [
        long_prompt[:ngram.WRITE_BATCH_TOKENS], long_prompt[ngram.WRITE_BATCH_TOKENS:-10], long_prompt[-10:]]
    assert drafter._backlog == 0
    drafter.close()


def test_a_small_flush_is_indexed_on_the_callers_thread_when_the_writer_is_idle():
    """A few tokens (a batch-1 drafting step's) are indexed at once, without a hand-over to
    the writer; more tokens, or a flush behind a job still pending, go to the thread, in order."""
    drafter = NgramDrafter(NgramConfig(), one_branch=False)
    threads = []
    insert = drafter.trie.insert_many

    def recording(streams):
        threads.append(threading.current_thread())
        insert(streams)
    drafter.trie.insert_many = recording
    req = fake_req("a", [1, 2, 3, 4])
    drafter.add_prompt(req)
    drafter.flush()
    assert threads == [threading.current_thread()] and drafter.writer.pending == 0
    drafter.add_prompt(fake_req("b", list(range(100, 100 + 2 * INLINE_WRITE_TOKENS))))
    release = threading.Event()
    drafter.writer.submit(release.wait)                 # the writer is busy with a job
    drafter.flush()
    drafter.observe(req, [5, 6])
    drafter.flush()                                      # small, but behind pending jobs
    assert threads == [threading.current_thread()] and drafter.writer.pending == 3
    release.set()
    drafter.writer.drain()
    assert threads[1:] == [drafter.writer.thread] * 2
    trees, num_nodes = drafter.propose([fake_req("r", [9, 4])], [4])
    assert trees.tokens[0, :num_nodes[0]].tolist() == [4, 5, 6]
    drafter.close()
