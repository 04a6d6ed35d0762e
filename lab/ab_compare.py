"""Two trees' suite rows, cell by cell: is the difference more than the rounds' spread?

A cell's ratio (a speculative config's tok/s over plain's, the same round) moves 2-5% from round to
round on one tree (H100, 1.5B, ShareGPT at 32/64: 0.89-0.98 over 16 rounds of one commit), as much as
the changes the suite A/Bs are meant to judge. For each cell this prints both trees' median ratios, their
rounds, and the share of label permutations whose difference of medians is at least the observed one
(two-sided): a cell with p >= 0.1 has not moved beyond its spread. Read p with the number of cells in
mind, and the rounds of one process are not independent: an A/A run (16 rounds of one commit split 8 / 8,
2026-12-06) had one of its 8 cells at p = 0.04 (1.7 points apart) and one at 0.10 (2.6 points).

    python -m lab.ab_compare OLD_DIR... -- NEW_DIR...

Each DIR is a gpu_suite output folder (its results.jsonl), e.g. `$OUT/suite_head_MODEL` and
`$OUT/suite_main_MODEL`, from any number of calls.
"""
from __future__ import annotations

import collections
import itertools
import json
import random
import statistics
import sys
from pathlib import Path

from specserve.bench.report import speed_rows

PERMUTATIONS = 20_000   # sampled where the exact count would be larger


def cell_ratios(dirs: list[str]) -> dict[tuple, list[float]]:
    """(workload, turn, concurrency, config) -> the ratio to plain of each round, over all dirs
    (report.speed_rows pairs each round with plain's of the same run)."""
    ratios: dict[tuple, list[float]] = collections.defaultdict(list)
    for folder in dirs:
        rows = [json.loads(line) for line in (Path(folder) / "results.jsonl").read_text().splitlines() if line]
        for cell in speed_rows(rows):
            if cell["config"] != "plain" and cell["speedup"] is not None:
                key = (cell["workload"], cell["turn"], cell["concurrency"], cell["config"])
                ratios[key] += cell["round_speedups"] or [cell["speedup"]]
    return ratios


def permutation_p(old: list[float], new: list[float], rng: random.Random) -> float:
    """Two-sided: how often relabelled rounds differ in median by at least the observed amount."""
    observed = abs(statistics.median(new) - statistics.median(old))
    pooled, n_old = old + new, len(old)
    exact = list(itertools.combinations(range(len(pooled)), n_old))
    if len(exact) <= PERMUTATIONS:
        splits = exact
    else:
        splits = [rng.sample(range(len(pooled)), n_old) for _ in range(PERMUTATIONS)]
    hits = 0
    for chosen in splits:
        picked = set(chosen)
        a = [pooled[i] for i in picked]
        b = [pooled[i] for i in range(len(pooled)) if i not in picked]
        hits += abs(statistics.median(b) - statistics.median(a)) >= observed - 1e-12
    return hits / len(splits)


def compare(old_dirs: list[str], new_dirs: list[str], seed: int = 0) -> list[dict]:
    old, new, rng = cell_ratios(old_dirs), cell_ratios(new_dirs), random.Random(seed)
    rows = []
    for cell in sorted(old.keys() & new.keys()):
        a, b = old[cell], new[cell]
        rows.append({"workload": cell[0], "turn": cell[1], "concurrency": cell[2], "config": cell[3],
                     "old": statistics.median(a), "new": statistics.median(b), "old_rounds": a, "new_rounds": b,
                     "p": permutation_p(a, b, rng) if len(a) > 1 and len(b) > 1 else None})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| workload | turn | conc. | config | old (median) | new (median) | p | old rounds | new rounds |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r["new"]):
        rounds = lambda v: " ".join(f"{x:.3f}" for x in sorted(v))
        p = "-" if r["p"] is None else f"{r['p']:.2f}"
        lines.append(f"| {r['workload']} | {r['turn']} | {r['concurrency']} | {r['config']} | {r['old']:.3f} | "
                     f"{r['new']:.3f} | {p} | {rounds(r['old_rounds'])} | {rounds(r['new_rounds'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    if "--" not in args or args.index("--") == 0 or args.index("--") == len(args) - 1:
        raise SystemExit(__doc__)
    split = args.index("--")
    print(table(compare(args[:split], args[split + 1:])))


if __name__ == "__main__":
    main()
