"""The peer benchmark's picture: per model, specserve's best over the best peer in every
cell, worst first, one bar per cell and a line at 1.0 (below it a peer is ahead), so the
cells to work on show at a glance. Written beside peers_table.md where matplotlib exists.
"""
from __future__ import annotations

from collections.abc import Sequence

CellKey = tuple[str, str, int, int]     # (model, workload, turn, concurrency), as peers_report's


def plot_ratios(ratios: Sequence[tuple[CellKey, float | None]], label_of, path: str) -> bool:
    """ratios: (cell, specserve / best peer) pairs, worst first (peers_report.ratio_rows);
    label_of(workload, turn) names a cell. Returns False where matplotlib is missing or
    no cell has both sides measured."""
    by_model: dict[str, list[tuple[str, float]]] = {}
    for (model, workload, turn, concurrency), ratio in ratios:
        if ratio is not None:
            by_model.setdefault(model, []).append((f"{label_of(workload, turn)} @{concurrency}", ratio))
    if not by_model:
        return False
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    tallest = max(len(bars) for bars in by_model.values())
    figure, axes = plt.subplots(1, len(by_model), figsize=(6.5 * len(by_model), 0.28 * tallest + 1.5), squeeze=False)
    for axis, (model, bars) in zip(axes[0], sorted(by_model.items())):
        names, values = zip(*reversed(bars))   # the worst cell on top
        colors = ["tab:red" if value < 1.0 else "tab:green" for value in values]
        axis.barh(range(len(values)), values, color=colors)
        axis.set_yticks(range(len(values)), names, fontsize=7)
        axis.axvline(1.0, color="black", linewidth=0.8)
        axis.set_xlabel("specserve / best peer (output tok/s)")
        axis.set_title(model, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True
