"""PrefillPacer: how many prompt tokens a step may carry while other requests decode.

A prefill chunk delays the next token of every decoding request by its own duration, so a
4k-token prompt prefilled in one go stalls every stream for as long as that takes (tens of
seconds on a CPU). While requests decode, chunks are sized so that the prefill part of a
step costs at most PREFILL_SHARE times a plain decode step: a stream then waits at most
(1 + PREFILL_SHARE) times its usual inter-token time, whether prefill steps alternate with
decode steps or ride inside them (mixed chunks).

The size comes from measured step times, not from a guess: prefill and decode costs differ
by orders of magnitude between a CPU and a GPU, and with the prompt's length. The
estimate is the measured seconds per prefill token at the chunk size last used (for a
prefill-only step its fixed cost is spread over its tokens, for a mixed step the decode
part is subtracted). Sizing the next chunk as share * decode_time / seconds_per_token
converges to the largest chunk that keeps to the share: with t(c) = a + b*c, the update
c' = share*d*c / t(c) has the fixed point t(c) = share*d, and is increasing and concave, so
it converges from any start (to MIN_CHUNK where even a tiny chunk costs more than the
share). Until both times are known it starts at MIN_CHUNK.

On a CPU a prefill step has a fixed cost about that of a decode step (every weight is
read once per forward), so alternating steps leave little room under 3x; mixed steps
(--enable-mixed-chunk), whose weight reads serve both, leave more. Their prefill part is
measured against a plain decode step, so one runs first when none was timed. Deep into a
long prompt a chunk has a fixed cost of its own (attending to the whole prefix: ~150 ms at
4k tokens on one CPU core with torch_native), which no chunk size removes; MIN_CHUNK keeps
the prompt moving by more than a token per such step (at 1, a 4k prompt took 8x longer).
"""
from __future__ import annotations

PREFILL_SHARE = 1.5      # the prefill part of a step, in decode steps: gaps stay within 2.5x the usual one
MIN_CHUNK = 4            # a long prompt always moves forward, however slow a prefill token is
# A prefill part may always take this long. On a GPU a decode step takes ~1-3 ms, and
# pacing prefill to 1.5 of that cuts chunks to ~100 tokens: new requests then take hundreds
# of steps to start and throughput at concurrency collapses (measured: 1.5B on an H100,
# plain decoding at concurrency 32 fell below its batch-1 rate). A 25 ms stall is below
# what a streaming reader notices; on a CPU, where steps take ~50-100 ms, the share rules.
MIN_PREFILL_S = 0.025
_SMOOTHING = 0.5         # weight of the newest measurement in the moving averages


class PrefillPacer:
    def __init__(self, max_chunk: int, share: float = PREFILL_SHARE, min_chunk: int = MIN_CHUNK):
        self.max_chunk = max_chunk
        self.share = share
        self.min_chunk = min(min_chunk, max_chunk)
        self.decode_step_s: float | None = None          # a plain decode step
        self.prefill_token_s: float | None = None        # the prefill part of a step, per token

    def budget(self, decoding: bool) -> int:
        """Prompt tokens the next step may carry: all that fit one chunk when nobody decodes."""
        if not decoding:
            return self.max_chunk
        if self.decode_step_s is None or self.prefill_token_s is None:
            return self.min_chunk
        tokens = max(self.share * self.decode_step_s, MIN_PREFILL_S) / self.prefill_token_s
        return max(self.min_chunk, min(self.max_chunk, int(min(tokens, self.max_chunk))))

    def record(self, seconds: float, prefill_tokens: int, decode_reqs: int) -> None:
        """A step's wall time, with the prompt tokens it carried and the requests it decoded."""
        if prefill_tokens == 0:
            if decode_reqs:
                self.decode_step_s = _average(self.decode_step_s, seconds)
            return
        if decode_reqs:   # a mixed step: its prefill part is what it took beyond a decode step
            if self.decode_step_s is None:
                return
            seconds -= self.decode_step_s
        # a step can never be free; a floor keeps noise from promising huge chunks
        per_token = max(seconds, 1e-6) / prefill_tokens
        self.prefill_token_s = _average(self.prefill_token_s, per_token)


def _average(current: float | None, new: float) -> float:
    return new if current is None else (1 - _SMOOTHING) * current + _SMOOTHING * new
