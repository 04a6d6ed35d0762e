"""Where a hybrid run's time goes, by kind of step, read from its policy trace
(`--policy-trace-dir` of bench.model_drafters, as `scripts/gpu_run.sh hybrid-rows` writes it).

A trace's step events carry a step's wall time and committed tokens but not its source; the
source choice just before a step says it (source_choice.SourceChoice's listener: a "choose"
whose `taken` is above 0 proposed trie drafts). So each timed step is one of:
- trie: a step with trie drafts, which the engine verifies on its own;
- restart: the head's first step after a step of another kind (its catch-up forward);
- head: the head's step after a head step (chained, or proposed after a read);
- plain: one token a request (the adaptive policy's plain mode).
A config without a hybrid (EAGLE-3 alone, NGRAM) has no choice events: its drafting steps
are all of one kind, draft.

On an H100 (1.5B, the kept head, code-types at batch 1, 195b37f) this split showed where the
hybrid lost to NGRAM alone (138 against 97 ms): trie steps of 2.71 ms where NGRAM's took 2.17,
and detours to the head (4 restarts of ~5 ms and 10 head steps committing 3.6 tokens each,
where trie steps committed 12.2).

`python -m lab.hybrid_step_kinds TRACES [--runs "code-types c1" ...]`: TRACES is a folder of
per-config folders with policy_trace.jsonl (the traces tar, unpacked); one JSON line per
(config, run) with each kind's steps, milliseconds and tokens.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

KINDS = ("trie", "restart", "head", "draft", "plain")


def step_kinds(events: list[dict]) -> dict[str, dict[str, float]]:
    """Steps, milliseconds and committed tokens of each kind over one run's events, in order."""
    totals = {kind: {"steps": 0, "ms": 0.0, "tokens": 0} for kind in KINDS}
    hybrid = any(event["e"] == "source" for event in events)
    choice, previous = None, "plain"
    for event in events:
        if event["e"] == "source" and event["kind"] == "choose":
            choice = event
        elif event["e"] == "step":
            kind = kind_of(event, choice, previous) if hybrid else ("plain" if is_plain(event) else "draft")
            totals[kind]["steps"] += 1
            totals[kind]["ms"] += event["ms"]
            totals[kind]["tokens"] += event["tokens"]
            previous, choice = ("head" if kind == "restart" else kind), None
    return totals


def kind_of(step: dict, choice: dict | None, previous: str) -> str:
    """A hybrid's step, by the choice made for it (None: none, a chained step) and the kind before it."""
    if is_plain(step):
        return "plain"
    if choice is not None and choice.get("taken", 0) > 0:
        return "trie"
    return "head" if previous == "head" else "restart"


def is_plain(step: dict) -> bool:
    return step["plain"] or step["tree"] <= 1


def runs_of(path: Path) -> dict[str, list[dict]]:
    """A policy_trace.jsonl's events by run, in order; warm-ups left out."""
    runs: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        event = json.loads(line)
        if "warm-up" not in event["run"]:
            runs.setdefault(event["run"], []).append(event)
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("traces", type=Path, help="a folder of CONFIG/policy_trace.jsonl")
    parser.add_argument("--runs", nargs="*", default=None, help="run name prefixes, e.g. 'code-types c1'")
    ns = parser.parse_args()
    for path in sorted(ns.traces.glob("*/policy_trace.jsonl")):
        for run, events in runs_of(path).items():
            if ns.runs is None or any(run.startswith(prefix + " ") for prefix in ns.runs):
                totals = step_kinds(events)
                print(json.dumps({"config": path.parent.name, "run": run,
                                  "ms": round(sum(t["ms"] for t in totals.values()), 1),
                                  **{kind: {**t, "ms": round(t["ms"], 1)} for kind, t in totals.items() if t["steps"]}}))


if __name__ == "__main__":
    main()
