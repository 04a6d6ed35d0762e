"""KV cache accounting: every slot and every req_to_token row comes back once requests are done,
however they end (finish, abort while queued or running, preemption, errors), plus unit tests
of the allocator and the pool."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from specserve.bench.prompts import SAMPLE_PROMPTS

from specserve.kv.pool import PADDING_SLOT, KVPool, SlotAllocator

GREEDY = {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}
PROMPTS = SAMPLE_PROMPTS
SMALL_CACHE = 160


# ---- unit tests: SlotAllocator and KVPool ----
def test_slot_allocator_hands_out_each_slot_once():
    slots = SlotAllocator(10)
    assert slots.available() == 10
    first = slots.alloc(3)
    assert first == [1, 2, 3]                        # low slots first; slot 0 is the padding slot
    assert slots.alloc(0) == []
    assert slots.alloc(8) is None                    # only 7 left: refuse, take nothing
    assert slots.available() == 7
    rest = slots.alloc(7)
    assert sorted(first + rest) == list(range(1, 11)) and PADDING_SLOT not in first + rest
    assert slots.available() == 0 and slots.alloc(1) is None
    slots.free(first)
    assert slots.available() == 3
    assert sorted(slots.alloc(3)) == first           # freed slots are reused
    slots.free(first)
    slots.free(rest)
    assert slots.available() == 10
    assert sorted(slots.alloc(10)) == list(range(1, 11))


def test_kv_pool_rows_buffers_and_store():
    pool = KVPool(num_layers=2, num_kv_heads=2, head_dim=4, size=16, max_requests=3, max_context=8,
                  dtype=torch.float32, device=torch.device("cpu"))
    assert pool.size == 16 and pool.slots.available() == 16
    assert [tuple(b.shape) for b in pool.k_buffers + pool.v_buffers] == [(17, 2, 4)] * 4
    assert tuple(pool.req_to_token.shape) == (4, 8) and pool.scratch_row == 3   # one row no request gets
    assert KVPool.bytes_per_token(2, 2, 4, torch.float32) == 2 * 2 * 2 * 4 * 4
    assert pool.free_rows() == 3
    rows = [pool.alloc_row() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2] and pool.free_rows() == 0
    assert pool.alloc_row() is None
    pool.free_row(rows[1])
    assert pool.free_rows() == 1 and pool.alloc_row() == rows[1]
    slots = pool.slots.alloc(3)
    pool.write_positions(rows[0], 2, torch.tensor(slots, dtype=torch.int32))
    assert pool.req_to_token[rows[0], 2:5].tolist() == slots
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    pool.store(1, torch.tensor(slots), k, v)
    assert torch.equal(pool.k_buffers[1][slots], k) and torch.equal(pool.v_buffers[1][slots], v)
    assert not pool.k_buffers[0].any()               # other layers untouched


# ---- engines ----
@pytest.fixture(scope="module")
def small_engine(engine_factory):
    """A cache of SMALL_CACHE tokens: 8 requests of ~12 + 32 tokens cannot all fit, any one of them can."""
    return engine_factory(max_total_tokens=SMALL_CACHE, max_running_requests=8)


@pytest.fixture(scope="module")
def single_slot_engine(engine_factory):
    return engine_factory(max_total_tokens=1024, max_running_requests=1)


@pytest.fixture(scope="module")
def big_engine(engine_factory):
    return engine_factory(max_total_tokens=4096)


def wait_until_all_kv_is_free(engine, timeout: float = 30.0) -> None:
    """The core runs in its own thread: give it time to process aborts, then check every
    slot is free or in the prefix cache (unheld) exactly once, and every row is free."""
    pool, scheduler = engine.core.runner.pool, engine.core.scheduler
    all_rows = pool.max_requests
    deadline = time.monotonic() + timeout
    while engine.core.has_work() or scheduler.available_slots() != pool.size or pool.free_rows() != all_rows:
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert not engine.core.has_work() and not engine.core.requests
    assert scheduler.available_slots() == pool.size
    scheduler.check_kv()      # no slot lost or freed twice
    assert pool.free_rows() == all_rows
    assert sorted(pool._free_rows) == list(range(all_rows))


def run_in_thread(call):
    """Starts call() in a thread; returns a function that joins it and returns the result or raises."""
    result = {}

    def target():
        try:
            result["value"] = call()
        except Exception as error:  # handed to the test thread
            result["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()

    def join():
        thread.join(timeout=120)
        assert not thread.is_alive(), "the request never returned"
        if "error" in result:
            raise result["error"]
        return result["value"]
    return join


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_normal_finish_frees_everything(small_engine):
    outputs = small_engine.generate(PROMPTS[:2], {"temperature": 0, "max_new_tokens": 8})
    assert [len(o["output_ids"]) for o in outputs] == [8, 8]
    wait_until_all_kv_is_free(small_engine)


def test_preemption_keeps_outputs_and_frees_everything(small_engine, big_engine):
    expected = big_engine.generate(PROMPTS, GREEDY)
    assert all(o["meta_info"]["preemptions"] == 0 for o in expected)
    outputs = small_engine.generate(PROMPTS, GREEDY)
    assert sum(o["meta_info"]["preemptions"] for o in outputs) > 0
    assert [o["output_ids"] for o in outputs] == [o["output_ids"] for o in expected]
    assert [o["text"] for o in outputs] == [o["text"] for o in expected]
    wait_until_all_kv_is_free(small_engine)
    wait_until_all_kv_is_free(big_engine)


def test_abort_running_request_by_leaving_the_stream(small_engine):
    tokens_before = small_engine.core.stats.total_tokens
    chunks = 0
    stream = small_engine.generate(PROMPTS[0], GREEDY, stream=True)
    for chunk in stream:
        chunks += 1
        if chunks == 3:
            break
    stream.close()   # as a `for` loop's end does once the generator is dropped; runs its `finally`
    assert chunks == 3
    wait_until_all_kv_is_free(small_engine)
    # it was aborted, not run to its max_new_tokens
    assert small_engine.core.stats.total_tokens - tokens_before < GREEDY["max_new_tokens"]


def test_abort_queued_and_running_requests(single_slot_engine):
    """With one running slot, a second request waits in the queue: abort it there, then abort
    the running one mid-generation."""
    engine = single_slot_engine
    long_run = {**GREEDY, "max_new_tokens": 500}   # never reached: it is aborted
    running = run_in_thread(lambda: engine.generate(PROMPTS[0], long_run, rid="running"))
    wait_for(lambda: "running" in engine.core.requests and len(engine.core.requests["running"].output_ids) >= 2)
    queued = run_in_thread(lambda: engine.generate(PROMPTS[1], GREEDY, rid="queued"))
    wait_for(lambda: "queued" in engine.core.requests)
    engine.abort_request("queued")
    queued_output = queued()
    assert queued_output["meta_info"]["finish_reason"]["type"] == "abort"
    assert queued_output["output_ids"] == []
    engine.abort_request("running")
    running_output = running()
    assert running_output["meta_info"]["finish_reason"]["type"] == "abort"
    assert 2 <= len(running_output["output_ids"]) < long_run["max_new_tokens"]
    wait_until_all_kv_is_free(engine)
    # the engine goes on serving
    assert len(engine.generate(PROMPTS[2], {"temperature": 0, "max_new_tokens": 4})["output_ids"]) == 4
    wait_until_all_kv_is_free(engine)


@pytest.mark.parametrize("where", ["prefill forward", "decode sampling"])
def test_failed_step_frees_its_requests(small_engine, where):
    """A step that keeps raising fails the requests it ran (each caller gets the error), frees
    their cache, including the slots the step had just allocated, and the engine goes on serving.
    (A failure that does not recur when the requests are retried one at a time fails nobody:
    test_failure_isolation.py.)"""
    engine = small_engine
    owner, name, failing_call = {"prefill forward": (engine.core.runner, "extend", 1),
                                 "decode sampling": (engine.core.sampler, "sample", 3)}[where]
    original = getattr(owner, name)
    calls = {"count": 0}

    def fail_from_then_on(*args, **kwargs):
        calls["count"] += 1
        if calls["count"] >= failing_call:
            raise RuntimeError("injected failure")
        return original(*args, **kwargs)

    setattr(owner, name, fail_from_then_on)   # an instance attribute shadows the method until deleted
    try:
        with pytest.raises(RuntimeError, match="injected failure"):
            engine.generate(PROMPTS[:3], {"temperature": 0, "max_new_tokens": 16})
    finally:
        delattr(owner, name)
    assert calls["count"] >= failing_call
    wait_until_all_kv_is_free(engine)
    output = engine.generate(PROMPTS[0], {"temperature": 0, "max_new_tokens": 4})
    assert len(output["output_ids"]) == 4
    wait_until_all_kv_is_free(engine)


def test_request_larger_than_the_cache_finishes(small_engine):
    """A prompt that fits the cache with too many new tokens must end (at what fits), not
    preempt itself forever."""
    prompt = [100] * (SMALL_CACHE - 20)
    result = run_in_thread(lambda: small_engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 64}))
    output = result()
    assert output["meta_info"]["finish_reason"]["type"] == "length"
    assert 1 <= len(output["output_ids"]) and len(prompt) + len(output["output_ids"]) <= SMALL_CACHE + 1
    wait_until_all_kv_is_free(small_engine)


def test_rejected_requests_leave_nothing_behind(small_engine):
    engine = small_engine
    with pytest.raises(ValueError, match="KV cache"):
        engine.generate(input_ids=[100] * SMALL_CACHE, sampling_params={"max_new_tokens": 1})
    with pytest.raises(ValueError, match="top_p"):
        engine.generate(PROMPTS[0], {"top_p": -1})
    # an id already in use is rejected inside the core thread
    first = run_in_thread(lambda: engine.generate(PROMPTS[0], {**GREEDY, "max_new_tokens": 500}, rid="dup"))
    wait_for(lambda: "dup" in engine.core.requests)
    with pytest.raises(ValueError, match="request id"):
        engine.generate(PROMPTS[1], {"max_new_tokens": 4}, rid="dup")
    engine.abort_request("dup")
    assert first()["meta_info"]["finish_reason"]["type"] == "abort"
    wait_until_all_kv_is_free(engine)
