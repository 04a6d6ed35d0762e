"""Prefill that does not starve decoding: the pacer's chunk sizes, and the scheduler's
alternating and mixed steps, on a tiny KV pool with requests stepped by hand (no model).
The end-to-end figure (a 4k prompt arriving while 8 streams run) is a benchmark:
python -m specserve.bench.prefill_stall."""
from __future__ import annotations

import torch

from specserve.engine.prefill_pacer import MIN_CHUNK, PREFILL_SHARE, PrefillPacer
from specserve.engine.request import Batch, Req
from specserve.engine.scheduler import Scheduler
from specserve.kv.pool import KVPool
from specserve.sampling.params import SamplingParams


def test_pacer_starts_small_and_converges_to_the_share_of_a_decode_step():
    decode_s, fixed_s, per_token_s = 0.040, 0.015, 0.002     # the CPU's shape: a prefill step has a fixed cost
    pacer = PrefillPacer(max_chunk=2048)
    assert pacer.budget(decoding=False) == 2048                 # nobody waits: whole chunks
    assert pacer.budget(decoding=True) == MIN_CHUNK             # nothing measured yet
    pacer.record(decode_s, prefill_tokens=0, decode_reqs=8)
    for _ in range(30):
        chunk = pacer.budget(decoding=True)
        pacer.record(fixed_s + per_token_s * chunk, prefill_tokens=chunk, decode_reqs=0)
    step_s = fixed_s + per_token_s * pacer.budget(decoding=True)
    assert abs(step_s - PREFILL_SHARE * decode_s) < 0.05 * decode_s


def test_pacer_mixed_steps_count_only_the_prefill_part_and_respect_the_bounds():
    pacer = PrefillPacer(max_chunk=512)
    pacer.record(0.010, prefill_tokens=0, decode_reqs=4)
    pacer.record(0.010 + 100 * 0.0001, prefill_tokens=100, decode_reqs=4)    # 0.1 ms per prompt token
    assert pacer.budget(decoding=True) == int(PREFILL_SHARE * 0.010 / 0.0001)
    pacer.record(0.010 + 0.5, prefill_tokens=10, decode_reqs=4)              # dreadfully slow tokens
    pacer.record(0.010 + 0.5, prefill_tokens=10, decode_reqs=4)
    assert pacer.budget(decoding=True) == MIN_CHUNK
    fast = PrefillPacer(max_chunk=512)
    fast.record(1.0, prefill_tokens=0, decode_reqs=1)
    fast.record(1e-9, prefill_tokens=10, decode_reqs=0)
    assert fast.budget(decoding=True) == 512


# ---- the scheduler, stepped by hand ----
def _pool(size: int = 8192) -> KVPool:
    return KVPool(1, 1, 2, size, max_requests=16, max_context=8192, dtype=torch.float32, device=torch.device("cpu"))


def _req(rid: str, prompt_len: int) -> Req:
    return Req(rid=rid, prompt_ids=[5] * prompt_len, params=SamplingParams(), detokenizer=None, seed=0,
               stop_ids=frozenset(), max_new_tokens=1000)


def _run(scheduler: Scheduler, batch: Batch) -> None:
    """What a step does to the scheduler's state: KV for every token fed, a token per sampling request."""
    lens = batch.extend_lens if batch.is_extend else [1] * batch.size
    samples = batch.samples if batch.is_extend else [True] * batch.size
    for req, length, sample in zip(batch.reqs, lens, samples):
        scheduler.append_kv([req], [scheduler.alloc_slots(length)], write_table=False)
        if sample:
            req.output_ids.append(7)


def _decoding_scheduler(mixed: bool) -> tuple[Scheduler, list[Req], Req]:
    """Four requests decoding, the pacer's costs known, then a 4,000-token prompt arrives."""
    scheduler = Scheduler(_pool(), max_running_requests=16, chunked_prefill_size=2048, enable_mixed_chunk=mixed)
    streams = [_req(f"s{i}", 10) for i in range(4)]
    for req in streams:
        scheduler.add(req)
    _run(scheduler, scheduler.schedule())                      # nobody decodes: one prefill for all four
    assert all(len(r.output_ids) == 1 for r in streams)
    scheduler.pacer.decode_step_s, scheduler.pacer.prefill_token_s = 0.040, 0.002
    long_prompt = _req("long", 4000)
    scheduler.add(long_prompt)
    return scheduler, streams, long_prompt


def test_prefill_chunks_alternate_with_decode_steps():
    scheduler, streams, long_prompt = _decoding_scheduler(mixed=False)
    expected_chunk = int(PREFILL_SHARE * 0.040 / 0.002)
    kinds = []
    while long_prompt.kv_len < 4000:
        batch = scheduler.schedule()
        kinds.append("prefill" if batch.is_extend else "decode")
        if batch.is_extend:
            assert batch.reqs == [long_prompt] and batch.extend_lens[0] == min(expected_chunk, 4000 - long_prompt.kv_len)
        else:
            assert batch.reqs == streams
        _run(scheduler, batch)
    assert kinds[:4] == ["decode", "prefill", "decode", "prefill"]   # the streams had just been prefilled
    assert all(a != b for a, b in zip(kinds, kinds[1:]))      # never two steps of the same kind in a row
    assert len(streams[0].output_ids) == 1 + kinds.count("decode")   # the streams kept flowing
    assert scheduler.schedule().reqs == streams + [long_prompt]       # all decode together afterwards


def test_mixed_chunks_decode_in_every_prefill_step():
    scheduler, streams, long_prompt = _decoding_scheduler(mixed=True)
    steps = 0
    while long_prompt.kv_len < 4000:
        batch = scheduler.schedule()
        assert batch.is_extend and batch.reqs[:4] == streams and batch.reqs[4] is long_prompt
        assert batch.extend_lens[:4] == [1] * 4 and batch.samples[:4] == [True] * 4
        _run(scheduler, batch)
        steps += 1
    assert all(len(r.output_ids) == 1 + steps for r in streams)
    assert scheduler._last_step == (batch.extend_lens[4], 4)     # timed as 4 decodes + the chunk


def test_prefill_goes_first_while_nobody_decodes():
    scheduler = Scheduler(_pool(), max_running_requests=16, chunked_prefill_size=1024)
    long_prompt = _req("long", 3000)
    scheduler.add(long_prompt)
    assert scheduler.schedule().extend_lens == [1024]


def test_focus_schedules_only_the_given_requests():
    scheduler, streams, long_prompt = _decoding_scheduler(mixed=False)
    scheduler.focus = [streams[2]]
    batch = scheduler.schedule()
    assert not batch.is_extend and batch.reqs == [streams[2]]
    scheduler.focus = [long_prompt]
    batch = scheduler.schedule()
    assert batch.is_extend and batch.reqs == [long_prompt] and batch.extend_lens == [2048]   # nobody else runs
    scheduler.focus = None
    assert scheduler.schedule().reqs == streams


def test_trim_kv_drops_slots_committed_ahead_of_their_tokens():
    scheduler, streams, _ = _decoding_scheduler(mixed=False)
    req = streams[0]
    free = scheduler.pool.slots.available()
    scheduler.append_kv([req], [scheduler.alloc_slots(1)], write_table=False)   # KV committed, token not
    assert req.kv_len == req.num_tokens
    scheduler.trim_kv(req)
    assert req.kv_len == req.num_tokens - 1 and scheduler.pool.slots.available() == free
