"""Prefill pacer replay: a step trace (lab.prefill_step_trace --out) replayed through the
pacer as the code now stands, to see what its chunks would have made of the same machine.

    python -m lab.prefill_pacer_replay trace.tsv [trace2.tsv ...]

The long prompt's prefill steps give a CPU-time cost model, fixed + per token, each growing
with depth (least squares; a trace from an idle machine gives the cleanest one). Replayed in
order: decode steps as recorded (wall time to the pacer, CPU time to the metric), and the
prefill step after each at the chunk the pacer picks, its CPU time from the model times the
CPU noise of the recorded prefill step nearest in time, its wall time that times the
recorded step's wall / CPU ratio (the load it met). What the pacer reads and what the
streams pay then come out as in the trace (lab.prefill_step_trace's CPU-time gap and
prefill part), for the pacer as it now is. Fed the pacer that recorded them, traces of an
idle machine came back within 0.05x of the recorded figures; a loaded machine's came back
worse than recorded (5.6x worst, replayed 10.1x: the load a small chunk met, put on a large
one), so under load a replay only ranks pacers, the engine's own run measures them.
The model is a line: the few-row steps at a prompt's start, cheaper per token than a line
says, are not in it.
"""
from __future__ import annotations

import argparse
import bisect
import csv
import statistics

import torch

from lab.prefill_step_trace import StepRow, gap_summary
from specserve.engine.prefill_pacer import MIN_PREFILL_S, PrefillPacer


def read_trace(path: str) -> list[StepRow]:
    with open(path) as f:
        return [StepRow(float(r["at_s"]), float(r["seconds"]), float(r["cpu_s"]), int(r["prefill_tokens"]),
                        int(r["decode_reqs"]), int(r["depth"]), float(r["target_s"]), None)
                for r in csv.DictReader(f, delimiter="\t")]


def long_prompt_steps(rows: list[StepRow]) -> list[StepRow]:
    """The long prompt's prefill steps: from the last chunk at depth 0 (the streams' prompts come first)."""
    start = max(i for i, r in enumerate(rows) if r.prefill_tokens and r.depth == 0)
    return [r for r in rows[start:] if r.prefill_tokens]


def cost_model(steps: list[StepRow]):
    """CPU seconds of a chunk at a depth: (a + b * depth) + chunk * (c + d * depth), least squares."""
    x = torch.tensor([[1.0, r.depth, r.prefill_tokens, r.prefill_tokens * r.depth] for r in steps], dtype=torch.float64)
    y = torch.tensor([r.cpu_s for r in steps], dtype=torch.float64)
    a, b, c, d = torch.linalg.lstsq(x, y).solution.tolist()
    return lambda chunk, depth: max(a + b * depth, 0.0) + chunk * (c + d * depth)


def replay(rows: list[StepRow], model, prompt_tokens: int) -> tuple[list[StepRow], int]:
    """The trace's steps with the pacer's chunks in place of the recorded ones: (rows, prefill steps)."""
    prefill = long_prompt_steps(rows)
    first = rows.index(prefill[0])
    noise = [(r.cpu_s / model(r.prefill_tokens, r.depth), r.seconds / r.cpu_s) for r in prefill]
    times = [r.at_s for r in prefill]
    decode = [r for r in rows[first:] if not r.prefill_tokens]
    pacer = PrefillPacer(max_chunk=8192)
    for r in rows[:first]:
        pacer.record(r.seconds, r.prefill_tokens, r.decode_reqs)
    out, depth, k = [], 0, 0
    for step in decode:
        pacer.record(step.seconds, 0, step.decode_reqs)
        out.append(step)
        if depth >= prompt_tokens:
            continue
        chunk = min(pacer.budget(decoding=True), prompt_tokens - depth)
        cpu_noise, load = noise[min(bisect.bisect_left(times, step.at_s), len(noise) - 1)]
        cpu = model(chunk, depth) * cpu_noise
        pacer.record(cpu * load, chunk, 0)
        target = max(pacer.share * pacer.decode_step_s, MIN_PREFILL_S)
        out.append(StepRow(step.at_s, cpu * load, cpu, chunk, 0, depth, target, None))
        depth, k = depth + chunk, k + 1
    return out, k


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lab.prefill_pacer_replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--model-from", default=None,
                        help="the trace whose steps give the cost model (default: each its own)")
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    ns = parser.parse_args(argv)
    fixed_model = cost_model(long_prompt_steps(read_trace(ns.model_from))) if ns.model_from else None
    for path in ns.traces:
        rows = read_trace(path)
        model = fixed_model or cost_model(long_prompt_steps(rows))
        recorded = gap_summary(rows[rows.index(long_prompt_steps(rows)[0]) - 1:])
        replayed, steps = replay(rows, model, ns.prompt_tokens)
        print(f"{path}\n  recorded: {recorded}, {len(long_prompt_steps(rows))} prefill steps"
              f"\n  replayed: {gap_summary(replayed)}, {steps} prefill steps")


if __name__ == "__main__":
    main()
