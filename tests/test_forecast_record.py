"""When a request's NGRAM steps are forecast (request/forecast_record.py): while its forecasts
find their entries often enough for what its steps commit, every step; below that, a probe
now and then, spaced wider with each miss; and again every step once its text turns
predictable. A forecast step's cost against one proposed after the read is measured."""
from __future__ import annotations

import random

from specserve.request.forecast_record import (FORECAST_STEP_RATIO, MIN_CYCLES, NEW_PROBE_WAIT_MAX, PRIOR_WINDOW,
                                               PROBE_WAIT_MAX, UNKNOWN_TOKENS, ForecastCycles, ForecastGate, ForecastRecord,
                                               forecast_gain)

R = FORECAST_STEP_RATIO


def _trusted() -> ForecastRecord:
    record = ForecastRecord()
    record.start(1.0, None)   # an engine's first request
    return record


def _forecast_steps(hits, tokens: int, record: ForecastRecord | None = None, step_ratio: float = R) -> list[bool]:
    """Drives a record through one outcome per step (whether a forecast made for that step
    would find its entry; a whole tree commits `tokens`, a miss one); returns, per step,
    whether the step was forecast."""
    record = record or _trusted()
    forecast = []
    for hit in hits:
        forecast.append(record.wants(step_ratio))
        if forecast[-1]:
            record.observe(hit, tokens if record.whole_tree else 1, step_ratio)
        else:
            record.skip()
    return forecast


def _share(hit_rate: float, tokens: int, step_ratio: float = R, steps: int = 2000) -> float:
    rng = random.Random(0)
    return sum(_forecast_steps([rng.random() < hit_rate for _ in range(steps)], tokens, step_ratio=step_ratio)) / steps


def test_a_forecast_pays_above_the_hit_rate_where_its_tokens_match_the_reads_in_its_time():
    for tokens, ratio in ((11, 0.82), (8, 0.95), (1.3, 0.88), (3, 0.88)):
        even = (ratio * tokens - 1) / (tokens - 1)
        assert abs(forecast_gain(even, tokens, ratio)) < 1e-9
        assert forecast_gain(even + 0.01, tokens, ratio) > 0 > forecast_gain(even - 0.01, tokens, ratio)
    assert forecast_gain(0.0, 1.0, R) > 0                         # whole trees commit one token: a miss loses nothing
    assert forecast_gain(0.9, None, R) == forecast_gain(0.9, UNKNOWN_TOKENS, R)
    assert forecast_gain(0.9, 8, 0.95) < 0 < forecast_gain(0.9, 8, 0.82)   # less hidden: more hits needed


def test_forecasts_that_hit_keep_every_step_forecast():
    assert all(_forecast_steps([True] * 200, 8))


def test_code_that_hits_almost_always_forecasts_and_code_just_below_its_threshold_seldom():
    assert _share(0.98, 11, step_ratio=0.82) > 0.95    # code-types on an H100
    assert _share(0.81, 8, step_ratio=0.95) < 0.1      # code-rename there: it lost under a fixed 75%
    assert _share(0.81, 8, step_ratio=0.7) > 0.8       # ... where the read costs more, 81% pays (threshold 66%)


def test_chat_forecasts_few_steps_but_goes_on_probing():
    chat = _share(0.2, 2)
    assert chat < 1 / 12, chat
    assert chat > 1 / (2 * PROBE_WAIT_MAX), chat


def test_probes_wait_longer_after_each_miss_up_to_the_cap():
    forecast = _forecast_steps([False] * 400, 4)
    attempts = [i for i, f in enumerate(forecast) if f]
    gaps = [b - a for a, b in zip(attempts, attempts[1:])]
    assert gaps[:4] == [1, 2, 3, 5]   # trusted until two misses (4 tokens: threshold 0.84), then 1, 2, 4 ... between
    assert gaps == sorted(gaps) and max(gaps) == PROBE_WAIT_MAX + 1 and gaps[-1] == gaps[-2]


def test_a_text_turning_predictable_is_forecast_again():
    record = _trusted()
    _forecast_steps([False] * 300, 6, record)
    assert not record.wants(R)
    after = _forecast_steps([True] * 800, 6, record)
    assert all(after[600:]), after.index(True)


def test_a_batch_weighs_what_each_request_stands_to_lose():
    """A miss costs a request whose trees commit 8 tokens seven of them, one whose trees
    commit a token nothing: two such chat requests do not make a code request forecast."""
    gate, code, chat = ForecastGate(), _trusted(), _trusted()
    code.start(0.7, 8.0)
    code.wait = 5   # no probe due
    chat.start(0.2, 1.0)
    assert chat.wants(R) and not code.wants(R)
    assert not gate.wants([code, chat, chat], 3)[0] and not gate.wants([code], 1)[0]
    assert gate.wants([chat, chat], 2) == (True, R)
    code.wait = 0   # its probe is due: alone, it probes; beside requests that gain, it counts nothing
    assert gate.wants([code], 1)[0] and gate.wants([code, chat], 2)[0]


