"""The n-gram trie's writer thread (the C trie's own, ngram_writer.py, NgramDrafter): writes
run in the background in order, a proposal sees exactly what was flushed before it (the same
trees as indexing on the caller's thread), a failed write surfaces on the caller's thread, and
the thread ends when the drafter or the engine is closed."""
from __future__ import annotations

import ctypes
import gc
import os
import random
import time

import pytest

from specserve.speculative import ngram
from specserve.speculative.ngram import NgramDrafter
from specserve.speculative.ngram_config import NgramConfig
from specserve.speculative.ngram_trie import NgramTrie
from specserve.speculative.ngram_writer import TrieWriterError
from tests.test_spec_kv import fake_req

LONG = 1024   # tokens: longer than the writer's backlog step


def os_threads() -> int:
    """This process's threads, C ones included (the writer is not a Python thread)."""
    return len(os.listdir("/proc/self/task"))


def failing_slots(trie) -> None:
    """Every stream the trie is handed from now on names a slot that does not exist: the
    writer thread's insert fails (the C trie's 'bad argument')."""
    trie._slot = lambda owner: 1 << 20


def proposals(drafter: NgramDrafter, reqs, limits) -> tuple[list, list, list, list]:
    trees, num_nodes = drafter.propose(reqs, limits)
    return trees.tokens.tolist(), trees.parents.tolist(), num_nodes, list(drafter.proposal_keys())


def test_waiting_for_the_writer_releases_the_gil_and_proposals_keep_it():
    trie = NgramTrie(NgramConfig(capacity=1000))
    trie.start_writer()
    assert not trie._drain_c._flags_ & ctypes._FUNCFLAG_PYTHONAPI      # CDLL: the writer may finish meanwhile
    assert not trie._insert_c._flags_ & ctypes._FUNCFLAG_PYTHONAPI     # CDLL: runs beside Python
    assert trie._propose_batch_c._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # PyDLL: no GIL round trip
    trie.stop_writer()


@pytest.mark.parametrize("one_branch", [False, True])
def test_background_indexing_drafts_the_trees_of_synchronous_indexing(one_branch):
    """The same calls on two drafters, one indexing on its writer thread, one on the caller's:
    every proposal equal, node for node, through eviction (a small capacity) and prompts
    longer than a write chunk; the tries end up identical."""
    rng = random.Random(11)
    config = NgramConfig(capacity=3000, max_bfs_breadth=3, max_trie_depth=8)
    background, inline = NgramDrafter(config, one_branch, background=True), NgramDrafter(config, one_branch, background=False)
    assert background.writer.background and not inline.writer.background
    reqs = []
    for i in range(10):
        motif = [rng.randrange(30) for _ in range(rng.randrange(2, 7))]
        noise = [rng.randrange(30) for _ in range(rng.randrange(LONG))]   # new n-grams: evictions
        reqs.append(fake_req(f"r{i}", (motif * 700)[:rng.randrange(3, 2 * LONG)] + noise))
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
    drafter.trie.pause_writer(True)
    long_prompt = [100 + (i % 50) for i in range(4 * LONG)]
    drafter.add_prompt(fake_req("w", long_prompt))
    start = time.perf_counter()
    drafter.flush()
    assert time.perf_counter() - start < 1.0   # the writer is held back: flush did not wait for it
    assert drafter.writer.pending == 1 and drafter.writer.backlog == len(long_prompt)   # handed over, not indexed
    drafter.trie.pause_writer(False)
    reader = fake_req("r", [1, 100, 101])
    trees, num_nodes = drafter.propose([reader], [5])   # waits for the writer: sees the whole prompt
    assert trees.tokens[0, :num_nodes[0]].tolist() == [101, 102, 103, 104, 105]
    assert drafter.writer.pending == 0
    drafter.close()


def test_probes_and_drafting_steps_are_put_off_while_a_large_backlog_is_indexed():
    drafter = NgramDrafter(NgramConfig(), one_branch=True)
    drafter.trie.pause_writer(True)
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
    drafter.trie.pause_writer(False)
    drafter.writer.drain()
    assert drafter.ready_to_probe() and drafter.ready_to_draft() and drafter.writer.backlog == 0
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
    failing_slots(drafter.trie)
    req = fake_req("a", [1, 2, 3, 4])
    drafter.add_prompt(req)
    drafter.flush()                  # the failure happens on the writer thread
    with pytest.raises(TrieWriterError, match="ValueError: the n-gram trie rejected an argument") as raised:
        drafter.propose([req], [4])
    assert isinstance(raised.value.__cause__, ValueError)
    drafter.observe(req, [5])
    with pytest.raises(TrieWriterError, match="ValueError"):
        drafter.flush()
    with pytest.raises(TrieWriterError, match="ValueError"):
        drafter.propose([req], [4])
    drafter.close()


def test_jobs_after_a_failed_one_are_dropped_and_the_writer_says_so_on_submit():
    trie = NgramTrie(NgramConfig())
    trie.start_writer()
    trie.pause_writer(True)
    trie.submit([(None, [1, 2, 3])], [])
    real_slot = trie._slot
    failing_slots(trie)
    trie.submit([(7, [4, 5])], [])
    trie._slot = real_slot
    trie.submit([(None, [6, 7, 8])], [])
    trie.pause_writer(False)
    with pytest.raises(ValueError):
        trie.drain()
    with pytest.raises(ValueError):
        trie.submit([(None, [9])], [])
    assert trie.backlog() == 0 and trie._nodes() == _indexed([1, 2, 3])._nodes()   # the first job only
    trie.stop_writer()


