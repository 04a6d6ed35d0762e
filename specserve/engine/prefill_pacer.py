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
largest chunk measured. When recent chunks all have one size, the last slope is kept and
the fixed part re-anchored to them, so costs that drift (attention deep into a long
prompt) still move the size. Mixed steps count only what they took beyond a plain decode
step, so one runs first when none was timed.
"""
from __future__ import annotations

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
_SMOOTHING = 0.5         # weight of the newest decode step in its moving average


class PrefillPacer:
    def __init__(self, max_chunk: int, share: float = PREFILL_SHARE, min_chunk: int = MIN_CHUNK):
        self.max_chunk = max_chunk
        self.share = share
        self.min_chunk = min(min_chunk, max_chunk)
        self.decode_step_s: float | None = None               # a plain decode step
        self._parts: deque[tuple[int, float]] = deque(maxlen=FIT_WINDOW)   # (prompt tokens, seconds)
        self._slope: float | None = None                      # seconds per prompt token, from the last fit

    def budget(self, decoding: bool) -> int:
        """Prompt tokens the next step may carry: all that fit one chunk when nobody decodes."""
        if not decoding:
            return self.max_chunk
        if self.decode_step_s is None or not self._parts:
            return self.min_chunk
        target = max(self.share * self.decode_step_s, MIN_PREFILL_S)
        if self._slope is None:
            tokens = self._proportional(target)
        else:
            tokens = self._from_fit(target)
        return max(self.min_chunk, min(self.max_chunk, tokens))

    def record(self, seconds: float, prefill_tokens: int, decode_reqs: int) -> None:
        """A step's wall time, with the prompt tokens it carried and the requests it decoded."""
        if prefill_tokens == 0:
            if decode_reqs:
                self.decode_step_s = seconds if self.decode_step_s is None else (
                    (1 - _SMOOTHING) * self.decode_step_s + _SMOOTHING * seconds)
            return
        if decode_reqs:   # a mixed step: its prefill part is what it took beyond a decode step
            if self.decode_step_s is None:
                return
            seconds -= self.decode_step_s
        self._parts.append((prefill_tokens, max(seconds, 1e-9)))   # a step is never free
        self._refit()

    # --- the cost model ---
    def _refit(self) -> None:
        sizes = [tokens for tokens, _ in self._parts]
        if max(sizes) < MIN_SPREAD * min(sizes):
            return   # one size: the last slope stands (the fixed part re-anchors in _fixed_cost)
        mean_c = sum(sizes) / len(sizes)
        mean_t = sum(t for _, t in self._parts) / len(self._parts)
        covariance = sum((c - mean_c) * (t - mean_t) for c, t in self._parts)
        variance = sum((c - mean_c) ** 2 for c in sizes)
        self._slope = max(covariance / variance, 0.0)

    def _fixed_cost(self) -> float:
        """The fixed part that, with the slope, matches the recent steps on average."""
        mean_c = sum(c for c, _ in self._parts) / len(self._parts)
        mean_t = sum(t for _, t in self._parts) / len(self._parts)
        return max(mean_t - self._slope * mean_c, 0.0)

    def _from_fit(self, target: float) -> int:
        fixed = self._fixed_cost()
        reach = 2 * max(c for c, _ in self._parts)   # the fit is trusted near the sizes it saw
        if self._slope <= 0:
            return reach
        return int(min(max(target - fixed, fixed) / self._slope, reach))

    def _proportional(self, target: float) -> int:
        """No slope yet: the whole cost per token. Stuck at the floor, double to find the slope."""
        last_tokens, last_s = self._parts[-1]
        per_token = sum(t for _, t in self._parts) / sum(c for c, _ in self._parts)
        tokens = int(min(target / per_token, self.max_chunk))
        if tokens <= self.min_chunk and last_tokens <= self.min_chunk:
            return 2 * last_tokens
        return tokens
