"""The scheduler always gives a step to someone while requests run: two long prompts partway
through their chunked prefills never fill the pool together (neither could finish, nobody
decodes, so nobody would be preempted: the engine stalled until the clients gave up), and a
mixed step's tokens never take more slots than are free. Counted on the scheduler by hand
(no model), on a hand-made case and on seeded random arrivals."""
from __future__ import annotations

import random

import pytest

from specserve.engine.scheduler import Scheduler

from tests.test_prefill_pacing import _pool, _req, _run


def _finish_after(scheduler: Scheduler, outputs: dict[str, int]) -> None:
    for req in list(scheduler.running):
        if len(req.output_ids) >= outputs[req.rid]:
            scheduler.finish(req, {"type": "length"})


def test_two_long_prompts_that_fit_only_one_at_a_time_both_finish():
    """A 3,278-token prompt, then a 3,583-token one a step later, in 4,096 slots: the newcomer
    shares the steps only with room the older prompt does not still need."""
    scheduler = Scheduler(_pool(4096), max_running_requests=16, chunked_prefill_size=2048)
    first, second = _req("first", 3278), _req("second", 3583)
    scheduler.add(first)
    _run(scheduler, scheduler.schedule())
    scheduler.add(second)
    for _ in range(20):
        batch = scheduler.schedule()
        assert batch is not None, [(r.rid, r.kv_len, r.prefill_target) for r in scheduler.running]
        _run(scheduler, batch)
        assert sum(len(r.kv_slots) for r in scheduler.running) <= 4096
        _finish_after(scheduler, {"first": 2, "second": 2})
        if not scheduler.has_work():
            break
    assert len(first.output_ids) == 2 and len(second.output_ids) == 2


@pytest.mark.parametrize("seed_block", range(4))
def test_random_arrivals_in_a_small_pool_always_progress(seed_block):
    """Prompts of 100-3,900 tokens (some sharing tokens, for the prefix cache) arrive at random
    steps into 4,096 slots, under every combination of chunk size, mixed chunks, draft room and
    running limit: every step has a batch while someone runs, and everyone finishes."""
    for trial in range(seed_block * 60, seed_block * 60 + 60):
        rng = random.Random(trial)
        scheduler = Scheduler(_pool(4096), max_running_requests=rng.choice([2, 3, 16]),
                              chunked_prefill_size=rng.choice([256, 512, 2048]),
                              prefix_cache=rng.random() < 0.5, enable_mixed_chunk=rng.random() < 0.5)
        scheduler.decode_room = rng.choice([1, 4, 8])
        if rng.random() < 0.5:   # the pacer's costs known: chunks are paced against decode steps
            scheduler.pacer.record(0.040, prefill_tokens=0, decode_reqs=4)
            scheduler.pacer.record(0.2, prefill_tokens=100, decode_reqs=0)
        reqs = [_req(f"r{i}", rng.randint(100, 3900)) for i in range(rng.randint(2, 6))]
        for req in reqs:
            req.prompt_ids[:] = [rng.randint(3, 50) if rng.random() < 0.7 else 5 for _ in req.prompt_ids]
        outputs = {req.rid: rng.randint(1, 60) for req in reqs}
        arrivals = sorted(rng.randint(0, 40) for _ in reqs)
        for step in range(5000):
            for req, arrival in zip(reqs, arrivals):
                if arrival == step:
                    scheduler.add(req)
            batch = scheduler.schedule()
            assert batch is not None or not scheduler.running, (trial, step)
            if batch is not None:
                _run(scheduler, batch)   # fails on a batch that takes more slots than are free
            _finish_after(scheduler, outputs)
            if step > max(arrivals) and not scheduler.has_work():
                break
        assert all(len(req.output_ids) >= outputs[req.rid] for req in reqs), trial
