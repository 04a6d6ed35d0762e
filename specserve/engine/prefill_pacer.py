"""PrefillPacer: how many prompt tokens a step may carry while other requests decode.

A prefill chunk delays the next token of every decoding request by its own duration, so a
4k-token prompt prefilled in one go stalls every stream for as long as that takes (tens of
seconds on a CPU). While requests decode, chunks are sized so that the prefill part of a
step costs at most a target: PREFILL_SHARE times a plain decode step, and never less than
MIN_PREFILL_S. A stream then waits about (1 + PREFILL_SHARE) times its usual inter-token
time, whether prefill steps alternate with decode steps or ride inside them (mixed chunks).
"About": chunks are sized to the target, so steps scatter around it by their own noise. A
4k-token prompt beside 8 streams of a 135M model on an idle 2-core CPU
(lab.prefill_step_trace): the prefill part at a median of 2.49x a decode step, p99
2.62-2.87x, worst 2.67-3.02x. The tail: in the first ~2k tokens, where each chunk costs more
than the last, runs of steps 2-10% over while the fit catches up, and anywhere single steps
whose CPU time rose 20-40% against the same chunk before and after. Holding the 99th
percentile to the target costs the long prompt's time to first token a third or more: an aim
below the target learned from overruns gave p99 2.56-2.61x for 36-66% more, a share of 1.2
p99 2.27-2.31x for 58% more (deep in a prompt a fixed part of most of the target makes every
token trimmed from a chunk dear). So the pacer aims at the target itself.

The size comes from measured step times, not from a guess: prefill and decode costs differ
by orders of magnitude between a CPU and a GPU, and with the prompt's length. The pacer
fits the prefill part's cost as fixed + per_token * chunk to the recent steps (the fixed
part: every weight read once, and on a GPU the launches of an eager, uncaptured forward),
and takes the largest chunk within the target. Where the fixed cost alone exceeds the
target, no chunk keeps to it, and a small chunk only makes the stall more frequent: the
chunk is then the one whose tokens cost as much as the fixed cost, so a stall is at most
twice the unavoidable one and prompts move at least half as fast as in whole chunks.
(Measured before this rule: 1.5B on an H100, an eager prefill step costs ~25-35 ms, more
than the target; chunks shrank to MIN_CHUNK tokens, and a request arriving while 31 others
decoded waited seconds to start: plain decoding at concurrency 32 ran at 450 tok/s instead
of ~4000.)

Until the recent chunks differ enough in size to separate the two costs, the whole cost is
taken per token (the chunk grows from MIN_CHUNK while a step is cheap); a chunk stuck at
MIN_CHUNK with no fit yet doubles to find the slope. A fit reaches at most twice beyond the
largest chunk measured.

On a busy CPU, and deep into a long prompt, three things misled it (a 4k-token prompt
beside 8 streams of a 135M model: stream gaps of 8-27x the usual one, against 2.5x):
- Costs drift: deep into a prompt every token also attends to the whole prefix (~4 ms a
  prompt token at depth 0, ~6.5 ms at depth 3,000: CPU time at one thread). While recent chunks all have one size,
  the last fit's slope was kept and the drift charged to its fixed part alone, which then
  looked like a fixed cost above the target: chunks grew to amortize it, each larger chunk
  raised the estimate again, and steps reached 3-4x the target with no noise at all. Both
  parts of the last fit are now scaled together to the recent steps (so the chunk that
  amortizes a fixed part stays what the fit said).
- Other processes make some steps 2-3x slower, never faster. A least-squares line through
  such steps put the fixed part above the target with a slope near zero, and the amortizing
  chunk (fixed / slope) came out tens of tokens. The fit is now Theil-Sen (median slope over
  pairs of steps, median intercept), the scaling a median ratio, and an amortizing chunk is
  at most what the largest chunk's cost per token says costs twice the fixed part.
- One slow decode step raised the target through a moving average; the usual decode step
  is now the median of the recent ones.
A fit whose slope is zero (the sizes did not show in the costs) takes the whole cost per
token while the fixed part is within the target, which overstates a token's cost. Mixed
steps count only what they took beyond a plain decode step, so one runs first when none
was timed.
"""
from __future__ import annotations

import itertools
import statistics
from collections import deque

