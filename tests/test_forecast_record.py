"""When a request's NGRAM steps are forecast (request/forecast_record.py): while its forecasts
find their entries, every step; where they mostly miss, a probe now and then, spaced wider
with each miss; and again every step once a probe finds its text predictable."""
from __future__ import annotations

import random

from specserve.request.forecast_record import (HIT_RATE_TO_FORECAST, PROBE_WAIT_MAX, ForecastRecord,
                                               batch_wants_forecast)


def _forecast_steps(hits, record: ForecastRecord | None = None) -> list[bool]:
    """Drives a record through one outcome per step (whether a forecast made for that step
    would find its entry); returns, per step, whether the step was forecast."""
    record = record or ForecastRecord()
    forecast = []
    for hit in hits:
        forecast.append(record.wants())
        if forecast[-1]:
            record.observe(hit)
        else:
            record.skip()
    return forecast


def test_forecasts_that_hit_keep_every_step_forecast():
    assert all(_forecast_steps([True] * 200))


def test_code_forecasts_most_steps_and_chat_few():
    rng = random.Random(0)
    code = _forecast_steps([rng.random() < 0.92 for _ in range(2000)])
    chat = _forecast_steps([rng.random() < 0.2 for _ in range(2000)])
    assert sum(code) > 0.85 * len(code), sum(code)
    assert sum(chat) < len(chat) / 12, sum(chat)   # probes at most: misses there lose a tree each
    assert sum(chat) > len(chat) / (2 * PROBE_WAIT_MAX)   # ... but they go on


def test_probes_wait_longer_after_each_miss_up_to_the_cap():
    forecast = _forecast_steps([False] * 400)
    attempts = [i for i, f in enumerate(forecast) if f]
    gaps = [b - a for a, b in zip(attempts, attempts[1:])]
    assert gaps[:3] == [2, 3, 5]   # trusted until its first miss, then probes after 1, 2, 4 ... steps
    assert gaps == sorted(gaps) and max(gaps) == PROBE_WAIT_MAX + 1 and gaps[-1] == gaps[-2]


def test_a_text_turning_predictable_is_forecast_again():
    record = ForecastRecord()
    _forecast_steps([False] * 300, record)
    assert record.hit_rate < HIT_RATE_TO_FORECAST
    after = _forecast_steps([True] * 160, record)
    assert after.index(True) <= PROBE_WAIT_MAX and all(after[3 * PROBE_WAIT_MAX:]), after


def test_a_batch_forecasts_where_half_its_requests_want_it():
    trusted, doubtful = ForecastRecord(), ForecastRecord()
    for _ in range(4):
        doubtful.observe(False)
    assert trusted.wants() and not doubtful.wants()
    assert batch_wants_forecast([trusted, doubtful]) and batch_wants_forecast([trusted])
    assert not batch_wants_forecast([trusted, doubtful, doubtful]) and not batch_wants_forecast([doubtful])
