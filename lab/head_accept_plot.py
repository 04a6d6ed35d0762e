"""Held-out accept length against training tokens, from train_eagle logs (one run, or one
run resumed over several calls: their "held-out accept length by step" lines merged).

  python -m lab.head_accept_plot LOG --batch-tokens 32768 --out accept.png   (prints a markdown table too)
"""
from __future__ import annotations

import argparse
import re

_SCORES = re.compile(r"held-out accept length by step: (.*?);")
_BEFORE = re.compile(r"held-out accept length before training: ([\d.]+)")


def scores(log: str) -> list[tuple[int, float]]:
    """(optimizer step, accept length) of every evaluation in the log, step 0 the untrained head's."""
    points: dict[int, float] = {}
    before = _BEFORE.search(log)
    if before:
        points[0] = float(before.group(1))
    for line in _SCORES.findall(log):
        for item in line.split():
            step, value = item.split(":")
            points[int(step)] = float(value)
    return sorted(points.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log")
    parser.add_argument("--batch-tokens", type=int, default=32768)
    parser.add_argument("--out", default=None, help="a PNG (needs matplotlib)")
    args = parser.parse_args()
    with open(args.log, encoding="utf-8") as f:
        points = scores(f.read())
    print("| optimizer steps | training tokens (M) | held-out accept length |\n|---|---|---|")
    for step, value in points:
        print(f"| {step} | {step * args.batch_tokens / 1e6:.1f} | {value:.3f} |")
    if args.out and points:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([s * args.batch_tokens / 1e6 for s, _ in points], [v for _, v in points], marker="o")
        ax.set_xlabel("training tokens (millions, padded batches)")
        ax.set_ylabel("held-out accept length\n(tokens per 3-draft chain step)")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