def test_a_new_request_starts_from_what_its_engines_requests_found():
    gate = ForecastGate()
    first = ForecastRecord()
    assert gate.wants([first], 1)[0] and first.hit_rate == 1.0   # the first is trusted
    rng = random.Random(0)
    for _ in range(400):   # chat: one step in five finds its entry, a whole tree commits ~1.3 tokens
        gate.observe(first, rng.random() < 0.2, rng.choice((1, 1, 2)) if first.whole_tree else 1, R)
    later = ForecastRecord()
    assert gate.wants([later], 1)[0]   # the engine's own probe: its first since its picks stopped paying
    assert 0.05 < later.hit_rate < 0.4 and 1 <= later.tokens < 2
    assert later.wait == PROBE_WAIT_MAX and not later.wants(R)   # the request waits before a probe of its own
    # ... while the engine probes twice as seldom each time
    probes = [i for i in range(2 * NEW_PROBE_WAIT_MAX) if gate.wants([later], 1)[0]]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == [3, 5, 9, 17, 33, 65][:len(gaps)] and len(gaps) >= 4, gaps


def test_the_prior_follows_the_engines_last_picks():
    """A moving average from 1.0 kept a code-rename engine's first ~15 new requests trusted
    where 57.5% of picks found their entry; the last PRIOR_WINDOW picks' share does not."""
    gate, record = ForecastGate(), _trusted()
    for found in [True, False] * PRIOR_WINDOW:
        gate.observe(record, found, 8, R)
    assert gate.hit_rate == 0.5
    for _ in range(PRIOR_WINDOW):
        gate.observe(record, True, 8, R)
    assert gate.hit_rate == 1.0   # a workload turning predictable is trusted again within a window


def _wave_of_new_requests(gate: ForecastGate, size: int, hit_rate: float, rng: random.Random,
                          steps: int = 14, tokens: int = 8) -> int:
    """A batch of `size` new requests decoded `steps` steps (each forecast outcome found with
    `hit_rate`); returns the requests' forecast picks."""
    records, picks = [ForecastRecord() for _ in range(size)], 0
    for _ in range(steps):
        if gate.wants(records, size)[0]:
            for record in records:
                gate.observe(record, rng.random() < hit_rate, tokens if record.whole_tree else 1, R)
            picks += size
        else:
            for record in records:
                record.skip()
    return picks


def test_waves_of_new_requests_below_paying_stop_probing_their_first_steps():
    """code-rename at batch 8 on an H100: 64 requests of ~14 steps, forecasts found 57.5% where
    A ~8 asks ~80%. Each new request probing its first step made 73 picks and lost 17%."""
    gate, rng = ForecastGate(), random.Random(0)
    picks = [_wave_of_new_requests(gate, 8, 0.575, rng) for _ in range(8)]
    assert picks[0] >= 8 and sum(picks[1:]) <= 8 * 4, picks   # then a probe every few waves
    assert gate.new_wait >= 8


def test_an_engine_whose_requests_turn_predictable_trusts_new_ones_again():
    gate, rng = ForecastGate(), random.Random(0)
    for _ in range(8):
        _wave_of_new_requests(gate, 8, 0.3, rng)
    picks = [_wave_of_new_requests(gate, 8, 1.0, rng, tokens=11) for _ in range(40)]
    assert all(p >= 8 * 13 for p in picks[-5:]), picks


def test_waves_of_new_requests_that_pay_forecast_every_step():
    gate, rng = ForecastGate(), random.Random(0)
    picks = [_wave_of_new_requests(gate, 8, 0.99, rng, tokens=11) for _ in range(4)]
    assert all(p >= 8 * 13 for p in picks), picks
    assert gate.new_wait == 0


def test_only_whole_trees_count_into_what_a_request_commits():
    record = _trusted()
    record.observe(False, 9, R)   # the step before verified a whole tree: 9 tokens; this one misses
    record.observe(True, 1, R)    # the miss's one token is no whole tree's
    assert record.tokens == 9
    record.skip()                 # the next step is proposed after the read: whole again
    record.observe(True, 4, R)
    assert 4 < record.tokens < 9


def test_cycles_give_the_measured_ratio_per_batch_size_once_both_kinds_ran():
    cycles = ForecastCycles()
    for _ in range(MIN_CYCLES - 1):
        cycles.record(1, True, 0.0019)
        cycles.record(1, False, 0.0020)
    assert cycles.ratio(1) == FORECAST_STEP_RATIO   # too few of each yet
    cycles.record(1, True, 0.0019)
    cycles.record(1, False, 0.5)                    # a stall: the median keeps it out
    assert abs(cycles.ratio(1) - 0.95) < 1e-9
    assert cycles.ratio(8) == FORECAST_STEP_RATIO   # another batch size has its own
