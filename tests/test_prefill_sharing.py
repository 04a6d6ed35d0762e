"""A short request that arrives while a long prompt prefills starts beside it, not behind it:
the started prompt takes at most half of a step's prompt tokens while a waiting one could
start, so the newcomer's first token comes before the long prefill ends; and the running
streams keep getting a token every other step, each prefill step within the pacer's budget.
Counted in steps, by hand on the scheduler (no model) and on a tiny random model."""
from __future__ import annotations

from specserve.engine.prefill_pacer import PREFILL_SHARE
from specserve.engine.scheduler import Scheduler

from tests.spec_fixtures import make_tiny_directory, tiny_engine
from tests.test_prefill_pacing import _decoding_scheduler, _pool, _req, _run

PACED_CHUNK = int(PREFILL_SHARE * 0.040 / 0.002)   # _decoding_scheduler's costs: 30 prompt tokens a step


def test_a_newcomer_starts_during_a_paced_long_prefill():
    scheduler, streams, long_prompt = _decoding_scheduler(mixed=False)
    newcomer, steps, newcomer_first_token = _req("new", 100), [], None
    while long_prompt.kv_len < long_prompt.prefill_target:
        if len(steps) == 6:
            scheduler.add(newcomer)
        batch = scheduler.schedule()
        steps.append(batch)
        if batch.is_extend:
            assert sum(batch.extend_lens) <= PACED_CHUNK     # the streams' gap keeps to the pacer's budget
        _run(scheduler, batch)
        if newcomer.output_ids and newcomer_first_token is None:
            newcomer_first_token = len(steps)
    assert newcomer_first_token is not None and newcomer_first_token < len(steps)
    # 100 tokens at half of 30 a prefill step, prefill steps every other step
    assert newcomer_first_token <= 6 + 2 * (100 // (PACED_CHUNK // 2) + 1) + 1
    assert all(a.is_extend != b.is_extend for a, b in zip(steps, steps[1:]))   # streams: a token every 2 steps


def test_a_newcomer_starts_beside_a_long_prompt_when_nobody_decodes():
    scheduler = Scheduler(_pool(), max_running_requests=16, chunked_prefill_size=256)
    long_prompt, newcomer = _req("long", 2000), _req("new", 20)
    scheduler.add(long_prompt)
    _run(scheduler, scheduler.schedule())
    scheduler.add(newcomer)
    batch = scheduler.schedule()
    assert batch.reqs == [long_prompt, newcomer] and batch.extend_lens == [128, 20]
    _run(scheduler, batch)
    assert newcomer.output_ids and long_prompt.kv_len == 256 + 128


def test_a_long_prompt_alone_takes_whole_chunks():
    scheduler = Scheduler(_pool(), max_running_requests=16, chunked_prefill_size=256)
    long_prompt = _req("long", 2000)
    scheduler.add(long_prompt)
    for step in range(3):
        batch = scheduler.schedule()
        assert batch.extend_lens == [256]
        _run(scheduler, batch)


def test_on_a_tiny_model_a_newcomer_gets_its_first_token_before_the_long_prefill_ends(tmp_path):
    """A stream decodes, a 400-token prompt arrives (chunks of at most 32), a 12-token one
    arrives after the long prompt's first chunk: the engine's core stepped by hand."""
    path = tmp_path / "tiny"
    make_tiny_directory(path)
    engine = tiny_engine(path, chunked_prefill_size=32, disable_radix_cache=True)
    engine.shutdown()   # the step loop stops: the test steps the core itself
    core = engine.core
    params = {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}

    def request(rid: str, length: int):
        return engine._make_request([3 + i % 200 for i in range(length)], params, False, 0, rid)

    stream, long_prompt, newcomer = request("stream", 8), request("long", 400), request("new", 12)
    core.add_request(stream)
    while not stream.output_ids:
        core.step()
    core.add_request(long_prompt)
    events = []   # per step: (stream tokens, long prompt's cached tokens, newcomer tokens)
    while not long_prompt.output_ids:
        if long_prompt.kv_len > 0 and newcomer.rid not in core.requests:
            core.add_request(newcomer)
        core.step()
        events.append((len(stream.output_ids), long_prompt.kv_len, len(newcomer.output_ids)))
    long_done = len(events)
    newcomer_first = next(i for i, (_, _, tokens) in enumerate(events, 1) if tokens)
    assert newcomer_first < long_done - 2, events
    stream_tokens = [tokens for tokens, _, _ in events]
    # the stream gets a token at least every other step while the long prompt prefills
    assert all(later > earlier for earlier, later in zip(stream_tokens, stream_tokens[2:])), stream_tokens


def test_on_a_tiny_model_two_prompts_that_fit_only_one_at_a_time_both_finish(tmp_path):
    """Prompts of 150 and 140 tokens in a cache of 200, chunks of at most 32: the second
    arrives after the first's first chunk and shares its steps only with room the first no
    longer needs (both partway, a full cache stalled the engine: nobody decoded, so nobody was
    preempted); each answer is what it is alone."""
    path = tmp_path / "tiny"
    make_tiny_directory(path)
    engine = tiny_engine(path, chunked_prefill_size=32, max_total_tokens=200, disable_radix_cache=True)
    engine.shutdown()   # the step loop stops: the test steps the core itself
    core = engine.core
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}

    def request(rid: str, length: int, offset: int):
        return engine._make_request([3 + (offset + 7 * i) % 200 for i in range(length)], params, False, 0, rid)

    def alone(rid: str, length: int, offset: int) -> list[int]:
        req = request(rid, length, offset)
        core.add_request(req)
        while not req.finished:
            core.step()
        return list(req.output_ids)

    expected = [alone("first-alone", 150, 0), alone("second-alone", 140, 50)]
    first, second = request("first", 150, 0), request("second", 140, 50)
    core.add_request(first)
    core.step()
    core.add_request(second)
    for _ in range(200):
        if first.finished and second.finished:
            break
        core.step()
    assert first.finished and second.finished, [(r.rid, r.kv_len, r.prefill_target) for r in core.scheduler.running]
    assert [list(first.output_ids), list(second.output_ids)] == expected
    assert core.scheduler.available_slots() == 200
