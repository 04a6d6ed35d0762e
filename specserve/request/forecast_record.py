"""ForecastRecord: how often a request's forecast steps found their entry, and whether its
next step should be one.

A forecast step (runner/forecast_step.py) is queued before the step before it is read, its
tree picked from the trie's forecast by that step's outcome. Where the outcome has no entry
the step verifies its root alone: one token at a verify step's price, where a proposal made
after the read would have verified a whole tree. A hit saves the host's read-to-launch time
(~0.4 ms on a 1.5B H100 step of ~1.9 ms); a miss loses the tree. On an H100 at batch 1 the
forecast paid above ~80% of steps hitting (code edits hit 77-95%, chat ~20%), so a request
forecasts while its hit rate stays at or above HIT_RATE_TO_FORECAST, and otherwise asks for
a probe now and then (waits of 1, 2, 4 ... PROBE_WAIT_MAX steps between probes) so that a
request whose text turns predictable gets forecasts again.
"""
from __future__ import annotations

HIT_RATE_TO_FORECAST = 0.75
HIT_RATE_WEIGHT = 0.1   # the newest forecast's weight in the hit rate: a lone miss among hits keeps it above
PROBE_WAIT_MAX = 32


class ForecastRecord:
    __slots__ = ("hit_rate", "wait", "backoff")

    def __init__(self):
        self.hit_rate = HIT_RATE_TO_FORECAST   # trusted until its first miss (a chat request's costs one)
        self.wait = 0         # steps before its next probe, while its rate is low
        self.backoff = 1      # the last wait set below the rate

    def wants(self) -> bool:
        """Whether this request's next step should be a forecast one (trusted, or a probe due)."""
        return self.hit_rate >= HIT_RATE_TO_FORECAST or self.wait == 0

    def observe(self, found: bool) -> None:
        """A forecast step of this request: whether the outcome before it found its entry.
        Below the rate, the next probe waits `backoff` steps, which doubles with each miss
        and halves with each hit (chat, hitting one step in five, probes rarely; a text that
        turns predictable is trusted again within ~70 steps), and resets once the rate is back."""
        self.hit_rate += HIT_RATE_WEIGHT * (float(found) - self.hit_rate)
        if self.hit_rate >= HIT_RATE_TO_FORECAST:
            self.wait, self.backoff = 0, 1
            return
        if found:
            self.backoff = max(1, self.backoff // 2)
            self.wait = self.backoff
        else:
            self.wait, self.backoff = self.backoff, min(2 * self.backoff, PROBE_WAIT_MAX)

    def skip(self) -> None:
        """A drafting step after which no forecast step was queued for this request."""
        self.wait = max(0, self.wait - 1)


def batch_wants_forecast(records: list[ForecastRecord]) -> bool:
    """Whether a batch's next step should be a forecast one: where at least half its requests
    want one (a request that misses verifies its root alone in the batch's step)."""
    return 2 * sum(record.wants() for record in records) >= len(records)
