"""When an engine's NGRAM steps are forecast: ForecastRecord (how often a request's forecast
steps found their entry and what its steps with a whole tree commit), ForecastCycles (what a
forecast step costs against a step proposed after the read, measured) and ForecastGate (the
engine's decision for each batch, and the start it gives a new request).

A forecast step (runner/forecast_step.py) is queued before the step before it is read, its
tree picked from the trie's forecast by that step's outcome. Where the outcome has no entry
the step verifies its root alone: one token at a verify step's price, where a proposal made
after the read would have verified a whole tree. A hit saves the host's read-to-launch time.
So with h the share of a request's steps that hit, A the tokens its steps with a whole tree
commit and r a forecast step's cycle over a verify step's proposed after the read, a forecast
step gains h * A + (1 - h) - r * A tokens for it (forecasting pays above h = (r A - 1) / (A - 1)),
and a batch's step is forecast where its requests' gains sum to 0 or more.

On an H100 (1.5B, batch 1, 2026-12-05) code-types hit ~98% of steps at A ~11 with r ~0.82 and
gained 5-20%; code-rename hit ~81% at A ~8 with r ~0.95 (its proposals are cheap, so there is
little to hide) and lost 4-20% under a fixed 75% threshold, where this rule asks 94%; chat
(A ~1.3) asks ~48% and hits ~20%. A request's own history is short (a 150-token edit at 11
tokens a step is 14 steps), so a new one starts from what its engine's last PRIOR_WINDOW
forecast steps found. Where its gain is below 0 it asks for a probe now and then: the wait
doubles with each miss, up to PROBE_WAIT_MAX steps, and a hit keeps it (halved on a hit, a
request hitting 81% of steps probed every other step, half of them at a loss), so a request
whose text turns predictable takes a few hundred steps to be trusted again. A new request
that starts below 0 waits PROBE_WAIT_MAX of its steps before its first probe; meanwhile, while
the engine's last picks say forecasting does not pay, the engine probes a whole batch's step
now and then itself (every `new_wait` of its steps, a wait that doubles up to
NEW_PROBE_WAIT_MAX with each such probe), so its prior follows a workload that turns
predictable. Before, each new request probed its first step: on an H100 (1.5B, code-rename
at batch 8, 64 requests of ~14 steps) 73 forecast picks found 57.5% and the cell fell from
2.78x plain to 2.31x; and a slow prior (a moving average weighting each pick 5%, from 1.0)
kept the first ~15 picks trusted.
"""
from __future__ import annotations

import statistics
from collections import deque

UNKNOWN_TOKENS = 4.0          # A before any request's steps have said what they commit
FORECAST_STEP_RATIO = 0.88    # r before it is measured: lab.step_cost's 0.84-0.88 (H100, 1.5B, 4-8 nodes)
HIT_RATE_WEIGHT = 0.1         # the newest forecast's weight in the hit rate: a lone miss among hits keeps it above
TOKENS_WEIGHT = 0.2           # the newest step's weight in the tokens a whole tree commits (a request's, and its
                              # engine's: the newest pick's record)
PROBE_WAIT_MAX = 32
PRIOR_WINDOW = 32             # a new request starts from what its engine's last this many forecast picks found
NEW_PROBE_WAIT_MAX = 64       # at most this many engine steps between its own probes, while its picks do not pay
CYCLES_WINDOW = 16            # steps of each kind whose median cycle makes r (a stall is one step)
MIN_CYCLES = 4                # ... at least this many of each, else FORECAST_STEP_RATIO


def forecast_gain(hit_rate: float, tokens: float | None, step_ratio: float) -> float:
    """The tokens a forecast step is expected to commit for a request over what a step proposed
    after the read commits in the forecast step's time: h * A + (1 - h) - r * A, its sign
    whether forecasting pays (None: A not known yet)."""
    tokens = UNKNOWN_TOKENS if tokens is None else tokens
    return hit_rate * tokens + (1.0 - hit_rate) - step_ratio * tokens


