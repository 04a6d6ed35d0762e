"""Workloads of fixed sizes, for comparing engines at model sizes served with random weights
(`--load-format dummy`), where the text means nothing and only the lengths do:

  random-N    N-token prompts, the run's output length, at every concurrency: decode throughput
              (output tok/s) at that input length
  prefill-N   one N-token prompt at a time, one token out: time to first token; the cell's
              tok_s is prefill throughput (prompt tokens per second of time to first token)
  context-N   N-token prompts, the run's output length, at every concurrency: decode speed with
              that much context; the cell's tok_s is the decode rate alone: concurrency x the
              output's tokens after the first over the mean request latency less that of
              one-token requests of other prompts of the same length (the prefill)

N is a token count, or thousands with k (2k = 2048); a prompt of 32k is cut to leave room
for the output (and 64 tokens) in a 32768-token context. The prompts are random token ids below the
tokenizer's base vocabulary (no special tokens), the same for every engine (a fixed seed).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

_NAME = re.compile(r"^(random|prefill|context)-(\d+)(k?)$")
# ids below this are left out: byte and control tokens of some vocabularies
_FIRST_ID = 100
# a long prompt leaves this much more than its output free: engines differ on whether prompt and
# output may fill the context exactly
_CONTEXT_MARGIN = 64


@dataclass(frozen=True)
class SizeWorkload:
    name: str
    kind: str
    prompt_len: int

    def max_tokens(self, output_len: int) -> int:
        return 1 if self.kind == "prefill" else output_len

    def context_needed(self, output_len: int) -> int:
        """Tokens a request of this workload holds in an engine, prompt, output and margin."""
        return self.prompt_len + self.max_tokens(output_len) + _CONTEXT_MARGIN

    def concurrencies(self, concurrencies: list[int]) -> list[int]:
        return [1] if self.kind == "prefill" else concurrencies

    def prompts(self, count: int, vocab_size: int, seed: int) -> list[list[int]]:
        rng = random.Random(f"{self.name}-{seed}")
        return [[rng.randrange(_FIRST_ID, vocab_size) for _ in range(self.prompt_len)] for _ in range(count)]

    def rate(self, concurrency: int, output_len: int, latency_ms: float, prefill_latency_ms: float) -> float | None:
        """What the cell's tok_s says for this kind (None: the output throughput as measured), from
        whole-request latencies, never from streamed text: random weights often answer with tokens
        that decode to nothing (a lone byte of a UTF-8 character, an id past the tokenizer's), which
        servers do not stream, so a first chunk of text comes late or never.
        prefill: latency_ms is the mean of one-token requests, which is the time to first token.
        context: latency_ms of requests of `output_len` tokens, prefill_latency_ms of one-token
        requests of the same lengths at the same concurrency; the difference is the decode."""
        if self.kind == "prefill":
            return self.prompt_len * 1000 / latency_ms if latency_ms > 0 else None
        if self.kind == "context":
            decode_ms = latency_ms - prefill_latency_ms
            return concurrency * (output_len - 1) * 1000 / decode_ms if decode_ms > 0 and output_len > 1 else None
        return None

    def needs_prefill_baseline(self) -> bool:
        return self.kind == "context"


def parse(name: str, output_len: int, context_length: int = 32768) -> SizeWorkload | None:
    """The size workload a name says (None for any other name); the prompt is cut to leave
    room for `output_len` tokens within `context_length`."""
    match = _NAME.match(name)
    if match is None:
        return None
    kind, count, thousands = match.groups()
    length = int(count) * (1024 if thousands else 1)
    if length <= 0:
        raise ValueError(f"workload {name}: the prompt length must be positive")
    room = context_length - (1 if kind == "prefill" else output_len) - _CONTEXT_MARGIN
    if room <= 0:
        raise ValueError(f"workload {name}: a context of {context_length} tokens leaves no room for the output")
    return SizeWorkload(name, kind, min(length, room))
