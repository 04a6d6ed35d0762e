"""PrefillPacer: how many prompt tokens a step may carry while other requests decode.

A prefill chunk delays the next token of every decoding request by its own duration, so a
4k-token prompt prefilled in one go stalls every stream for as long as that takes (tens of
seconds on a CPU). While requests decode, chunks are sized so that the prefill part of a
step costs at most a target: PREFILL_SHARE times a plain decode step, and never less than
MIN_PREFILL_S. A stream then waits at most (1 + PREFILL_SHARE) times its usual inter-token
time, whether prefill steps alternate with decode steps or ride inside them (mixed chunks).

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

On a busy CPU, and deep into a long prompt, these misled it (a 4k-token prompt
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
  pairs of steps, median intercept), the scaling a quantile of ratios (not a mean), and an amortizing chunk is
  at most what the largest chunk's cost per token says costs twice the fixed part.
- One slow decode step raised the target through a moving average. The usual decode step
  is now the lower quartile of the last DECODE_WINDOW (and the prefill parts are read at
  theirs, see _scaled_fit): other processes only lengthen steps,
  and with speculation a decode step is a verify step whose cost depends on its drafts
  (NGRAM on a CPU: ~110 ms, ~200 ms with many, the adaptive policy's choice, prefill or
  not). Where the dear kind made half of the last eight, their median put the target at
  it, and chunks cost up to 2.4x the usual step of CPU time.
Two more, under load (a busy 2-core machine: CPU-time gaps of 4.7x at p99, 5.6x worst):
- A load that rose while chunks shrank made smaller chunks cost more: the fit's slope came
  out zero, or a fraction of a token's cost, and its fixed part above the target, and the
  rule for a fixed cost no chunk keeps to grew the chunk to 2x (steps 4.6x a decode step of
  CPU time). That rule now needs a positive slope, a fixed part above the target even under
  the steep end of the pairs' slopes (their upper quartile), and every recent step above
  the target; otherwise the fit's fixed part is not trusted and the whole cost per token is.
- At a prompt's start the chunks measured were the streams' short prompts: a few rows are
  memory-bound and cost little each, more rows pay their compute, so a line through small
  chunks underpriced one twice their size (40-60 tokens at ~2x the target). Beyond the
  largest chunk measured, a token now costs what that chunk's did on average (never less
  for a larger chunk, whatever the shape between memory- and compute-bound).
And on an idle machine chunks went over the target by 10-25% where the cost steps with a
matrix tile (a 33-token chunk 18% dearer than a 32-token one) and the line through recent
chunks does not: while overruns are rare, no chunk is now as large as one that overran
(beyond OVERRUN_MARGIN) in the last OVERRUN_WINDOW.
A fit whose slope is zero (the sizes did not show in the costs) takes the whole cost per
token, which overstates a token's cost while a fixed part is within the target. Mixed
steps count only what they took beyond a usual decode step, so one runs first when none
was timed.
"""
from __future__ import annotations

import itertools
import statistics
from collections import deque

PREFILL_SHARE = 1.5      # the prefill part of a step, in decode steps: gaps stay within 2.5x the usual one
MIN_CHUNK = 4            # a long prompt always moves forward, however slow a prefill token is
# A prefill part may always take this long. On a GPU a decode step takes ~1-3 ms, and
# pacing prefill to 1.5 of that cuts chunks to ~100 tokens: new requests then take hundreds
# of steps to start and throughput at concurrency collapses. A 25 ms stall is below what a
# streaming reader notices; on a CPU, where steps take ~50-100 ms, the share rules.
MIN_PREFILL_S = 0.025
FIT_WINDOW = 8           # recent prefill parts the cost model is fitted to
MIN_SPREAD = 1.5         # chunk sizes must differ by this factor to separate fixed and per-token cost
# recent prefill parts whose overruns bound the chunk: a prompt's tokens cost more as it goes
# deeper, so a size that overran stays over
OVERRUN_WINDOW = 64
OVERRUN_MARGIN = 0.05    # a chunk's cost varies this much on an idle CPU; a matrix tile more costs 10-20%
DECODE_WINDOW = 16       # recent decode steps whose lower quartile is the usual one (see the docstring)


