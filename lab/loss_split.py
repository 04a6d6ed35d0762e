"""Where a speculative configuration's run loses time to plain, cell by cell, from the step
mix the suite records (gpu_suite: `step_mix`, the steps of each kind and their wall time).

A speculative run against plain's run of the same round differs in three ways, and each
asks for a different fix:

- drafting: its drafting steps' time less that of the plain steps they stood in for (plain's
  plain steps less its own, at plain's time a step): an episode that the policy misjudged;
- prefills: more or longer prefill steps (requests that drafted end apart, so the next ones
  arrive apart and prefill in smaller groups);
- plain steps: its own plain steps' cost over plain's, times their number (the drafter's
  and the policy's host work per step, or another batch mix);

and the rest is what the step mix does not time (the scheduler's idle gaps, the first
steps). Session 25 read the 0.5B's worst chat cells so: not host-bound plain steps, as
an earlier trace had it, but drafting episodes at accept 1.1-1.3 and the prefills they
spread (BENCHMARKS.md).

`python -m lab.loss_split results.jsonl...` prints the table; gpu_suite's
table.md ends with it.
"""
from __future__ import annotations

import collections
import json
import statistics
import sys

PARTS = ("drafting", "prefills", "plain_steps", "rest")


def split_run(run: dict, plain: dict) -> dict[str, float]:
    """Milliseconds `run` took over `plain` (the same cell and round), in PARTS and "total"."""
    mix, base = run["step_mix"], plain["step_mix"]
    plain_each = base["plain"]["ms"] / base["plain"]["steps"] if base["plain"]["steps"] else 0.0
    run_each = mix["plain"]["ms"] / mix["plain"]["steps"] if mix["plain"]["steps"] else plain_each
    replaced = base["plain"]["steps"] - mix["plain"]["steps"]
    parts = {"drafting": mix["draft"]["ms"] - replaced * plain_each,
             "prefills": mix["prefill"]["ms"] - base["prefill"]["ms"],
             "plain_steps": mix["plain"]["steps"] * (run_each - plain_each),
             "total": 1e3 * (run["duration_s"] - plain["duration_s"])}
    parts["rest"] = parts["total"] - sum(parts[p] for p in PARTS[:-1])
    return parts


def loss_rows(rows: list[dict]) -> list[dict]:
    """Per (model, workload, turn, concurrency, config) that ran slower than plain in the
    mean of its rounds: the mean split over its rounds, its drafting steps' mean count, wall
    time each and accept length, and the plain steps' time each in both runs. Worst first."""
    cells = (_cell(key, pairs) for key, pairs in _paired_runs(rows).items() if pairs)
    return sorted((cell for cell in cells if cell["total"] > 0), key=lambda cell: -cell["total"] / cell["plain_ms"])


def _paired_runs(rows: list[dict]) -> dict[tuple, list[tuple[dict, dict]]]:
    """(model, workload, turn, concurrency, config) -> [(its run, plain's run of that round)]:
    the i-th run of a round beside plain's i-th (several suite runs appended to one file)."""
    rounds = collections.defaultdict(dict)
    for row in rows:
        if row.get("kind") == "specserve" and "step_mix" in row:
            key = (row["model"], row["workload"], row.get("turn", 1), row["concurrency"], row.get("round", 0))
            rounds[key].setdefault(row["config"], []).append(row)
    cells = collections.defaultdict(list)
    for (*cell, _), runs in rounds.items():
        for config, measured in runs.items():
            if config != "plain":
                cells[(*cell, config)] += list(zip(measured, runs.get("plain", [])))
    return cells


def _cell(key: tuple, pairs: list[tuple[dict, dict]]) -> dict:
    model, workload, turn, concurrency, config = key
    splits = [split_run(run, plain) for run, plain in pairs]
    drafts = [run["step_mix"]["draft"] for run, _ in pairs]
    return {"model": model, "workload": workload, "turn": turn, "concurrency": concurrency, "config": config,
            "runs": len(pairs), **{part: statistics.fmean(s[part] for s in splits) for part in (*PARTS, "total")},
            "plain_ms": statistics.fmean(1e3 * plain["duration_s"] for _, plain in pairs),
            "draft_steps": statistics.fmean(d["steps"] for d in drafts), "draft_ms_each": _per_step(drafts),
            "accept_length": statistics.fmean(run.get("accept_length") or 1.0 for run, _ in pairs),
            "plain_step_ms": (_per_step([run["step_mix"]["plain"] for run, _ in pairs]),
                              _per_step([plain["step_mix"]["plain"] for _, plain in pairs]))}


def _per_step(mixes: list[dict]) -> float | None:
    steps = sum(m["steps"] for m in mixes)
    return sum(m["ms"] for m in mixes) / steps if steps else None


def markdown(rows: list[dict]) -> str:
    """The losing cells' table (an empty string if none lost)."""
    table = loss_rows(rows)
    if not table:
        return ""
    lines = ["**Where the cells slower than plain lose** (ms over plain's run, mean over rounds; "
             "lab/loss_split.py)", "",
             "| model | workload | turn | conc. | config | runs | plain run | lost | drafting (steps, ms each, "
             "accept) | prefills | plain steps (ms each: it / plain) | rest |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        each = "n/a" if r["draft_ms_each"] is None else f"{r['draft_ms_each']:.2f}"
        ours, theirs = (f"{v:.3f}" if v is not None else "n/a" for v in r["plain_step_ms"])
        lines.append(f"| {r['model']} | {r['workload']} | {r['turn']} | {r['concurrency']} | {r['config']} | "
                     f"{r['runs']} | {r['plain_ms']:.0f} | {r['total']:.1f} | {r['drafting']:.1f} "
                     f"({r['draft_steps']:.1f}, {each}, {r['accept_length']:.2f}) | {r['prefills']:.1f} | "
                     f"{r['plain_steps']:.1f} ({ours} / {theirs}) | {r['rest']:.1f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    results = [json.loads(line) for path in sys.argv[1:] for line in open(path) if line.strip()]
    print(markdown(results) or "no cell slower than plain")