PREFILL_SHARE = 1.5      # the prefill part of a step, in decode steps: gaps about 2.5x the usual one
MIN_CHUNK = 4            # a long prompt always moves forward, however slow a prefill token is
# A prefill part may always take this long. On a GPU a decode step takes ~1-3 ms, and
# pacing prefill to 1.5 of that cuts chunks to ~100 tokens: new requests then take hundreds
# of steps to start and throughput at concurrency collapses. A 25 ms stall is below what a
# streaming reader notices; on a CPU, where steps take ~50-100 ms, the share rules.
MIN_PREFILL_S = 0.025
FIT_WINDOW = 8           # recent prefill parts the cost model is fitted to
MIN_SPREAD = 1.5         # chunk sizes must differ by this factor to separate fixed and per-token cost
DECODE_WINDOW = 8        # recent decode steps whose median is the usual one (one slow step does not move it)


class PrefillPacer:
    def __init__(self, max_chunk: int, share: float = PREFILL_SHARE, min_chunk: int = MIN_CHUNK):
        self.max_chunk = max_chunk
        self.share = share
        self.min_chunk = min(min_chunk, max_chunk)
        self.decode_step_s: float | None = None               # a plain decode step: the median of the recent ones
        self._decode_steps: deque[float] = deque(maxlen=DECODE_WINDOW)
        self._parts: deque[tuple[int, float]] = deque(maxlen=FIT_WINDOW)   # (prompt tokens, seconds)
        self._fit: tuple[float, float] | None = None          # (fixed s, s per prompt token) of the last fit

    def budget(self, decoding: bool) -> int:
        """Prompt tokens the next step may carry: all that fit one chunk when nobody decodes."""
        if not decoding:
            return self.max_chunk
        if self.decode_step_s is None or not self._parts:
            return self.min_chunk
        target = max(self.share * self.decode_step_s, MIN_PREFILL_S)
        if self._fit is None:
            tokens = self._proportional(target)
        else:
            tokens = self._from_fit(target)
        return max(self.min_chunk, min(self.max_chunk, tokens))

    def record(self, seconds: float, prefill_tokens: int, decode_reqs: int) -> None:
        """A step's wall time, with the prompt tokens it carried and the requests it decoded."""
        if prefill_tokens == 0:
            if decode_reqs:
                self._decode_steps.append(seconds)
                self.decode_step_s = statistics.median(self._decode_steps)
            return
        if decode_reqs:   # a mixed step: its prefill part is what it took beyond a decode step
            if self.decode_step_s is None:
                return
            seconds -= self.decode_step_s
        self._parts.append((prefill_tokens, max(seconds, 1e-9)))   # a step is never free
        self._refit()

    # --- the cost model ---
    def _refit(self) -> None:
        """Theil-Sen: the median slope over pairs of steps, the median intercept under it. A
        busy machine makes some steps 2-3x slower, never faster; least squares through such
        a step moved the fixed part above the target."""
        sizes = [tokens for tokens, _ in self._parts]
        if max(sizes) < MIN_SPREAD * min(sizes):
            return   # one size: the last fit stands, scaled to the recent steps in _scaled_fit
        slope = max(statistics.median((t2 - t1) / (c2 - c1) for (c1, t1), (c2, t2)
                                      in itertools.combinations(self._parts, 2) if c1 != c2), 0.0)
        self._fit = (max(statistics.median(t - slope * c for c, t in self._parts), 0.0), slope)

    def _scaled_fit(self) -> tuple[float, float]:
        """The last fit's fixed part and slope, both scaled by the recent steps' median ratio to it."""
        fixed, slope = self._fit
        if fixed + slope <= 0:
            return fixed, slope
        scale = statistics.median(t / (fixed + slope * c) for c, t in self._parts)
        return fixed * scale, slope * scale

    def _from_fit(self, target: float) -> int:
        fixed, slope = self._scaled_fit()
        reach = 2 * max(c for c, _ in self._parts)   # the fit is trusted near the sizes it saw
        if fixed >= target:
            # no chunk keeps to it: tokens that cost as much as the fixed part, at most where
            # the largest chunk's cost per token (which overstates a larger one's) says a
            # step costs twice the fixed part, so a slope that noise made small does not
            # make chunks many times that
            largest, largest_s = max(self._parts)
            amortizing = 2 * fixed * largest / largest_s
            if slope > 0:
                amortizing = min(amortizing, fixed / slope)
            return int(min(amortizing, reach))
        if slope <= 0:   # the sizes did not show in the costs: the whole cost per token
            return min(self._proportional(target), reach)
        return int(min((target - fixed) / slope, reach))

    def _proportional(self, target: float) -> int:
        """The whole cost per token. Stuck at the floor with no fit yet, double to find the slope."""
        last_tokens, last_s = self._parts[-1]
        per_token = sum(t for _, t in self._parts) / sum(c for c, _ in self._parts)
        tokens = int(min(target / per_token, self.max_chunk))
        if self._fit is None and tokens <= self.min_chunk and last_tokens <= self.min_chunk:
            return 2 * last_tokens
        return tokens
