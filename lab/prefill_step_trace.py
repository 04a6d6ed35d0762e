"""Prefill step trace: every step the engine runs while a long prompt is prefilled beside
running streams, with the pacer's view of it, to see where a stream's gap goes.

    python -m lab.prefill_step_trace [--streams 8] [--prompt-tokens 4000] [--threads N]
        [--out trace.tsv] [ServerArgs flags, e.g. --speculative-algorithm NGRAM]

Runs lab.prefill_stall's scenario once (the default, alternating mode) and prints, per 500
tokens of the long prompt's depth, the prefill steps' chunk and wall and CPU time against
the pacer's target, so a cost that grows with the prefix (not with the chunk) stands out,
and over the usual decode step's CPU time the gap around each prefill step and the gap its
prefill part alone makes (what the pacer decides; with speculation the verify steps vary
by themselves). lab.prefill_pacer_replay replays a trace through the pacer as it now is.
--out writes every step: wall time, the step thread's CPU time (with --threads 1 all of
its compute), the prompt tokens and decoding requests it carried, the depth (tokens
cached before it), the pacer's target and its (fixed, per-token) fit.
"""
from __future__ import annotations

import argparse
import bisect
import dataclasses
import statistics
import time

from lab.prefill_stall import measure
from specserve.args import ServerArgs
from specserve.engine.prefill_pacer import MIN_PREFILL_S


@dataclasses.dataclass
class StepRow:
    at_s: float
    seconds: float
    cpu_s: float          # the step loop thread's CPU time (all of the step's compute at --threads 1)
    prefill_tokens: int
    decode_reqs: int
    depth: int            # the deepest prompt's cached tokens before the step
    target_s: float
    fit: tuple[float, float] | None   # the pacer's (fixed s, s per token) when the step was recorded


def trace_steps(engine, rows: list[StepRow]) -> None:
    """Wraps the scheduler's timing hook so every timed step lands in `rows`."""
    scheduler = engine.core.scheduler
    pacer = scheduler.pacer
    original_schedule, original_record = scheduler.schedule, scheduler.record_step_time
    depth_before = [0]
    cpu_start = [time.thread_time()]
    start = time.perf_counter()

    def schedule():
        cpu_start[0] = time.thread_time()
        batch = original_schedule()
        if batch is not None and batch.is_extend:
            depth_before[0] = max(r.kv_len for r in batch.reqs)
        return batch

    def record(seconds: float) -> None:
        if scheduler._last_step is not None:
            tokens, decoding = scheduler._last_step
            target = max(pacer.share * (pacer.decode_step_s or 0.0), MIN_PREFILL_S)
            rows.append(StepRow(time.perf_counter() - start, seconds, time.thread_time() - cpu_start[0], tokens, decoding,
                                depth_before[0] if tokens else 0, target, pacer._fit))
        original_record(seconds)

    scheduler.schedule = schedule
    scheduler.record_step_time = record


def _usual_decode_cpu(rows: list[StepRow], around: int) -> list[tuple[int, int, float]]:
    """Per prefill step after a decode step: (its index, the decode step's before it, the median
    CPU time of the `around` decode steps either side)."""
    decode_at = [i for i, r in enumerate(rows) if not r.prefill_tokens and r.decode_reqs]
    out = []
    for i, row in enumerate(rows):
        k = bisect.bisect_left(decode_at, i)
        if row.prefill_tokens and k:
            near = decode_at[max(0, k - around):k + around]
            out.append((i, decode_at[k - 1], statistics.median(rows[j].cpu_s for j in near)))
    return out


def cpu_gap_ratios(rows: list[StepRow], around: int = 10) -> list[float]:
    """Per prefill step: the streams' gap in CPU time (the decode step before it plus the
    step) over the median decode step among the `around` decode steps either side. What
    the pacer decides, without the time other processes took (at --threads 1)."""
    return [(rows[before].cpu_s + rows[i].cpu_s) / usual for i, before, usual in _usual_decode_cpu(rows, around)]


def prefill_part_ratios(rows: list[StepRow], around: int = 10) -> list[float]:
    """Per prefill step: 1 + its CPU time over the usual decode step's (as in cpu_gap_ratios),
    the gap the prefill makes of a usual step. With speculation the decode steps themselves
    vary (a verify step of many drafts costs several plain ones, prefill or not), and the
    gap above also counts how long the step before happened to be; this counts only what
    the pacer decided."""
    return [1 + rows[i].cpu_s / usual for i, _, usual in _usual_decode_cpu(rows, around)]


def _spread(ratios: list[float]) -> str:
    ratios = sorted(ratios)
    return (f"worst {ratios[-1]:.2f}x, p99 {ratios[int(0.99 * (len(ratios) - 1))]:.2f}x, "
            f"median {statistics.median(ratios):.2f}x" if ratios else "none")


def gap_summary(rows: list[StepRow]) -> str:
    """The CPU-time gap around prefill steps, and the prefill part's alone, over the usual decode step."""
    return f"CPU-time gap {_spread(cpu_gap_ratios(rows))}; prefill part {_spread(prefill_part_ratios(rows))}"


def summarize(rows: list[StepRow]) -> None:
    prefill = [r for r in rows if r.prefill_tokens]
    decode = [r for r in rows if not r.prefill_tokens and r.decode_reqs]
    if decode:
        print(f"decode steps: {len(decode)}, median {statistics.median(r.seconds for r in decode) * 1000:.1f} ms"
              f" (CPU {statistics.median(r.cpu_s for r in decode) * 1000:.1f} ms)")
    print(f"over the usual decode step: {gap_summary(rows)}")
    print("depth      steps  chunk  prefill-step ms (mean / max)  CPU ms (mean)  target ms")
    for low in range(0, max((r.depth for r in prefill), default=0) + 1, 500):
        band = [r for r in prefill if low <= r.depth < low + 500]
        if band:
            print(f"{low:5d}-{low + 499:<5d} {len(band):5d} {statistics.mean(r.prefill_tokens for r in band):6.1f}"
                  f"  {statistics.mean(r.seconds for r in band) * 1000:8.1f} / {max(r.seconds for r in band) * 1000:8.1f}"
                  f"  {statistics.mean(r.cpu_s for r in band) * 1000:8.1f}     {statistics.mean(r.target_s for r in band) * 1000:6.1f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lab.prefill_step_trace", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None, help="write every step as a TSV row here")
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    if ns.threads:
        import torch
        torch.set_num_threads(ns.threads)
    from specserve.engine.engine import Engine
    server_args = ServerArgs.from_cli_args(ns).replace(log_level="warning")
    rows: list[StepRow] = []
    with Engine(**dataclasses.asdict(server_args)) as engine:
        trace_steps(engine, rows)
        result = measure(engine, "alternate", ns.streams, ns.prompt_tokens)
    print(f"usual gap {result.usual_gap_s * 1000:.1f} ms, worst {result.worst_gap_s * 1000:.1f} ms "
          f"({result.ratio:.2f}x), long prompt TTFT {result.ttft_s:.1f} s")
    summarize(rows)
    if ns.out:
        with open(ns.out, "w") as f:
            f.write("at_s\tseconds\tcpu_s\tprefill_tokens\tdecode_reqs\tdepth\ttarget_s\tfit\n")
            for r in rows:
                f.write(f"{r.at_s:.3f}\t{r.seconds:.4f}\t{r.cpu_s:.4f}\t{r.prefill_tokens}\t{r.decode_reqs}\t{r.depth}"
                        f"\t{r.target_s:.4f}\t{r.fit}\n")


if __name__ == "__main__":
    main()