def test_close_joins_the_thread_and_a_closed_drafter_refuses_work():
    before = os_threads()
    drafter = NgramDrafter(NgramConfig(), one_branch=False)
    assert os_threads() == before + 1
    drafter.add_prompt(fake_req("a", [1, 2, 3]))
    drafter.flush()
    drafter.close()
    drafter.close()                   # idempotent
    assert os_threads() == before
    drafter.add_prompt(fake_req("b", [4, 5]))
    with pytest.raises(TrieWriterError, match="closed"):
        drafter.flush()
    with pytest.raises(TrieWriterError, match="closed"):
        drafter.propose([fake_req("b", [4, 5])], [4])


def test_a_drafter_nobody_closed_stops_its_thread_when_collected():
    before = os_threads()
    drafter = NgramDrafter(NgramConfig(), one_branch=False)
    drafter.add_prompt(fake_req("a", [1, 2, 3]))
    drafter.flush()
    assert os_threads() == before + 1
    del drafter
    gc.collect()
    assert os_threads() == before


def test_the_python_trie_indexes_at_flush_without_a_thread(monkeypatch):
    """The pure-Python trie holds the GIL throughout: its writes run at once on the caller's thread."""
    from specserve.speculative import ngram_trie
    monkeypatch.setattr(ngram_trie, "compiled_trie_unavailable", lambda: "no compiler (test)")
    before = os_threads()
    drafter = NgramDrafter(NgramConfig(), one_branch=True)
    assert not drafter.writer.background and os_threads() == before
    drafter.add_prompt(fake_req("w", [5, 6, 7, 8]))
    drafter.flush()
    assert drafter.writer.pending == 0
    trees, num_nodes = drafter.propose([fake_req("r", [40, 5, 6])], [4])
    assert trees.tokens[0, :num_nodes[0]].tolist() == [6, 7, 8]


def test_engine_shutdown_joins_the_writer_threads(engine_factory):
    from tests.spec_fixtures import ngram_args
    engine = engine_factory(max_total_tokens=2048, **ngram_args(8, adaptive=True))
    out = engine.generate("def add(a, b):\n    return a + b\n\ndef add(a, b):",
                          {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True})
    assert len(out["output_ids"]) == 12
    writer = engine.core.drafter.writer
    assert writer.background and not writer._closed
    with_writer = os_threads()
    engine.shutdown()
    gc.collect()   # the warm-up's scratch drafters stop when collected
    assert writer._closed and os_threads() < with_writer


def test_a_failed_write_fails_the_engines_requests_instead_of_hanging(engine_factory):
    from tests.spec_fixtures import ngram_args
    engine = engine_factory(max_total_tokens=2048, **ngram_args(8))
    failing_slots(engine.core.drafter.trie)
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    with pytest.raises(RuntimeError, match="n-gram trie failed on its writer thread: ValueError"):
        engine.generate("def add(a, b):", params)
    assert isinstance(engine.fatal_error, TrieWriterError)
    with pytest.raises(RuntimeError):   # the engine stopped: refused, not left waiting
        engine.generate("def sub(a, b):", params)
    engine.shutdown()
    assert engine.core.drafter.writer._closed


def test_committed_tokens_reach_the_writer_once_enough_are_queued():
    """Plain steps that do not probe do not flush; observe hands the queue over itself once
    AUTO_FLUSH_TOKENS committed tokens wait, so a later probe does not wait for thousands."""
    drafter = NgramDrafter(NgramConfig(capacity=10_000), one_branch=True, background=True)
    try:
        req = fake_req("a", [1, 2, 3])
        drafter.add_prompt(req)
        drafter.flush()
        drafter.writer.drain()
        drafter.trie.pause_writer(True)
        for _ in range(ngram.AUTO_FLUSH_TOKENS // 4 - 1):
            drafter.observe(req, [7, 8, 9, 10])
        assert drafter._pending                       # below the threshold: still queued here
        drafter.observe(req, [7, 8, 9, 10])
        assert not drafter._pending and drafter.writer.backlog == ngram.AUTO_FLUSH_TOKENS   # handed over, no flush
        drafter.trie.pause_writer(False)
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


def test_a_flush_is_one_job_of_every_stream_then_the_released_ones():
    """A plain step's flush at batch 64 (a few tokens per request) and the streams finished
    meanwhile: one job, one copy of the tokens, in order; the releases after the tokens."""
    drafter = NgramDrafter(NgramConfig(), one_branch=False)
    reqs = [fake_req(f"r{i}", [i, i + 1]) for i in range(64)]
    for req in reqs:
        drafter.observe(req, [1, 2, 3])
    drafter.release(reqs[0])
    drafter.trie.pause_writer(True)
    drafter.flush()
    assert drafter.writer.pending == 1 and drafter.writer.backlog == 64 * 3
    drafter.trie.pause_writer(False)
    drafter.writer.drain()
    assert drafter.writer.backlog == 0 and len(drafter.trie._streams) == 63
    drafter.close()


def _indexed(tokens: list[int]) -> NgramTrie:
    trie = NgramTrie(NgramConfig())
    trie.insert(tokens)
    return trie
