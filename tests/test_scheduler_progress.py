"""The scheduler always gives a step to someone while requests run: two long prompts partway
through their chunked prefills never fill the pool together (neither could finish, nobody
decodes, so nobody would be preempted: the engine stalled until the clients gave up), and a
mixed step's tokens never take more slots than are free. Counted on the scheduler by hand
(no model), on a hand-made case and on seeded random arrivals (before the fix, 1,336 of
3,000 such runs stalled or overran the pool)."""
from __future__ import annotations

import random

import pytest

from specserve.engine.scheduler import Scheduler
from specserve.request.req import ReqState

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


def _run_with_drafts(scheduler: Scheduler, batch, rng: random.Random) -> None:
    """_run, where a decode step commits 1..decode_room tokens, as many as the pool has room
    for beside the batch's other rows (a drafting step finds room or decodes plainly)."""
    lens = batch.extend_lens if batch.is_extend else [1] * batch.size
    samples = batch.samples if batch.is_extend else [True] * batch.size
    rows_after = sum(lens)
    for req, length, sample in zip(batch.reqs, lens, samples):
        rows_after -= length
        taken = length if batch.is_extend else max(
            1, min(rng.randint(1, scheduler.decode_room), scheduler.available_slots() - rows_after))
        slots = scheduler.alloc_slots(taken)
        assert slots is not None, f"a batch took more slots than were free: {taken} of {scheduler.available_slots()}"
        scheduler.append_kv([req], [slots], write_table=False)
        if sample:
            req.output_ids.extend([7] * (1 if batch.is_extend else taken))


@pytest.mark.parametrize("seed_block", range(4))
def test_random_arrivals_in_a_small_pool_always_progress(seed_block):
    """2-8 prompts of 10-3,900 tokens (some sharing a prefix, for the prefix cache) arrive at
    random steps into 4,096 slots, some aborted at a random step, under every combination of
    chunk size, mixed chunks, draft room, policy and running limit: every step has a batch
    while someone runs, everyone not aborted finishes, and every slot is free at the end."""
    for trial in range(seed_block * 60, seed_block * 60 + 60):
        rng = random.Random(trial)
        scheduler = Scheduler(_pool(4096), max_running_requests=rng.choice([2, 3, 16]),
                              chunked_prefill_size=rng.choice([256, 512, 2048]),
                              prefix_cache=rng.random() < 0.5, enable_mixed_chunk=rng.random() < 0.5,
                              schedule_policy=rng.choice(["fcfs", "lpm"]))
        scheduler.decode_room = rng.choice([1, 4, 8])
        if rng.random() < 0.5:   # the pacer's costs known: chunks are paced against decode steps
            scheduler.pacer.record(0.040, prefill_tokens=0, decode_reqs=4)
            scheduler.pacer.record(0.2, prefill_tokens=100, decode_reqs=0)
        shared_prefix = [rng.randint(3, 50) for _ in range(2000)]
        reqs = [_req(f"r{i}", rng.randint(10, 3900)) for i in range(rng.randint(2, 8))]
        for req in reqs:
            shared = rng.randint(0, min(2000, len(req.prompt_ids))) if rng.random() < 0.5 else 0
            req.prompt_ids[:] = shared_prefix[:shared] + [rng.randint(3, 50)
                                                          for _ in range(len(req.prompt_ids) - shared)]
        outputs = {req.rid: rng.randint(1, 80) for req in reqs}
        aborts = {req.rid: rng.randint(0, 300) for req in reqs if rng.random() < 0.2}
        arrivals = sorted(rng.randint(0, 60) for _ in reqs)
        for step in range(20000):
            for req, arrival in zip(reqs, arrivals):
                if arrival == step:
                    scheduler.add(req)
                if aborts.get(req.rid) == step and req.state is not ReqState.FINISHED and arrival <= step:
                    scheduler.abort(req)
                    req.state = ReqState.FINISHED
            batch = scheduler.schedule()
            assert batch is not None or not scheduler.running, (trial, step)
            if batch is not None:
                _run_with_drafts(scheduler, batch, rng)
            _finish_after(scheduler, outputs)
            if step > max(arrivals) and not scheduler.has_work():
                break
        unfinished = [r.rid for r in reqs if r.rid not in aborts and len(r.output_ids) < outputs[r.rid]]
        assert not unfinished, (trial, unfinished)
        scheduler.check_kv()
        assert scheduler.available_slots() == 4096, trial
