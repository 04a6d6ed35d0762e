"""Prefill stall: how long running streams wait for their next token while a long prompt
is prefilled (issue 11's target: with a 4k-token prompt arriving while 8 streams run, no
stream waits longer than 3x its usual inter-token time).

    python -m lab.prefill_stall [--streams 8] [--prompt-tokens 4000]
        [--modes alternate,mixed,unpaced] [--threads N] [ServerArgs flags, e.g. --dtype float32]

Per mode: 8 greedy streams decode; once each has produced WARMUP_TOKENS, the long prompt
arrives, and the gaps any stream sees until the prompt's first token are compared with the
usual gap: the median gap over BASELINE_S seconds before the prompt and BASELINE_S after
(the streams' contexts grow meanwhile, and decode steps with them). Modes, all in one engine: `alternate` (prefill chunks alternate with decode
steps, sized from measured step times), `mixed` (paced chunks ride in the decode steps,
--enable-mixed-chunk) and `unpaced` (whole chunks of --chunked-prefill-size between decode
steps; before pacing they also ran back to back). --threads sets torch's CPU threads (on a
machine shared with other jobs, 1 keeps OpenMP from spinning against them).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import threading
import time

from specserve.args import ServerArgs
from specserve.engine.prefill_pacer import PREFILL_SHARE

WARMUP_TOKENS = 8
BASELINE_S = 3.0
MODES = ("alternate", "mixed", "unpaced")


@dataclasses.dataclass
class StallResult:
    mode: str
    usual_gap_s: float           # median inter-token gap of the streams around the prompt
    worst_gap_s: float           # longest gap of any stream while the prompt was prefilled
    p99_gap_s: float             # 99th percentile of those gaps
    ttft_s: float                # the long prompt's time to first token

    @property
    def ratio(self) -> float:
        return self.worst_gap_s / self.usual_gap_s


class _Stream:
    """One streaming request, read on its own thread; keeps each chunk's arrival time."""

    def __init__(self, engine, prompt: str, max_new_tokens: int):
        self.times: list[float] = []
        self._iterator = engine.generate(prompt, {"temperature": 0.0, "max_new_tokens": max_new_tokens,
                                                  "ignore_eos": True}, stream=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for _ in self._iterator:
            self.times.append(time.perf_counter())
            if self._stop.is_set():
                break
        self._iterator.close()   # aborts the request

    def gaps(self, start: float, end: float) -> list[float]:
        inside = [t for t in self.times if start <= t <= end]
        before = [t for t in self.times if t < start][-1:]
        points = before + inside
        gaps = [b - a for a, b in zip(points, points[1:])]
        later = [t for t in self.times if t > end][:1]
        # a gap still open at `end` counts up to when it closed (or until now)
        if points:
            gaps.append((later[0] if later else time.perf_counter()) - points[-1])
        return gaps

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def measure(engine, mode: str, streams: int, prompt_tokens: int) -> StallResult:
    running = [_Stream(engine, f"Story {i}: once upon a time", 100_000) for i in range(streams)]
    try:
        while min(len(s.times) for s in running) < WARMUP_TOKENS:
            time.sleep(0.01)
        baseline_start = time.perf_counter()
        time.sleep(BASELINE_S)
        arrival = time.perf_counter()
        # token ids spread over the vocabulary, no repeats that a cache could shortcut
        vocab = engine.core.runner.config.vocab_size
        long_prompt = [(i * 7919) % (vocab - 1000) + 500 for i in range(prompt_tokens)]
        engine.generate(input_ids=long_prompt, sampling_params={"temperature": 0.0, "max_new_tokens": 1})
        first_token = time.perf_counter()
        time.sleep(BASELINE_S)
        usual = statistics.median(g for s in running for window in ((baseline_start, arrival),
                                  (first_token, first_token + BASELINE_S)) for g in s.gaps(*window)[:-1])
        stalls = sorted(g for s in running for g in s.gaps(arrival, first_token))
    finally:
        for stream in running:
            stream.stop()
    return StallResult(mode, usual, stalls[-1], stalls[int(0.99 * (len(stalls) - 1))], first_token - arrival)


def _configure(engine, mode: str) -> None:
    scheduler = engine.core.scheduler
    scheduler.mixed_chunk = mode == "mixed"
    scheduler.pacer.share = math.inf if mode == "unpaced" else PREFILL_SHARE


def main(argv: list[str] | None = None) -> list[StallResult]:
    parser = argparse.ArgumentParser(prog="python -m lab.prefill_stall", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    modes = ns.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown mode(s) {unknown}; choose from {MODES}")
    if ns.threads:
        import torch
        torch.set_num_threads(ns.threads)
    from specserve.engine.engine import Engine
    server_args = ServerArgs.from_cli_args(ns).replace(log_level="warning")
    results = []
    with Engine(**dataclasses.asdict(server_args)) as engine:
        for mode in modes:
            _configure(engine, mode)
            result = measure(engine, mode, ns.streams, ns.prompt_tokens)
            results.append(result)
            print(f"{mode:<9} usual gap {result.usual_gap_s * 1000:6.1f} ms   worst {result.worst_gap_s * 1000:8.1f} ms"
                  f" ({result.ratio:5.2f}x)   p99 {result.p99_gap_s * 1000:7.1f} ms "
                  f"({result.p99_gap_s / result.usual_gap_s:5.2f}x)   long prompt TTFT {result.ttft_s:6.1f} s", flush=True)
    return results


if __name__ == "__main__":
    main()
