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

from specserve.speculative import ngram
from specserve.speculative.ngram import NgramDrafter
from specserve.speculative.ngram_config import NgramConfig
from specserve.speculative.ngram_trie import NgramTrie
from specserve.speculative.ngram_writer import TrieWriterError
from tests.test_spec_kv import fake_req

WRITER_NAME = "ngram-trie-writer"


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == WRITER_NAME]


def gated_inserts(drafter: NgramDrafter) -> threading.Event:
    """The drafter's inserts wait for the returned event (on the writer thread)."""
    gate, insert = threading.Event(), drafter.trie.insert

    def waiting(tokens, owner=None):
        assert gate.wait(timeout=30), "the test never opened the gate"
        insert(tokens, owner)
    drafter.trie.insert = waiting
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
        noise = [rng.randrange(30) for _ in range(rng.randrange(ngram.WRITE_CHUNK))]   # new n-grams: evictions
        reqs.append(fake_req(f"r{i}", (motif * 200)[:rng.randrange(3, 2 * ngram.WRITE_CHUNK)] + noise))
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
    long_prompt = [100 + (i % 50) for i in range(4 * ngram.WRITE_CHUNK)]
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


def test_probes_are_put_off_while_a_large_backlog_is_indexed():
    drafter = NgramDrafter(NgramConfig(), one_branch=True)
    gate = gated_inserts(drafter)
    drafter.add_prompt(fake_req("small", list(range(10, 10 + ngram.PROBE_BACKLOG_TOKENS))))
    drafter.flush()
    assert drafter.ready_to_probe()        # a backlog a probe may wait for
    drafter.add_prompt(fake_req("large", list(range(20))))
    drafter.flush()
    assert not drafter.ready_to_probe()    # over the limit until the writer catches up
    gate.set()
    drafter.writer.drain()
    assert drafter.ready_to_probe() and drafter._backlog == 0
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


def test_a_failed_write_surfaces_on_the_callers_thread_every_time():
    drafter = NgramDrafter(NgramConfig(), one_branch=False)

    def failing(tokens, owner=None):
        raise MemoryError("the n-gram trie is out of memory")
    drafter.trie.insert = failing
    req = fake_req("a", [1, 2, 3, 4])
    drafter.add_prompt(req)
    drafter.flush()                  # the failure happens on the writer thread
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
    from specserve.speculative import ngram_trie
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

    def failing(tokens, owner=None):
        raise MemoryError("the n-gram trie is out of memory")
    engine.core.drafter.trie.insert = failing
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