class PrefillPacer:
    def __init__(self, max_chunk: int, share: float = PREFILL_SHARE, min_chunk: int = MIN_CHUNK):
        self.max_chunk = max_chunk
        self.share = share
        self.min_chunk = min(min_chunk, max_chunk)
        self.decode_step_s: float | None = None               # the usual decode step: see the docstring
        self._decode_steps: deque[float] = deque(maxlen=DECODE_WINDOW)
        self._parts: deque[tuple[int, float]] = deque(maxlen=FIT_WINDOW)   # (prompt tokens, seconds)
        self._history: deque[tuple[int, float]] = deque(maxlen=OVERRUN_WINDOW)
        # (fixed s, s per prompt token, the fixed part under a steep slope) of the last fit
        self._fit: tuple[float, float, float] | None = None

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
                self.decode_step_s = sorted(self._decode_steps)[(len(self._decode_steps) - 1) // 4]
            return
        if decode_reqs:   # a mixed step: its prefill part is what it took beyond a decode step
            if self.decode_step_s is None:
                return
            seconds -= self.decode_step_s
        self._parts.append((prefill_tokens, max(seconds, 1e-9)))   # a step is never free
        self._history.append(self._parts[-1])
        self._refit()

    # --- the cost model ---
    def _refit(self) -> None:
        """Theil-Sen: the median slope over pairs of steps, the median intercept under it. A
        busy machine makes some steps 2-3x slower, never faster; least squares through such
        a step moved the fixed part above the target."""
        sizes = [tokens for tokens, _ in self._parts]
        if max(sizes) < MIN_SPREAD * min(sizes):
            return   # one size: the last fit stands, scaled to the recent steps in _scaled_fit
        slopes = sorted((t2 - t1) / (c2 - c1) for (c1, t1), (c2, t2) in itertools.combinations(self._parts, 2)
                        if c1 != c2)
        slope = max(statistics.median(slopes), 0.0)
        steep = max(slopes[3 * (len(slopes) - 1) // 4], slope)   # the upper quartile
        intercept = lambda s: max(statistics.median(t - s * c for c, t in self._parts), 0.0)
        self._fit = (intercept(slope), slope, intercept(steep))

    def _scaled_fit(self) -> tuple[float, float, float]:
        """The last fit, all its parts scaled by the recent steps' lower-quartile ratio to it: the
        statistic of the usual decode step, so that under a load which slows steps at random
        both are read at their unslowed level (read at its median against the decode step's
        lower quartile, a prefill part looked dearer than it was: under a load of ~5 on 2 cores
        chunks went down to MIN_CHUNK and a 4k prompt took over 7 minutes, 2 before)."""
        fixed, slope, fixed_low = self._fit
        if fixed + slope <= 0:
            return self._fit
        scale = sorted(t / (fixed + slope * c) for c, t in self._parts)[(len(self._parts) - 1) // 4]
        return fixed * scale, slope * scale, fixed_low * scale

    def _from_fit(self, target: float) -> int:
        fixed, slope, fixed_low = self._scaled_fit()
        reach = 2 * max(c for c, _ in self._parts)   # the fit is trusted near the sizes it saw
        if fixed_low >= target and slope > 0 and min(t for _, t in self._parts) >= target:
            # no chunk keeps to it: tokens that cost as much as the fixed part, at most where
            # the largest chunk's cost per token (which overstates a larger one's) says a
            # step costs twice the fixed part, so a slope that noise made small does not
            # make chunks many times that
            largest, largest_s = max(self._parts)
            return int(min(2 * fixed * largest / largest_s, fixed / slope, reach))
        if fixed >= target or slope <= 0:
            # the sizes did not show in the costs, or steps measured kept to a target the fit's
            # fixed part says no chunk keeps to (other processes slowed the smaller ones): the
            # whole cost per token
            return self._below_overruns(min(self._proportional(target), reach), target)
        tokens = (target - fixed) / slope
        largest, largest_s = max(self._parts)
        if tokens > largest:
            # beyond the sizes measured, a token costs what the largest chunk's do (a line through
            # smaller chunks, whose few rows are memory-bound, underprices a larger one's)
            largest_s = max(largest_s, fixed + slope * largest)
            tokens = min(tokens, max(largest, largest * target / largest_s))
        return self._below_overruns(int(min(tokens, reach)), target)

    def _below_overruns(self, tokens: int, target: float) -> int:
        """Fewer tokens than any recent chunk that overran the target: a larger chunk costs no
        less. A line misses steps in the cost (on a CPU a 33-token chunk took 18% longer than a
        32-token one, a matrix tile more), and chunks priced at the line's median ratio to the
        recent steps went over the target whenever they met one. Only while overruns are rare:
        under a load that slows steps at random, every size overruns now and then, and chunks
        bounded by each overrun ratcheted down to MIN_CHUNK (a 4k prompt then took minutes)."""
        limit = (1 + OVERRUN_MARGIN) * target
        over = [c for c, t in self._history if t > limit]
        if len(over) > max(2, len(self._history) // 8):
            return tokens
        return min([c - 1 for c in over if c <= tokens], default=tokens)

    def _proportional(self, target: float) -> int:
        """The whole cost per token. Stuck at the floor with no fit yet, double to find the slope."""
        last_tokens, last_s = self._parts[-1]
        per_token = sum(t for _, t in self._parts) / sum(c for c, _ in self._parts)
        tokens = int(min(target / per_token, self.max_chunk))
        if self._fit is None and tokens <= self.min_chunk and last_tokens <= self.min_chunk:
            return 2 * last_tokens
        return tokens
