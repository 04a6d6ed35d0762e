"""The peer benchmark's table: tok/s per (engine x algorithm) per (model, workload, turn,
concurrency) cell, specserve's best over the best peer's, worst cell first; greedy
agreement with specserve plain; every error a peer met, by name.

Rows come from one or more peers.jsonl files (one GPU call cannot run every engine, so the
results of several calls are merged here):
`python -m specserve.bench.peers report RESULTS.jsonl... --out DIR` (peers_table.md, and
peers_ratio.png where matplotlib exists: peers_plot.py).
"""
from __future__ import annotations

import json
import os
from collections import defaultdict

from specserve.bench.peers_engines import ENGINES, REFERENCE
from specserve.bench.peers_plot import plot_ratios

CellKey = tuple[str, str, int, int]     # (model, workload, turn, concurrency)


def load_rows(paths: list[str]) -> list[dict]:
    """Every file's rows; an engine row gets the date of its file's device row, so a table
    merged from several days says which engine ran when."""
    rows = []
    for path in paths:
        date = None
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                row = json.loads(line)
                if row.get("kind") == "device":
                    date = row.get("date")
                elif row.get("kind") == "engine" and date and "date" not in row:
                    row["date"] = date
                rows.append(row)
    return rows


def cell_label(workload: str, turn: int) -> str:
    """sharegpt-repeat runs its list twice: turn 1 is first turns, turn 2 the repeat."""
    if workload == "sharegpt-repeat":
        return "sharegpt-first-turns" if turn == 1 else "sharegpt-repeat (turn 2)"
    return workload


def collect(rows: list[dict]) -> tuple[dict[CellKey, dict[str, dict]], list[str]]:
    """cell -> engine config -> its latest row; and the engine configs in table order. An
    engine that failed before measuring anything (no wheels, a start-up crash) gets an
    error row in every cell of its model, so the table shows the failure."""
    cells: dict[CellKey, dict[str, dict]] = defaultdict(dict)
    for row in rows:
        if row.get("kind") == "cell":
            cells[(row["model"], row["workload"], row["turn"], row["concurrency"])][row["engine"]] = row
    for row in rows:
        if row.get("kind") == "engine" and row.get("error"):
            for key, by_engine in cells.items():
                if key[0] == row["model"] and row["engine"] not in by_engine:
                    by_engine[row["engine"]] = {**row, "kind": "cell"}
    seen = {engine for by_engine in cells.values() for engine in by_engine}
    order = [name for name in ENGINES if name in seen] + sorted(seen - set(ENGINES))
    return cells, order


def agreement(row: dict, reference: dict | None) -> float | None:
    """Fraction of prompts whose greedy output equals specserve plain's (bf16: not required);
    None for a sampled cell (each engine samples its own answers)."""
    mine, theirs = row.get("output_hashes"), (reference or {}).get("output_hashes")
    if not mine or not theirs or len(mine) != len(theirs) or row.get("temperature"):
        return None
    return sum(a == b for a, b in zip(mine, theirs)) / len(mine)


def best(by_engine: dict[str, dict], family: str | None, exclude: str | None = None) -> tuple[str, float] | None:
    """The fastest config of `family` (None: every engine but `exclude`) in one cell."""
    scores = [(name, row["tok_s"]) for name, row in by_engine.items()
              if row.get("tok_s") and (row["engine_family"] == family if family else row["engine_family"] != exclude)]
    return max(scores, key=lambda item: item[1]) if scores else None


def ratio_rows(cells: dict[CellKey, dict[str, dict]]) -> list[tuple[CellKey, float | None]]:
    """Every cell with specserve best / best peer (None when either is missing), worst first."""
    ratios = []
    for key, by_engine in cells.items():
        ours, peer = best(by_engine, "specserve"), best(by_engine, None, exclude="specserve")
        ratios.append((key, ours[1] / peer[1] if ours and peer else None))
    return sorted(ratios, key=lambda item: (item[1] is None, item[1] or 0.0, item[0]))