class ForecastRecord:
    __slots__ = ("hit_rate", "tokens", "whole_tree", "wait", "backoff")

    def __init__(self):
        self.hit_rate: float | None = None   # None until its engine starts it (ForecastGate)
        self.tokens: float | None = None     # what its steps with a whole tree commit (A)
        self.whole_tree = True   # whether its step in flight verifies a whole tree (a hit, or the read's)
        self.wait = 0            # steps before its next probe, while its rate is low
        self.backoff = 1         # the last wait set below the rate

    def start(self, hit_rate: float, tokens: float | None, wait: int = 0) -> None:
        """Its first forecast decision: it takes what its engine's requests found so far (a
        request's own history is short: a 150-token code edit at 11 tokens a step is 14 steps),
        and its steps before a first probe (PROBE_WAIT_MAX where what it takes is below paying)."""
        self.hit_rate, self.tokens = hit_rate, tokens
        self.wait, self.backoff = wait, max(1, wait)

    def gain(self, step_ratio: float) -> float:
        """forecast_gain of its next step, as its record stands."""
        return forecast_gain(self.hit_rate, self.tokens, step_ratio)

    def wants(self, step_ratio: float) -> bool:
        """Whether this request's next step should be a forecast one (it pays, or a probe is due)."""
        return self.gain(step_ratio) >= 0.0 or self.wait == 0

    def observe(self, found: bool, committed: int, step_ratio: float) -> None:
        """A forecast step of this request: whether the outcome before it found its entry,
        and what that step before committed (counted into A where it verified a whole tree)."""
        if self.whole_tree:
            self.tokens = committed if self.tokens is None else self.tokens + TOKENS_WEIGHT * (committed - self.tokens)
        self.whole_tree = found
        self.hit_rate += HIT_RATE_WEIGHT * (float(found) - self.hit_rate)
        if self.gain(step_ratio) >= 0.0:
            self.wait, self.backoff = 0, 1
        elif found:
            self.wait = self.backoff
        else:
            self.wait, self.backoff = self.backoff, min(2 * self.backoff, PROBE_WAIT_MAX)

    def skip(self) -> None:
        """A drafting step after which no forecast step was queued for this request (its
        next step's tree is proposed after the read: a whole one)."""
        self.wait = max(0, self.wait - 1)
        self.whole_tree = True


class ForecastGate:
    """An engine's forecast decisions: each batch's (ForecastRecord.wants of its requests, at
    the r its ForecastCycles measured), and what its requests found so far, which a new
    request starts from (trusted before any: hit rate 1, A unknown)."""

    def __init__(self):
        self.cycles = ForecastCycles()
        self._recent: deque[bool] = deque(maxlen=PRIOR_WINDOW)   # whether each of the last picks found its entry
        self.tokens: float | None = None
        self.new_wait = 0             # engine steps between its own probes, while its picks do not pay
        self._waited = 0              # engine steps since its last probe
        self.picks = self.found = 0   # requests' forecast steps so far, and those that found their entry

    @property
    def hit_rate(self) -> float:
        """What the engine's last PRIOR_WINDOW picks found (1 before any: the first request is trusted)."""
        return sum(self._recent) / len(self._recent) if self._recent else 1.0

    def wants(self, records: list[ForecastRecord], batch_size: int) -> tuple[bool, float]:
        """Whether the batch's next step should be a forecast one, and the r it was decided at:
        where its requests' gains sum to 0 or more (the step's time is the batch's; a request
        whose probe is due counts 0, so a batch of one probes), or the engine's probe is due."""
        step_ratio = self.cycles.ratio(batch_size)
        self._waited += 1
        prior_pays = forecast_gain(self.hit_rate, self.tokens, step_ratio) >= 0.0
        if prior_pays:
            self.new_wait = 0
        for record in records:
            if record.hit_rate is None:
                record.start(self.hit_rate, self.tokens, 0 if prior_pays else PROBE_WAIT_MAX)
        gains = [record.gain(step_ratio) for record in records]
        if sum(0.0 if g < 0.0 and r.wait == 0 else g for g, r in zip(gains, records)) >= 0.0:
            return True, step_ratio
        if prior_pays or self._waited <= self.new_wait:
            return False, step_ratio
        self._waited, self.new_wait = 0, min(max(1, 2 * self.new_wait), NEW_PROBE_WAIT_MAX)
        return True, step_ratio

    def observe(self, record: ForecastRecord, found: bool, committed: int, step_ratio: float) -> None:
        """A request's forecast step (ForecastRecord.observe), into its engine's record too."""
        record.observe(found, committed, step_ratio)
        self.picks += 1
        self.found += found
        self._recent.append(found)
        if record.tokens is not None:
            self.tokens = record.tokens if self.tokens is None else self.tokens + TOKENS_WEIGHT * (record.tokens - self.tokens)


class ForecastCycles:
    """r, measured per batch size: the median cycle (launch to the next launch) of the last
    CYCLES_WINDOW forecast steps over that of the NGRAM verify steps proposed after the read,
    steady ones of more than one node each (what hiding the read saves depends on the workload:
    a 16-node code proposal costs the host more than a chat one)."""

    def __init__(self):
        self._cycles: dict[tuple[int, bool], deque] = {}

    def record(self, batch_size: int, forecast: bool, seconds: float) -> None:
        self._cycles.setdefault((batch_size, forecast), deque(maxlen=CYCLES_WINDOW)).append(seconds)

    def ratio(self, batch_size: int) -> float:
        forecast, after_read = self._cycles.get((batch_size, True), ()), self._cycles.get((batch_size, False), ())
        if len(forecast) < MIN_CYCLES or len(after_read) < MIN_CYCLES:
            return FORECAST_STEP_RATIO
        # (measured 0.82-0.95 on an H100; far below that would hide more host time than a verify
        # step there leaves exposed: a measurement gone wrong, not a reason to forecast every miss)
        return min(1.0, max(0.6, statistics.median(forecast) / statistics.median(after_read)))
