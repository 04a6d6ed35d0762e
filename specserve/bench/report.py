"""Turns a benchmark's results.jsonl into a Markdown table and (where matplotlib exists) a
PNG plot: `python -m specserve.bench.report results.jsonl OUT_DIR`."""
from __future__ import annotations

import collections
import json
import math
import os
import sys


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def speed_rows(rows: list[dict]) -> list[dict]:
    """One row per (model, workload, concurrency, turn, config), with its speed over plain.
    A cell measured in several rounds (gpu_suite --rounds: plain and each configuration
    alternated) is divided round by round, then the median round (by speedup) stands for
    it, with every round's speedup beside it in `round_speedups`. Several suite runs appended to
    one file repeat the round numbers: a round's i-th run of a configuration goes with plain's i-th."""
    groups = collections.defaultdict(lambda: collections.defaultdict(dict))
    seen = collections.Counter()   # (cell, round, config) -> its runs so far
    for row in rows:
        if row.get("kind") == "specserve":
            key = (row["model"], row["workload"], row["concurrency"], row.get("turn", 1))
            round_ = (row.get("round", 0), seen[key, row.get("round", 0), row["config"]])
            seen[key, round_[0], row["config"]] += 1
            groups[key][round_][row["config"]] = row
    table = []
    for (model, workload, concurrency, turn), rounds in sorted(groups.items()):
        measured = collections.defaultdict(list)   # config -> [(speedup, run)] over rounds
        for runs in rounds.values():
            plain = runs.get("plain")
            for config, run in runs.items():
                measured[config].append((run["output_tokens_per_s"] / plain["output_tokens_per_s"]
                                         if plain else None, run))
        for config, results in sorted(measured.items()):
            ranked = sorted(results, key=lambda result: (result[0] is None, result[0] or 0.0,
                                                         result[1]["output_tokens_per_s"]))
            speedup, run = ranked[(len(ranked) - 1) // 2]
            table.append({"model": model, "workload": workload, "concurrency": concurrency, "turn": turn,
                          "config": config, "tok_s": run["output_tokens_per_s"],
                          "accept_length": run.get("accept_length"), "speedup": speedup,
                          "round_speedups": [s for s, _ in results] if len(results) > 1 else None,
                          "roofline_fraction": run.get("roofline_fraction"),
                          "longest_step_s": run.get("longest_step_s"), "jit_compile_s": run.get("jit_compile_s"),
                          "valid_fraction": run.get("valid_fraction")})
    return table


# what default flags run, where the device row does not say (gpu_suite's `default_config`: on a GPU
# since 2026-12-06 with the forecast, ngram-16-one-adaptive-forecast2; before 2026-11-25 ngram-8-multi-adaptive)
DEFAULT_LABEL = "ngram-16-one-adaptive"


def default_label(rows: list[dict]) -> str:
    """The configuration default flags ran in these rows (their device row's word, else DEFAULT_LABEL)."""
    return next((r["default_config"] for r in rows if r.get("kind") == "device" and r.get("default_config")),
                DEFAULT_LABEL)


BEST_CASES = {("code-rename", 1), ("sharegpt-repeat", 2)}   # drafts trivially right: labelled as such


def cell_name(workload: str, turn: int) -> str:
    if workload == "sharegpt-repeat":
        return "sharegpt first turns" if turn == 1 else "sharegpt repeated turn (best case)"
    return workload + (" (best case)" if (workload, turn) in BEST_CASES else "")


def ratio_summary(rows: list[dict]) -> list[str]:
    """The default configuration's speed over plain per (model, workload, concurrency), worst
    first, then the geometric mean of every configuration over all cells."""
    table = [r for r in speed_rows(rows) if r["speedup"] is not None and r["config"] != "plain"]
    label = default_label(rows)
    default = sorted((r for r in table if r["config"] == label), key=lambda r: r["speedup"])
    if not default:
        return []
    lines = ["\n**Default flags (NGRAM, adaptive) vs plain, worst cell first** (several rounds: the median "
             "round's ratio, every round's beside it)\n",
             "| model | workload | conc. | vs plain | rounds | accept len | tok/s |", "|---|---|---|---|---|---|---|"]
    for r in default:
        rounds = " ".join(f"{x:.2f}" for x in r["round_speedups"]) if r["round_speedups"] else ""
        lines.append(f"| {r['model']} | {cell_name(r['workload'], r['turn'])} | {r['concurrency']} | "
                     f"{r['speedup']:.2f}x | {rounds} | {r['accept_length'] or 1:.2f} | {r['tok_s']:.0f} |")
    lines += ["\n| model | config | geomean vs plain over cells | worst cell |", "|---|---|---|---|"]
    by_config = collections.defaultdict(list)
    for r in table:
        by_config[(r["model"], r["config"])].append(r["speedup"])
    for (model, config), speedups in sorted(by_config.items()):
        geomean = math.exp(sum(math.log(x) for x in speedups) / len(speedups))
        lines.append(f"| {model} | {config} | {geomean:.2f}x ({len(speedups)} cells) | {min(speedups):.2f}x |")
    return lines


def markdown(rows: list[dict]) -> str:
    lines = ratio_summary(rows)
    for row in rows:
        if row.get("kind") == "device":
            lines.append(f"Device: {row['name']}, measured copy bandwidth {row['copy_bandwidth_GBps']:.0f} GB/s, {row['date']}\n")
        if row.get("kind") == "roofline":
            lines.append(f"- {row['model']}: weights {row['weight_bytes'] / 1e6:.0f} MB -> roofline "
                         f"{row['roofline_tok_s_bs1']:.0f} tok/s at batch 1")
        if row.get("kind") == "greedy_match_rate_bf16":
            lines.append(f"- {row['model']}: bf16 greedy outputs identical with/without NGRAM ({row['ngram']}): {row['rate']:.0%}")
    lines.append("\n| model | workload | conc. | turn | config | tok/s | accept len | vs plain | of roofline "
                 "| longest step (ms) | JIT compiles (s) | valid answers |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
    fmt = lambda v, f: "" if v is None else format(v, f)
    for r in speed_rows(rows):
        longest_ms = None if r["longest_step_s"] is None else r["longest_step_s"] * 1e3
        lines.append(f"| {r['model']} | {r['workload']} | {r['concurrency']} | {r['turn']} | {r['config']} | "
                     f"{r['tok_s']:.1f} | {fmt(r['accept_length'], '.2f')} | {fmt(r['speedup'], '.2f')}x | "
                     f"{fmt(r['roofline_fraction'], '.0%')} | "
                     f"{fmt(longest_ms, '.1f')} | {fmt(r['jit_compile_s'], '.2f')} | {fmt(r['valid_fraction'], '.0%')} |")
    lines += compile_lines(rows)
    hf = [r for r in rows if r.get("kind") == "transformers"]
    if hf:
        lines.append("\n| model | workload | transformers config (batch 1) | tok/s |")
        lines.append("|---|---|---|---|")
        for r in hf:
            lines.append(f"| {r['model']} | {r['workload']} | {r['config']} | {r['output_tokens_per_s']:.1f} |")
    return "\n".join(lines) + "\n"


def compile_lines(rows: list[dict]) -> list[str]:
    """Every timed run (each round, not only the median) that compiled a Triton kernel: which
    kernel, for how long, and its specialisation (what made it new), to find the shape the
    warm-up missed."""
    lines = []
    for r in rows:
        for kernel in r.get("jit_kernels") or ():
            seconds = "" if kernel["s"] is None else f" {kernel['s']:.2f} s"
            round_ = "" if r.get("round") is None else f" round {r['round']}"
            lines.append(f"- {r['model']} {r['workload']} turn {r.get('turn', 1)} at {r['concurrency']}, "
                         f"{r['config']}{round_}: `{kernel['kernel']}`{seconds}: {kernel['specialization']}")
    return ["\n**Kernels compiled inside a timed run**\n", *lines] if lines else []


def plot(rows: list[dict], path: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shown = ("plain", default_label(rows), "ngram-8-multi", "ngram-8-multi-adaptive")
    table = [r for r in speed_rows(rows) if r["config"] in shown]
    models = sorted({r["model"] for r in table})
    fig, axes = plt.subplots(1, max(len(models), 1), figsize=(6 * max(len(models), 1), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        for workload, style in (("code-types", "-"), ("sharegpt-multiturn", "--")):
            for config in shown:
                points = sorted((r["concurrency"], r["tok_s"]) for r in table if r["model"] == model
                                and r["workload"] == workload and r["config"] == config)
                if points:
                    ax.plot(*zip(*points), style, marker="o", label=f"{workload} {config}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(model)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tok/s")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def write_report(results_path: str, out_dir: str) -> None:
    rows = load(results_path)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(markdown(rows))
    plot(rows, os.path.join(out_dir, "speed.png"))


if __name__ == "__main__":
    write_report(sys.argv[1], sys.argv[2])