def speed_table(cells: dict[CellKey, dict[str, dict]], order: list[str]) -> list[str]:
    header = ["model", "workload", "conc"] + order + ["specserve / best peer"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for key, ratio in ratio_rows(cells):
        model, workload, turn, concurrency = key
        by_engine = cells[key]
        peer = best(by_engine, None, exclude="specserve")
        values = [_speed_cell(by_engine.get(name)) for name in order]
        verdict = f"**{ratio:.2f}x** (vs {peer[0]})" if ratio is not None else "n/a"
        lines.append("| " + " | ".join([model, cell_label(workload, turn), str(concurrency), *values, verdict]) + " |")
    return lines


def _speed_cell(row: dict | None) -> str:
    if row is None:
        return "-"
    if row.get("error"):
        return "not run" if row["error"].startswith("not run") else "failed"
    return f"{row['tok_s']:.0f}"


def agreement_table(cells: dict[CellKey, dict[str, dict]], order: list[str]) -> list[str]:
    lines = ["| engine | greedy outputs equal to specserve-plain | cells |", "|---|---|---|"]
    for name in order:
        rates = [rate for by_engine in cells.values() if name in by_engine
                 for rate in [agreement(by_engine[name], by_engine.get(REFERENCE))] if rate is not None]
        mean = f"{sum(rates) / len(rates):.0%}" if rates else "n/a"
        lines.append(f"| {name} | {mean} | {len(rates)} |")
    return lines


def drafting_table(cells: dict[CellKey, dict[str, dict]], order: list[str]) -> list[str]:
    """Per speculative server whose cells carry counts (specserve's, vLLM's): its accept length
    over the cells (tokens per decode step), and in how many cells it drafted at all
    (specserve's adaptive policy may keep every step plain, where the row measures plain
    decoding plus the drafter's upkeep)."""
    lines = ["| engine | cells | accept length (min / median / max) | cells that drafted |", "|---|---|---|---|"]
    for name in order:
        accepts = sorted(by_engine[name]["accept_length"] for by_engine in cells.values()
                         if by_engine.get(name, {}).get("accept_length") is not None)
        if accepts:
            drafted = sum(accept > 1.005 for accept in accepts)
            lines.append(f"| {name} | {len(accepts)} | {accepts[0]:.2f} / {accepts[len(accepts) // 2]:.2f} / "
                         f"{accepts[-1]:.2f} | {drafted} of {len(accepts)} |")
    return lines


def engine_lines(rows: list[dict]) -> list[str]:
    """Which build of each engine configuration the table's numbers come from, and when, and
    the KV tokens it had room for (all run at the same memory fraction)."""
    latest = {(r["model"], r["engine"]): r for r in rows if r.get("kind") == "engine" and not r.get("error")}
    lines = ["| model | engine | version | date | start-up (s) | KV tokens |", "|---|---|---|---|---|---|"]
    for (model, engine), row in sorted(latest.items()):
        kv_tokens = row.get("kv_tokens")
        lines.append(f"| {model} | {engine} | {row.get('version', '?')} | {row.get('date', '?')} | "
                     f"{row.get('startup_s', '?')} | {'?' if kv_tokens is None else f'{kv_tokens:,}'} |")
    return lines


def error_lines(rows: list[dict]) -> list[str]:
    """One line per distinct (engine, model, error): what a reader needs to rerun it. An
    engine's start-up failure that another merged file's run of that engine and model got
    past (it measured cells) is left out: the table shows that run's numbers."""
    measured = {(r["model"], r["engine"]) for r in rows if r.get("kind") == "cell" and not r.get("error")}
    seen, lines = set(), []
    for row in rows:
        error = row.get("error")
        if not error or (row.get("kind") == "engine" and (row.get("model"), row.get("engine")) in measured):
            continue
        first = " ".join(error.split())[:300]
        key = (row.get("engine"), row.get("model"), first)
        if key not in seen:
            seen.add(key)
            lines.append(f"- {row.get('engine')} on {row.get('model')} ({row.get('kind')}): `{first}`")
    return lines


def render(rows: list[dict]) -> str:
    cells, order = collect(rows)
    info = [r for r in rows if r.get("kind") in ("device", "engine")]
    devices = sorted({f"{r['name']} ({r.get('date', '')})" for r in info if r["kind"] == "device"})
    versions = sorted({r["version"] for r in info if r["kind"] == "engine" and r.get("version")})
    parts = ["# Peers: specserve, vLLM and SGLang on the same GPU, model directory and prompts", "",
             f"Device: {', '.join(devices) or 'unknown'}. Versions: {', '.join(versions) or 'unknown'}.",
             "Output tok/s of one client (streaming /v1/completions, greedy, fixed output length with ignore_eos); "
             "cells sorted by specserve's best over the best peer, worst first." + _size_note(rows), ""]
    parts += speed_table(cells, order) + ["", "## Greedy agreement (bf16; reported, not required)", ""]
    parts += agreement_table(cells, order)
    drafting = drafting_table(cells, order)
    if len(drafting) > 2:
        parts += ["", "## Drafting of the speculative servers that count it (specserve's, vLLM's)", ""] + drafting
    parts += ["", "## Engines measured", ""] + engine_lines(rows)
    errors = error_lines(rows)
    if errors:
        parts += ["", "## Errors", ""] + errors
    return "\n".join(parts) + "\n"


def _size_note(rows: list[dict]) -> str:
    """What a size workload's tok_s reads (bench/size_workloads.py), where the table has one."""
    kinds = {r["workload"].split("-")[0] for r in rows if r.get("kind") == "cell" and "prompt_len" in r}
    notes = {"prefill": "prefill-N cells: prompt tokens per second of time to first token, one prompt at a time",
             "context": "context-N cells: decode tokens per second with N tokens of context (the prefill left out)"}
    return "".join(f" {notes[kind]}." for kind in sorted(kinds) if kind in notes)


def write_report(paths: list[str], out_dir: str) -> str:
    """peers_table.md, and peers_ratio.png beside it where matplotlib exists."""
    os.makedirs(out_dir, exist_ok=True)
    rows = load_rows(paths)
    path = os.path.join(out_dir, "peers_table.md")
    with open(path, "w") as f:
        f.write(render(rows))
    plot_ratios(ratio_rows(collect(rows)[0]), cell_label, os.path.join(out_dir, "peers_ratio.png"))
    return path
